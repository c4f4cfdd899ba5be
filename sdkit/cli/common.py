"""What every command shares: the parser class, argument types, output checks, the result as a
table or JSON, progress bars.

Arguments and output paths are checked before anything heavy is imported, so a mistake costs a
second, not the start-up of torch and diffusers.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import textwrap

from ..common import SdkitError, check_output, check_output_folder, write_json
from ..minisd import SAMPLING_GUIDANCE

PRESET_NAMES = "sd15, sd21, sdxl, tiny, minisd, minisd-latent"  # presets.PRESETS, without importing torch to say so
LAYERS = ("last", "penultimate")  # encoders.LAYERS
ADAPTER_KINDS = ("linear", "mlp", "mixer")  # adapter.KINDS
STEERING_OBJECTIVES = ("excite", "bind", "layout")  # steering.OBJECTIVES


CACHE_DEFAULT = "default"
CACHE_HELP = (
    "where encoded text states (and the demo's tiny encoders) are cached; 'default' is $SDKIT_CACHE, "
    "else the platform's cache folder, ~/.cache/sdkit on Linux"
)


def cache_folder(text: str):
    """--cache: a folder, or 'default' for common.default_cache()."""
    from pathlib import Path

    from ..common import default_cache

    return default_cache() if text == CACHE_DEFAULT else Path(text)


def add_subcommand(sub, name: str, help: str) -> Parser:
    """A subcommand whose --help opens with the line its parent's list shows."""
    return sub.add_parser(name, help=help, description=help[0].upper() + help[1:] + ".")


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default once, as a person would write it: not where there is none, not
    where the help already says it, and a list as its items."""

    def _get_help_string(self, action):
        text = action.help or ""
        # Identity, not ==: a default of 0 or 0.0 equals False and is still worth showing.
        if any(action.default is none for none in (None, False, argparse.SUPPRESS)) or "default" in text:
            return text
        if isinstance(action.default, (list, tuple)):
            return f"{text} (default: {','.join(str(v) for v in action.default)})"
        return super()._get_help_string(action)

    def _split_lines(self, text, width):
        # argparse wraps at hyphens too, which splits file names and options ("minisd-" / "edit.png")
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


class Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _Formatter)
        kwargs.setdefault("allow_abbrev", False)  # --steps is --steps, not also --st (and given_options stays exact)
        super().__init__(*args, **kwargs)

    def error(self, message):  # one line, like every other input error
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def given_options(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The dests of the options written on the command line (not left at their defaults), each read
    by the parser it was given to: a group's option before its subcommand is the group's."""
    given = set()
    current = parser
    for token in argv:
        if token == "--":
            break
        actions = {option: action for action in current._actions for option in action.option_strings}
        option = token.split("=", 1)[0]
        if option in actions:
            given.add(actions[option].dest)
            continue
        subcommands = next((a for a in current._actions if isinstance(a, argparse._SubParsersAction)), None)
        if subcommands is not None and token in subcommands.choices:
            current = subcommands.choices[token]
    return given


def refuse_options(args, dests, mode: str) -> None:
    """Refuse options given on the command line that `mode` does not read (never ignore them)."""
    for dest in sorted(set(dests) & getattr(args, "given", set())):
        raise SdkitError(f"--{dest.replace('_', '-')} does not apply {mode}")


# --- argument types: refuse what would silently become something else ------------------------------


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, not {value}")
    return value


def nonnegative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {value}")
    return value


def at_most(limit: int, why: str):
    """An argument type: a positive whole number no larger than `limit` (which `why` explains)."""

    def parse(text: str) -> int:
        value = positive_int(text)
        if value > limit:
            raise argparse.ArgumentTypeError(f"at most {limit:,} ({why}), not {value:,}")
        return value

    return parse


def adapter_kinds(text: str) -> list[str]:
    kinds = [k for k in text.split(",") if k]
    unknown = [k for k in kinds if k not in ADAPTER_KINDS]
    if unknown or not kinds:
        raise argparse.ArgumentTypeError(
            f"adapter kinds are a comma-separated list of {', '.join(ADAPTER_KINDS)}, not {text!r}"
        )
    return kinds


def steering_objectives(text: str) -> tuple[str, ...]:
    objectives = tuple(dict.fromkeys(o for o in text.split(",") if o))
    unknown = [o for o in objectives if o not in STEERING_OBJECTIVES]
    if unknown or not objectives:
        raise argparse.ArgumentTypeError(
            f"steering objectives are a comma-separated list of {', '.join(STEERING_OBJECTIVES)}, not {text!r}"
        )
    return objectives


def seed(text: str) -> int:
    """A seed: a whole number from 0 to 2^63 - 1 (what torch's generators take)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if not 0 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"a seed is 0 to 2^63 - 1, not {value}")
    return value


def positive_float(text: str) -> float:
    value = _finite(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, not {text}")
    return value


def nonnegative_float(text: str) -> float:
    value = _finite(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {text}")
    return value


def _finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, not {text}")
    return value


_own_guidance = ", ".join(f"{scale:g} in {space}" for space, scale in SAMPLING_GUIDANCE.items())
GUIDANCE_HELP = f"classifier-free guidance scale (default: the model's own, {_own_guidance})"
MAX_GUIDANCE = 1000.0  # SD samples at 1-15; far past that the guided prediction only overflows


def guidance_scale(text: str) -> float:
    """A classifier-free guidance scale: 0 to MAX_GUIDANCE."""
    value = nonnegative_float(text)
    if value > MAX_GUIDANCE:
        raise argparse.ArgumentTypeError(f"a guidance scale is 0 to {MAX_GUIDANCE:g} (SD samples at 1-15), not {text}")
    return value


def grid_sides(text: str) -> tuple[int, ...]:
    try:
        sides = tuple(int(side) for side in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of grid sides: {text!r} (e.g. 16,32)") from None
    if any(side <= 0 for side in sides):
        raise argparse.ArgumentTypeError(f"grid sides must be positive: {text!r}")
    return sides


def latent_size(text: str) -> tuple[int, int]:
    h, _, w = text.lower().partition("x")
    try:
        size = int(h), int(w or h)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a latent size: {text!r} (e.g. 64 or 64x96)") from None
    if min(size) <= 0:
        raise argparse.ArgumentTypeError(f"latent sides must be positive: {text!r}")
    return size


# --- output ----------------------------------------------------------------------------------------------


def add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout instead of the table")
    p.add_argument("--json-out", metavar="FILE", help="also write the result as JSON to FILE (the table still prints)")


def show_result(args, data: dict, table: str) -> None:
    """The table for people, or JSON on stdout with --json; and JSON to --json-out when given."""
    phase.clear()
    if args.json_out:
        write_json(args.json_out, data)
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        print(table)
        if args.json_out:
            print(f"wrote {args.json_out}")


class _Phase:
    """What the command is doing now, said on stderr.

    On a terminal: one line with the seconds it has taken so far, redrawn every second by a
    daemon thread and cleared before the result, so a person never waits on a still screen; a
    progress bar takes the line over while it runs. Elsewhere (a log, a pipe): nothing while it
    runs, then one line for each phase that took 10 s or more, with its time, so a quick failure
    stays one line."""

    def __init__(self):
        import threading

        self.program = "sdkit"
        self.text: str | None = None
        self.began = 0.0
        self.ticking = False  # False while a progress bar owns the line
        self.log = True  # False: not worth a line in a log (the start-up)
        self.bar = None  # that bar
        self._lock = threading.RLock()  # a Ctrl-C handler may clear while the main thread draws
        self._thread = None

    def __call__(self, text: str, ticking: bool = True, log: bool = True) -> None:
        import threading
        import time

        self.clear()
        with self._lock:
            self.text, self.began, self.ticking, self.log = text, time.monotonic(), ticking and _terminal(), log
            if self.ticking:
                self._draw()
                if self._thread is None:
                    self._thread = threading.Thread(target=self._tick, daemon=True)
                    self._thread.start()

    def _draw(self) -> None:
        import time

        took = time.monotonic() - self.began
        sys.stderr.write(f"\r\033[K{self.program}: {self.text} ... {format_duration(took) if took >= 1 else ''}")
        sys.stderr.flush()

    def _tick(self) -> None:
        import time

        while True:
            time.sleep(1)
            with self._lock:
                if self.ticking and self.text is not None and not _library_bars():
                    self._draw()
                elif self.bar is not None and not self.bar.disable:
                    self.bar.refresh()  # its clock moves on between slow steps

    def clear(self) -> None:
        import time

        with self._lock:
            if self.text is None:
                return
            if _terminal():
                sys.stderr.write("\r\033[K")
            elif self.log and (took := time.monotonic() - self.began) >= 10:
                sys.stderr.write(f"{self.program}: {self.text}: {format_duration(took)}\n")
            sys.stderr.flush()
            self.text, self.ticking, self.bar = None, False, None


def _terminal() -> bool:
    return sys.stderr.isatty()


def _library_bars() -> bool:
    """Whether a progress bar the library drew itself (encoding, training) owns the line now."""
    from tqdm import tqdm

    return any(not bar.disable for bar in list(tqdm._instances))


def format_duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 60 else f"{int(seconds // 60)} min {seconds % 60:02.0f} s"


phase = _Phase()


def progress_bar(args, **kwargs):
    """A progress bar on stderr, for people (n of N, an ETA): a phase with steps. On a terminal it
    takes the phase line over; elsewhere the log gets the phase's one line when it ends. Counts
    may move by fractions (a sampler moves its images on at each denoising step)."""
    from tqdm import tqdm

    phase(kwargs.get("desc", "working"), ticking=False)
    if kwargs.get("total") and not kwargs.get("unit_scale"):
        kwargs.setdefault(
            "bar_format",
            "{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f} {unit} [{elapsed}<{remaining}{postfix}]",
        )
    phase.bar = tqdm(leave=False, disable=None, **kwargs)
    return phase.bar


# Every flag through which a command reads a file or folder (defaults included): no output of the
# command may land on what it reads.
INPUT_FLAGS = (
    "model",
    "unet",
    "text_encoder",
    "tokenizer",
    "encoders_dir",
    "pooled_model",
    "new",
    "old",
    "adapter",
    "corpus",
    "minisd",
    "vae",
    "start_from",
    "image",
)


def check_outputs(args, files=(), pictures=(), folders=(), owned: dict | None = None) -> None:
    """Check every output path the command will write, before it starts working.

    files: flags naming output files; pictures: those naming pictures (PNG, SVG or PDF by suffix);
    folders: flags naming folders the command adds its own files to (caches, checkpoints); owned:
    flag -> kind (common.FOLDER_KINDS), for folders the command writes as a whole (a model,
    adapters, maps): new, empty, or a folder of that kind that sdkit wrote. No output may be
    something the command reads (INPUT_FLAGS), or another of its outputs, or lie inside a folder
    it writes."""
    from pathlib import Path

    from ..common import FIGURE_FORMATS

    owned = owned or {}
    inputs = [str(getattr(args, flag)) for flag in INPUT_FLAGS if getattr(args, flag, None)]
    # An empty path given on purpose is not "no output": refused before the work, which would end on it
    for flag in ("json_out", *files, *pictures, *folders, *owned):
        if getattr(args, flag, None) == "":
            raise SdkitError(f"--{flag.replace('_', '-')} is empty: name the path to write")
    if getattr(args, "json_out", None):
        check_output(args.json_out, "--json-out file", inputs=inputs)
    for flag in pictures:
        suffix = Path(getattr(args, flag, None) or "x.png").suffix.lower()
        if suffix and suffix not in FIGURE_FORMATS:
            raise SdkitError(
                f"{getattr(args, flag)}: --{flag.replace('_', '-')} pictures are written as "
                f"{', '.join(FIGURE_FORMATS)} (by the name's suffix)"
            )
    for flag in (*files, *pictures):
        if getattr(args, flag, None):
            check_output(getattr(args, flag), f"--{flag.replace('_', '-')} file", inputs=inputs)
    for flag in folders:
        if getattr(args, flag, None):
            check_output(getattr(args, flag), f"--{flag.replace('_', '-')} folder", folder=True)
    for flag, kind in owned.items():
        if getattr(args, flag, None):
            check_output_folder(getattr(args, flag), kind, f"--{flag.replace('_', '-')} folder", inputs=inputs)
    _check_apart(args, ("json_out", *files, *pictures), (*folders, *owned))


def _check_apart(args, file_flags, folder_flags) -> None:
    """Outputs of one command never land on each other: no two name the same path, and none lies
    inside a folder that another output writes (it would replace, or be replaced by, what is there;
    a folder written as a whole must hold only what sdkit put there)."""
    import os
    from pathlib import Path

    from ..common import is_special

    given = [
        (flag, Path(os.path.abspath(getattr(args, flag))))
        for flag in (*file_flags, *folder_flags)
        if getattr(args, flag, None) and not is_special(Path(getattr(args, flag)))
    ]

    def name(flag: str) -> str:
        return f"--{flag.replace('_', '-')}"

    for i, (flag, path) in enumerate(given):
        for other, other_path in given[i + 1 :]:
            if path == other_path:
                raise SdkitError(f"{path}: {name(flag)} and {name(other)} name the same path; give each output its own")
        for other, outer in given:
            if other != flag and outer in path.parents:
                what = "file" if flag in file_flags else "folder"
                kind = "folder this command writes" if other not in file_flags else "file this command writes"
                raise SdkitError(
                    f"{path}: the {name(flag)} {what} would be inside the {name(other)} {kind}; "
                    "choose a path outside it"
                )


def check_input(path: str, what: str) -> None:
    """A missing input, said before the heavy imports (a hub id is looked up in the cache later)."""
    from pathlib import Path

    from ..checkpoints import HUB_ID

    if not Path(path).exists() and not HUB_ID.fullmatch(str(path)):
        raise SdkitError(f"{path}: no such file or folder ({what})")


def minisd_spec(unet: str):
    """The mini SD spec when `unet` is a mini SD folder, else None."""
    from pathlib import Path

    from ..minisd.pipeline import SPEC_FILE, MiniSDSpec

    return MiniSDSpec.read(unet) if (Path(unet) / SPEC_FILE).is_file() else None
