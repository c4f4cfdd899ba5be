"""The `sdkit` command: a thin layer over the library; each subcommand calls one function."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import warnings

from .common import SdkitError, write_json


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, like every other input error
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


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


def cmd_condition(args) -> None:
    from tqdm import tqdm

    from .conditioning import (check_width, compare_conditionings, format_comparison, prompt_conditionings,
                               synthetic_conditionings, write_maps)  # fmt: skip
    from .encoders import load_text_encoder
    from .loading import load_unet
    from .presets import PRESETS
    from .scoretable import resolve_device

    device = resolve_device(args.device)
    unet = load_unet(args.unet, allow_pickle=args.allow_pickle).to(device)
    note = "preset with RANDOM weights: the numbers show the mechanism, not what a trained model reads" \
        if args.unet in PRESETS else ""  # fmt: skip
    if args.text_encoder:
        encoder = load_text_encoder(args.text_encoder, args.tokenizer, layer=args.layer)
        conditioning = prompt_conditionings(encoder, args.prompt)
    elif args.tokenizer:
        raise SdkitError("--tokenizer needs --text-encoder (the tokenizer labels the encoder's tokens)")
    else:
        conditioning = synthetic_conditionings(unet.config.cross_attention_dim, seed=args.seed)
    check_width(unet, conditioning)
    with tqdm(total=len(conditioning.cases), desc="forward passes", unit="case", leave=False) as bar:
        result = compare_conditionings(unet, conditioning, args.latent_size, args.timestep, args.seed,
                                       maps=bool(args.maps), map_sides=args.map_sides, unet_name=args.unet, note=note,
                                       progress=bar)  # fmt: skip
    if args.maps:
        paths = write_maps(result, conditioning, args.maps, shared_scale=args.shared_scale)
    if args.json:
        _emit_json(result.to_json(), args.json)
    if args.json != "-":
        print(format_comparison(result))
        if args.maps:
            print(f"\nwrote {len(paths)} PNG maps to {args.maps} (overview: {paths[-1]})")


def cmd_adapter(args) -> None:
    from .adapter import explanation

    if not args.adapter_command:
        print(explanation(args.encoders_dir))
        return
    args.adapter_func(args)


def _train_config(args):
    from .adapter import TrainConfig

    return TrainConfig(max_epochs=args.epochs, lr=args.lr, batch_size=args.batch_size, patience=args.patience,
                       cosine_weight=args.cosine_weight, hidden_dim=args.hidden_dim, seed=args.seed)  # fmt: skip


def _run_comparison(args, new_dir, old_dir, prompts, note: str | None = None) -> None:
    from .adapter import compare_adapters, format_report
    from .encoders import load_text_encoder
    from .loading import load_unet

    new = load_text_encoder(new_dir, layer=args.new_layer)
    old = load_text_encoder(old_dir, layer=args.old_layer)
    unet = load_unet(args.unet, allow_pickle=args.allow_pickle) if args.unet != "none" else None
    kinds = [k for k in args.kinds.split(",") if k]
    from .presets import PRESETS

    unet_name = f"{args.unet} preset, RANDOM weights: shows the check, not a trained SD U-Net" \
        if args.unet in PRESETS else args.unet  # fmt: skip
    report = compare_adapters(new, old, prompts, kinds, _train_config(args), unet, unet_name, args.cache,
                              args.out, args.checkpoints, seed=args.seed, progress=not args.json)  # fmt: skip
    if args.json:
        _emit_json({"encoders": note, **report.to_json()}, args.json)
    if args.json != "-":
        if note:
            print(f"Encoders: {note}\n")
        print(format_report(report))


def cmd_adapter_demo(args) -> None:
    from .adapter import available_pair, generate_prompts

    new_dir, old_dir, note = available_pair(args.encoders_dir)
    _run_comparison(args, new_dir, old_dir, generate_prompts(args.prompts, seed=args.seed), note)


def cmd_adapter_train(args) -> None:
    from .adapter import generate_prompts, read_prompts

    prompts = read_prompts(args.corpus) if args.corpus else generate_prompts(args.generate, seed=args.seed)
    _run_comparison(args, args.new, args.old, prompts)


def cmd_adapter_encode(args) -> None:
    from safetensors.torch import save_file

    from .adapter import adapted_embeddings, load_adapter
    from .common import atomic_path
    from .encoders import load_text_encoder

    adapter = load_adapter(args.adapter)
    encoder = load_text_encoder(args.new, layer=args.new_layer)
    tensors = {"prompt_embeds": adapted_embeddings(adapter, encoder, args.prompts).contiguous()}
    if args.negative is not None:
        negative = adapted_embeddings(adapter, encoder, [args.negative] * len(args.prompts))
        tensors["negative_prompt_embeds"] = negative.contiguous()
    with atomic_path(args.out) as tmp:
        save_file(tensors, str(tmp), metadata={"prompts": json.dumps(args.prompts), "adapter": str(args.adapter)})
    shapes = ", ".join(f"{k} {list(v.shape)}" for k, v in tensors.items())
    print(f"wrote {args.out}: {shapes}")


def _sides(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(side) for side in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of grid sides: {text!r} (e.g. 16,32)") from None


def _latent_size(text: str) -> tuple[int, int]:
    h, _, w = text.lower().partition("x")
    try:
        return int(h), int(w or h)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a latent size: {text!r} (e.g. 64 or 64x96)") from None


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="sdkit", description="Look inside the cross-attention of Stable "
                                     "Diffusion 1.x U-Nets (and SD 2.x / SDXL). Offline; see README.md.")  # fmt: skip
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

    p = sub.add_parser("condition", help="single- vs multi-token conditioning, seen in the cross-attention",
                       description="Run one U-Net, latent and timestep under single-token, repeated-token and "
                                   "multi-token conditioning and trace every cross-attention layer.")  # fmt: skip
    p.add_argument("--unet", default="tiny", help="preset (random weights), diffusers folder or checkpoint (default tiny)")
    p.add_argument("--prompt", default="a photo of a red cat sitting on a blue chair")
    p.add_argument("--text-encoder", metavar="DIR", help="local transformers text encoder (or SD pipeline folder)")
    p.add_argument("--tokenizer", metavar="DIR", help="its tokenizer, when not beside it")
    p.add_argument("--layer", default="last", help="text-encoder layer the U-Net reads: last (SD 1.x) or penultimate (SD 2.x)")
    p.add_argument("--latent-size", type=_latent_size, help="latent grid, e.g. 64 or 64x96 (default: the U-Net's sample size)")
    p.add_argument("--timestep", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--maps", metavar="DIR", help="write a PNG heatmap per word and an overview grid here")
    p.add_argument("--shared-scale", action="store_true", help="one colour scale for all maps")
    p.add_argument("--map-sides", type=_sides, help="only layers with these grid sides in the maps, e.g. 16,32")
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu or cuda")
    p.add_argument("--allow-pickle", action="store_true")
    _add_json(p)
    p.set_defaults(func=cmd_condition)

    p = sub.add_parser("adapter", help="swap the text encoder: train and score a new -> old adapter",
                       description="Swap the text encoder of a frozen SD 1.x U-Net with a trained adapter. "
                                   "Without a subcommand, explains itself.")  # fmt: skip
    p.set_defaults(func=cmd_adapter)
    p.add_argument("--encoders-dir", default="weights/encoders", help=argparse.SUPPRESS)
    adapter_sub = p.add_subparsers(dest="adapter_command", metavar="SUBCOMMAND")

    def training_options(q, default_out):
        q.add_argument("--kinds", default="linear,mlp", help="adapters to train (default linear,mlp)")
        q.add_argument("--unet", default="tiny", help="frozen U-Net for the noise-prediction check (preset, folder, "
                                                      "file, or none; default tiny)")  # fmt: skip
        q.add_argument("--new-layer", default="last", help="layer read from the new encoder (last or penultimate)")
        q.add_argument("--old-layer", default="last", help="layer the U-Net was trained on (SD 1.x: last)")
        q.add_argument("--epochs", type=int, default=24)
        q.add_argument("--patience", type=int, default=8, help="early stopping: epochs without improvement")
        q.add_argument("--lr", type=float, default=2e-3)
        q.add_argument("--batch-size", type=int, default=256, help="tokens per batch")
        q.add_argument("--hidden-dim", type=int, help="mlp hidden width (default: the old encoder's width)")
        q.add_argument("--cosine-weight", type=float, default=0.0, help="add w * (1 - cosine) to the per-token MSE")
        q.add_argument("--seed", type=int, default=0)
        q.add_argument("--cache", default="weights/cache", help="where encoded states are cached")
        q.add_argument("--checkpoints", help="write (and resume from) training checkpoints here")
        q.add_argument("--out", default=default_out, help=f"save the adapters and report.json here (default {default_out})")
        q.add_argument("--allow-pickle", action="store_true")
        _add_json(q)

    q = adapter_sub.add_parser("demo", help="the whole comparison on the best encoders available here")
    q.add_argument("--prompts", type=int, default=600, help="generated prompts (default 600)")
    q.add_argument("--encoders-dir", default="weights/encoders", help="where to look for (or build) encoders")
    training_options(q, "weights/adapters/demo")
    q.set_defaults(adapter_func=cmd_adapter_demo)

    q = adapter_sub.add_parser("train", help="encode a corpus with both encoders, fit, train and score adapters")
    q.add_argument("--new", required=True, metavar="DIR", help="the new text encoder (transformers folder)")
    q.add_argument("--old", required=True, metavar="DIR", help="the encoder the U-Net was trained with")
    q.add_argument("--corpus", metavar="FILE", help="prompts, one per line (default: generated prompts)")
    q.add_argument("--generate", type=int, default=2000, help="how many prompts to generate without --corpus")
    training_options(q, "weights/adapters/latest")
    q.set_defaults(adapter_func=cmd_adapter_train)

    q = adapter_sub.add_parser("encode", help="write prompt embeddings for a frozen SD 1.x U-Net")
    q.add_argument("prompts", nargs="+")
    q.add_argument("--adapter", required=True, metavar="DIR", help="a saved adapter folder")
    q.add_argument("--new", required=True, metavar="DIR", help="the new text encoder the adapter reads")
    q.add_argument("--new-layer", default="last")
    q.add_argument("--negative", help="also write negative_prompt_embeds for this prompt (e.g. '')")
    q.add_argument("--out", required=True, help="a .safetensors file")
    q.set_defaults(adapter_func=cmd_adapter_encode)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' per-load bars; ours stay
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
    except BrokenPipeError:  # `sdkit ... | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
