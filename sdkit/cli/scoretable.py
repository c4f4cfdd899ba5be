"""`sdkit scoretable`: exact score-table sizes, and attention measured three ways (sdkit.scoretable)."""

from __future__ import annotations

from ..common import parse_bytes
from .common import PRESET_NAMES, add_json, check_outputs, positive_int, progress_bar, refuse_options, show_result

# Read only when measuring; given without --measure they are refused, never ignored.
MEASURE_ONLY = ("tokens", "heads", "head_dim", "measure_dtype", "device", "implementations", "budget", "repeats")
DTYPES = ("float16", "bfloat16", "float32")  # scoretable.DTYPES, named without importing torch


def cmd_scoretable(args) -> None:
    check_outputs(args, pictures=("plot",))
    if not args.measure:
        refuse_options(args, MEASURE_ONLY, "without --measure")
    if not (args.measure or args.plot):
        refuse_options(args, ("chunk_budget",), "without --measure or --plot")
    if args.height is not None or args.width is not None:
        refuse_options(args, ("size",), "with --height or --width (the size is theirs)")
    from ..scoretable import (
        format_measurements,
        format_score_tables,
        measure,
        plot,
        resolve_device,
        score_tables,
    )

    height = args.height if args.height is not None else args.size
    width = args.width if args.width is not None else height
    tables = score_tables(height, width, args.model, args.dtype, args.batch, args.cfg, args.text_tokens)
    measured = []
    if args.measure:
        finest = tables.levels[0]
        device = resolve_device(args.device)
        dtype = args.measure_dtype or ("float16" if device.startswith("cuda") else "float32")
        implementations = args.implementations.split(",")
        with progress_bar(args, total=len(implementations), desc="measuring", unit="impl") as bar:
            measured = measure(
                args.tokens or finest.tokens,
                args.heads or finest.heads,
                args.head_dim or finest.head_dim,
                dtype,
                device,
                implementations,
                args.chunk_budget,
                args.budget,
                args.repeats,
                progress=bar,
            )
    if args.plot:
        plot(tables, measured, args.plot, args.chunk_budget)
    from dataclasses import asdict

    table = format_score_tables(tables)
    if measured:
        table += "\n\n" + format_measurements(measured)
    if args.plot:
        table += f"\n\nwrote {args.plot}"
    show_result(args, {**tables.to_json(), "measured": [asdict(m) for m in measured]}, table)


def register(sub) -> None:
    p = sub.add_parser(
        "scoretable",
        help="score-table sizes: the latent grid against pixel-level attention",
        description="Exact self-attention score-table sizes per U-Net level and for a pixel-level "
        "model, the cross-attention tables (cells x text tokens) and a size sweep at the "
        "requested aspect ratio; with --measure, one attention run naive, chunked and with SDPA.",
    )
    p.add_argument(
        "--size", type=positive_int, help="square image side in pixels (default: the model's own, e.g. 512 for SD 1.5)"
    )
    p.add_argument("--height", type=positive_int, help="image height (with --width, for non-square images)")
    p.add_argument("--width", type=positive_int, help="image width (default: the height)")
    p.add_argument(
        "--model",
        "--preset",
        default="sd15",
        help=f"U-Net whose levels, heads and head sizes to use: a preset ({PRESET_NAMES}), a diffusers "
        "U-Net or pipeline folder, or a checkpoint file (shapes only, nothing loaded)",
    )
    p.add_argument("--batch", type=positive_int, default=1, help="images per batch")
    p.add_argument("--cfg", action="store_true", help="classifier-free guidance (doubles the batch)")
    p.add_argument("--dtype", choices=DTYPES, default="float16", help="dtype of the analytic tables")
    p.add_argument(
        "--text-tokens",
        type=positive_int,
        help="text tokens the cross-attention reads (default: the model's tokenizer length, else SD's 77)",
    )
    p.add_argument("--measure", action="store_true", help="also run one self-attention and measure it")
    p.add_argument("--tokens", type=positive_int, help="tokens to measure at (default: the finest latent level)")
    p.add_argument("--heads", type=positive_int, help="heads to measure with (default: the finest level's)")
    p.add_argument("--head-dim", type=positive_int, help="head size to measure with (default: the finest level's)")
    p.add_argument(
        "--measure-dtype", choices=DTYPES, help="dtype to measure in (default: float16 on CUDA, float32 on CPU)"
    )
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda or cuda:N")
    p.add_argument(
        "--implementations", default="naive,chunked,sdpa", help="comma-separated subset of naive, chunked, sdpa"
    )
    p.add_argument(
        "--budget",
        type=parse_bytes,
        metavar="SIZE",
        help="memory to allow, e.g. 8GiB, 512MiB or bytes (default: what the device has free)",
    )
    p.add_argument(
        "--chunk-budget",
        type=parse_bytes,
        default="64MiB",
        metavar="SIZE",
        help="bytes of scores per chunk of query rows, e.g. 64MiB",
    )
    p.add_argument("--repeats", type=positive_int, default=3, help="timed runs per implementation (median reported)")
    p.add_argument("--plot", metavar="FILE.png", help="draw tokens against bytes, log-log")
    add_json(p)
    p.set_defaults(func=cmd_scoretable)
