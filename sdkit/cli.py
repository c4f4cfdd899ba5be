"""The `sdkit` command: a thin layer over the library; each subcommand calls one function."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import warnings

from .common import SdkitError, write_json


def _emit_json(data, target: str) -> None:
    if target == "-":
        print(json.dumps(data, indent=2))
    else:
        write_json(target, data)
        print(f"wrote {target}", file=sys.stderr)


def _add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", nargs="?", const="-", metavar="FILE",
                   help="write the result as JSON (to stdout, or to FILE)")  # fmt: skip


def cmd_audit(args) -> None:
    from .audit import audit, format_audit

    result = audit(args.model, allow_pickle=args.allow_pickle, context_dim=args.context_dim, image_size=args.image_size)
    if args.json:
        _emit_json(result.to_json(), args.json)
    if args.json != "-":
        print(format_audit(result))


def cmd_scoretable(args) -> None:
    from tqdm import tqdm

    from .scoretable import (format_measurements, format_score_tables, measure, plot, resolve_device,
                             score_tables)  # fmt: skip

    height = args.height or args.size
    tables = score_tables(height, args.width or height, args.preset, args.dtype, args.batch, args.cfg)
    measured = []
    if args.measure:
        finest = tables.levels[0]
        device = resolve_device(args.device)
        dtype = args.measure_dtype or ("float16" if device.startswith("cuda") else "float32")
        implementations = args.implementations.split(",")
        with tqdm(total=len(implementations), desc="measuring", unit="impl", leave=False) as bar:
            measured = measure(args.tokens or finest.tokens, args.heads or finest.heads,
                               args.head_dim or finest.head_dim, dtype, device, implementations,
                               args.chunk_budget, args.budget, args.repeats, progress=bar)  # fmt: skip
    if args.plot:
        plot(tables, measured, args.plot, args.chunk_budget)
    if args.json:
        from dataclasses import asdict

        _emit_json({**tables.to_json(), "measured": [asdict(m) for m in measured]}, args.json)
    if args.json != "-":
        print(format_score_tables(tables))
        if measured:
            print("\n" + format_measurements(measured))
        if args.plot:
            print(f"\nwrote {args.plot}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sdkit", description=__doc__.split("\n")[0].removesuffix("."))
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("audit", help="count a U-Net's parameters by role (attention vs MLP vs ...)",
                       description="Count a U-Net's parameters by role. A .safetensors file is counted "
                                   "from its header alone, without reading tensor data.")  # fmt: skip
    p.add_argument("model", nargs="?", default="sd15",
                   help="preset (sd15, sd21, sdxl, tiny), diffusers folder, or checkpoint file (default: sd15)")  # fmt: skip
    p.add_argument("--context-dim", type=int, metavar="N",
                   help="also report what a text encoder of width N changes in the U-Net (e.g. 1024)")  # fmt: skip
    p.add_argument("--image-size", type=int, default=512, help="image size for the latent side per level")
    p.add_argument("--allow-pickle", action="store_true",
                   help="read .ckpt/.bin/.pt files (with torch.load(weights_only=True))")  # fmt: skip
    _add_json(p)
    p.set_defaults(func=cmd_audit)

    from .common import parse_bytes

    p = sub.add_parser("scoretable", help="score-table sizes: the latent grid against pixel-level attention",
                       description="Exact self-attention score-table sizes per U-Net level and for a pixel-level "
                                   "model; with --measure, one attention run naive, chunked and with SDPA.")  # fmt: skip
    p.add_argument("--size", type=int, default=512, help="square image side in pixels (default 512)")
    p.add_argument("--height", type=int, help="image height (with --width, for non-square images)")
    p.add_argument("--width", type=int, help="image width")
    p.add_argument("--preset", default="sd15", help="U-Net whose levels, heads and head sizes to use (default sd15)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--cfg", action="store_true", help="classifier-free guidance (doubles the batch)")
    p.add_argument("--dtype", default="float16", help="dtype of the analytic tables (default float16)")
    p.add_argument("--measure", action="store_true", help="also run one self-attention and measure it")
    p.add_argument("--tokens", type=int, help="tokens to measure at (default: the finest latent level)")
    p.add_argument("--heads", type=int, help="heads to measure with (default: the finest level's)")
    p.add_argument("--head-dim", type=int, help="head size to measure with (default: the finest level's)")
    p.add_argument("--measure-dtype", help="dtype to measure in (default float16 on CUDA, float32 on CPU)")
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu or cuda")
    p.add_argument("--implementations", default="naive,chunked,sdpa", help="comma-separated subset")
    p.add_argument("--budget", type=parse_bytes, help="memory to allow (default: what the device has free)")
    p.add_argument("--chunk-budget", type=parse_bytes, default="64MiB", help="scores per chunk (default 64MiB)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per implementation (median reported)")
    p.add_argument("--plot", metavar="FILE.png", help="draw tokens against bytes, log-log")
    _add_json(p)
    p.set_defaults(func=cmd_scoretable)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    # Library chatter (deprecations, diffusers' info logs) is not the user's problem.
    warnings.filterwarnings("ignore", category=FutureWarning)
    logging.getLogger("diffusers").setLevel(logging.ERROR)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        args.func(args)
    except SdkitError as e:
        print(f"sdkit {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"sdkit {args.command}: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
