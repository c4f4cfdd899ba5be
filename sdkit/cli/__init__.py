"""The `sdkit` command: a thin layer over the library. Each command family is one small module that
declares its flags next to the function that runs it, and calls library functions:

    audit.py       sdkit audit          sdkit.audit.audit
    scoretable.py  sdkit scoretable     sdkit.scoretable.score_tables, measure
    condition.py   sdkit condition      sdkit.conditioning.compare_conditionings (and, on a mini SD,
                                        sdkit.localization.localize, sdkit.minisd.conditions)
    adapter.py     sdkit adapter        sdkit.adapter.compare_adapters, adapted_embeddings
    minisd.py      sdkit minisd         sdkit.minisd.train.train, MiniSDPipeline, evaluate.evaluate
    memory.py      sdkit memory         sdkit.memory.run
    common.py      the parser class, argument types, output checks, table or JSON
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

from ..common import SdkitError
from . import adapter, audit, condition, memory, minisd, scoretable
from .common import Parser

COMMANDS = (audit, scoretable, condition, adapter, minisd, memory)


def build_parser() -> Parser:
    parser = Parser(prog="sdkit", description="Look inside the cross-attention of Stable "
                                    "Diffusion 1.x U-Nets (and SD 2.x / SDXL). Offline; see README.md.")  # fmt: skip
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for command in COMMANDS:
        command.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' per-load bars; ours stay
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    name = "sdkit"
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if not getattr(args, "func", None):
            parser.print_help()
            return 0
        name = f"sdkit {args.command}"
        # Library chatter (deprecations, diffusers' info logs) is not the user's problem.
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", module=r"(diffusers|transformers|torch|accelerate|huggingface_hub)(\.|$)")
        # Their errors reach the user as our one line; their own log lines would be a second.
        logging.getLogger("diffusers").setLevel(logging.CRITICAL)
        logging.getLogger("transformers").setLevel(logging.CRITICAL)
        args.func(args)
    except SdkitError as e:
        print(f"{name}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `sdkit ... | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as e:  # the machine said no: permissions, a full disk, a vanished file
        where = f"{e.filename}: " if e.filename else ""
        print(f"{name}: error: {where}{e.strerror or e}", file=sys.stderr)
        return 2
    return 0


def run() -> None:
    """The `sdkit` command's entry point: main(), and its exit code as the process's.

    After Ctrl-C the process leaves at once with 130: shutting the interpreter down after an
    interrupted import (torch, say) can otherwise end it by SIGINT after all (exit status -2).
    """
    code = main()
    if code == 130:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
    sys.exit(code)


if __name__ == "__main__":
    run()
