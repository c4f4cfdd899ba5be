"""The `sdkit` command: a thin layer over the library. Each command family is one small module that
declares its flags next to the function that runs it, and calls library functions:

    audit.py       sdkit audit          sdkit.audit.audit (--compute: sdkit.compute.compute, sweep)
    scoretable.py  sdkit scoretable     sdkit.scoretable.score_tables, measure
    condition.py   sdkit condition      sdkit.conditioning.compare_conditionings (and, on a mini SD,
                                        sdkit.localization.localize, sdkit.minisd.conditions)
    adapter.py     sdkit adapter        sdkit.adapter.compare_adapters, adapted_embeddings
    minisd.py      sdkit minisd         sdkit.minisd.train.train, MiniSDPipeline, evaluate.evaluate
                                        (--guide: sdkit.steering, sdkit.minisd.steer.caption_guides)
                                        (edit: sdkit.editing, sdkit.minisd.edit.edit_images)
    memory.py      sdkit memory         sdkit.memory.run
    common.py      the parser class, argument types, output checks, table or JSON
"""

from __future__ import annotations

import os
import signal
import sys

from ..common import SdkitError
from .common import phase

COMMANDS = ("audit", "scoretable", "condition", "adapter", "minisd", "memory")


def build_parser():
    """The `sdkit` parser: the top level lists the commands; each command module adds its own."""
    import importlib

    from .common import Parser

    parser = Parser(
        prog="sdkit",
        description="Look inside the cross-attention of Stable "
        "Diffusion 1.x U-Nets (and SD 2.x / SDXL). Offline; see README.md and docs/.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for name in COMMANDS:
        importlib.import_module(f".{name}", __name__).register(sub)
    return parser


def quiet_libraries() -> None:
    """Library chatter (deprecations, info logs, load bars, font warnings) is not the user's problem;
    their errors reach the user as our one line, and their own log lines would be a second."""
    import logging
    import warnings

    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    warnings.filterwarnings("ignore", category=FutureWarning)
    # A prompt's emoji has no glyph in matplotlib's font: the picture shows a box, which says as much
    warnings.filterwarnings("ignore", message=r"Glyph \d+ .* missing from font")
    warnings.filterwarnings(
        "ignore", module=r"(diffusers|transformers|torch|accelerate|huggingface_hub|matplotlib)(\.|$)"
    )
    for name in ("diffusers", "transformers", "accelerate", "huggingface_hub", "torch", "matplotlib"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    if "huggingface_hub" in sys.modules:  # imported already (by diffusers, say): its env settings were read,
        from huggingface_hub.utils import disable_progress_bars  # and transformers takes its bars' state from it

        disable_progress_bars()
    if "transformers" in sys.modules:  # imported already (a script's imports): its env settings were read
        from transformers.utils import logging as transformers_logging

        transformers_logging.set_verbosity_error()
        transformers_logging.disable_progress_bar()


def main(argv: list[str] | None = None) -> int:
    """Run one `sdkit` command; the exit code: 0, 2 for bad input (one line on stderr), 130 for Ctrl-C."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    name = "sdkit"
    pressed = []

    def on_interrupt(signum, frame):
        pressed.append(signum)
        if _importing(frame):
            # Raised inside an import, the exception can cross C++ (torch's pybind11 start-up),
            # which aborts the process (SIGABRT, a C++ trace) instead of unwinding. Nothing is
            # lost by leaving at once: a temp file left now carries our pid and the next write
            # to its path removes it.
            print(f"{name}: interrupted", file=sys.stderr, flush=True)
            os._exit(130)
        raise KeyboardInterrupt

    # Ctrl-C outside an import can still turn into another error on its way up (a library that
    # catches and re-raises): once it is pressed, whatever follows is its consequence, and the
    # answer is the same one line and 130.
    previous = signal.signal(signal.SIGINT, on_interrupt) if _main_thread() else None
    try:
        from .common import given_options

        quiet_libraries()
        parser = build_parser()
        argv = sys.argv[1:] if argv is None else argv
        args = parser.parse_args(argv)
        if not getattr(args, "func", None):
            parser.print_help()
            return 0
        args.given = given_options(parser, argv)
        name = phase.program = f"sdkit {args.command}"
        # The first seconds of most commands: shown on a terminal; a log has no use for a line on it.
        phase("loading torch and the model code", log=False)
        args.func(args)
        phase.clear()
    except BaseException as e:  # noqa: BLE001 (sorted below; anything else goes on as it was)
        phase.clear()
        if pressed or isinstance(e, KeyboardInterrupt):
            print(f"{name}: interrupted", file=sys.stderr)
            return 130
        if isinstance(e, SystemExit):
            raise
        if isinstance(e, SdkitError):
            print(f"{name}: error: {e}", file=sys.stderr)
            return 2
        if isinstance(e, BrokenPipeError):  # `sdkit ... | head`: the reader left; say nothing more
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0
        if isinstance(e, OSError):  # the machine said no: permissions, a full disk, a vanished file
            where = f"{e.filename}: " if e.filename else ""
            print(f"{name}: error: {where}{e.strerror or e}", file=sys.stderr)
            return 2
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    return 0


def _importing(frame) -> bool:
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def run() -> None:
    """The `sdkit` command's entry point: main(), and its exit code as the process's.

    Everything past the first few imports runs inside main's handler, so Ctrl-C at any moment
    of the work gives one line and 130. Once main has answered, Ctrl-C is ignored: shutting the
    interpreter down (after an interrupted import of torch, say) could otherwise end the process
    by SIGINT after all (exit status -2), or print a traceback from a finaliser.
    """
    code = main()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.stdout.flush()
    sys.stderr.flush()
    if code == 130:
        os._exit(130)
    sys.exit(code)


if __name__ == "__main__":
    run()
