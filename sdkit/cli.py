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
