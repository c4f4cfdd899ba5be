"""Plumbing shared by every capability: the user-facing error, atomic writes, tables."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import stat
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path


class SdkitError(Exception):
    """A problem with the user's input. The CLI prints it as one line and exits with code 2."""


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _temp_prefix(path: Path) -> str:
    return f".{path.name}.sdkit-"


def _remove_stale_temps(path: Path) -> None:
    """Remove temp files or folders of ours for `path` whose writer is gone (killed mid-write).

    Their names carry the writer's process id; one still running keeps its temp."""
    for stale in path.parent.glob(_temp_prefix(path) + "*.tmp"):
        pid = stale.name[len(_temp_prefix(path)) :].split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            with contextlib.suppress(OSError):
                shutil.rmtree(stale) if stale.is_dir() else stale.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def is_special(path: Path) -> bool:
    """A device, pipe or socket: something to write through, never to replace."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `path`; rename it onto `path` only if the body succeeds.

    A crash half-way leaves the old file (or no file), never a truncated one; a temp file left by
    a killed run is removed by the next write to the same path. The file gets the mode a plain
    open() would give it under the umask. A device or a pipe (/dev/stdout, a FIFO) is written
    through as a stream once the body has succeeded, never replaced by a file.
    """
    path = Path(path)
    if is_special(path):
        with tempfile.TemporaryDirectory(prefix="sdkit-") as folder:
            tmp = Path(folder) / path.name
            yield tmp
            try:
                with open(tmp, "rb") as source, open(path, "wb") as target:
                    shutil.copyfileobj(source, target)
            except OSError as e:  # name the file: a write error on a device says only what went wrong
                raise OSError(e.errno, e.strerror, str(path)) from None
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(path)
    fd, tmp = tempfile.mkstemp(prefix=f"{_temp_prefix(path)}{os.getpid()}-", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _make_readable(folder: Path) -> None:
    """Give what a library wrote under `folder` the modes a plain open() would (safetensors' save_file
    creates its files 0600 whatever the umask)."""
    mask = _umask()
    for root, _, files in os.walk(folder):
        os.chmod(root, 0o777 & ~mask)
        for name in files:
            os.chmod(os.path.join(root, name), 0o666 & ~mask)


# A folder sdkit writes as a whole (a model, adapters, maps) holds this file, written last: which
# kind of folder it is, and every file sdkit put there. A folder is sdkit's only if this file says so
# (a file of the same name that a user or another tool wrote is not enough); rewriting the folder
# replaces and removes only the files listed, and refuses to replace any other.
FOLDER_RECORD = "sdkit.json"
FOLDER_RECORD_VERSION = 1
MODEL_FOLDER, ADAPTERS_FOLDER, MAPS_FOLDER = FOLDER_KINDS = ("minisd-model", "adapters", "maps")


def folder_record(path: str | os.PathLike) -> dict | None:
    """The record of a folder sdkit wrote ({"kind", "version", "files"}), or None where there is
    none or it is not one of ours."""
    try:
        record = json.loads((Path(path) / FOLDER_RECORD).read_text())
    except (OSError, ValueError):
        return None
    if not (
        isinstance(record, dict)
        and record.get("written_by") == "sdkit"
        and record.get("kind") in FOLDER_KINDS
        and type(record.get("version")) is int
        and isinstance(record.get("files"), list)
        and all(isinstance(f, str) for f in record["files"])
    ):
        return None
    return record


def _files_under(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() or p.is_symlink())


@contextlib.contextmanager
def atomic_folder(path: str | os.PathLike, kind: str) -> Iterator[Path]:
    """Fill a temporary folder beside `path`; if the body succeeds, move what it wrote into `path`.

    `path` must be new, empty, or a folder of this kind that sdkit wrote (see check_output_folder).
    Each file the body wrote replaces the file of the same name (by a rename; the old one is removed
    only after); a file sdkit wrote there before and did not write now is removed; everything else
    (a model folder's findings/, a user's notes inside unet/) is kept, and a file sdkit did not
    write is never replaced: that is refused before anything moves. The folder's record
    (FOLDER_RECORD) goes in last, listing the files written.
    """
    if kind not in FOLDER_KINDS:
        raise ValueError(f"unknown folder kind {kind!r}")
    path = Path(path)
    check_output_folder(path, kind)
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(path)
    tmp = Path(tempfile.mkdtemp(prefix=f"{_temp_prefix(path)}{os.getpid()}-", suffix=".tmp", dir=path.parent))
    try:
        yield tmp
        written = _files_under(tmp)
        if FOLDER_RECORD in written:
            raise ValueError(f"{FOLDER_RECORD} is the folder's record, written by atomic_folder itself")
        record = {"written_by": "sdkit", "kind": kind, "version": FOLDER_RECORD_VERSION, "files": written}
        _make_readable(tmp)
        if not path.exists():
            (tmp / FOLDER_RECORD).write_text(json.dumps(record, indent=2) + "\n")
            os.chmod(tmp / FOLDER_RECORD, 0o666 & ~_umask())
            os.replace(tmp, path)
            return
        before = set((folder_record(path) or {}).get("files", ()))
        for name in written:  # refused before anything moves: the folder stays as it was
            target = path / name
            if (target.exists() or target.is_symlink()) and (name not in before or not target.is_file()):
                raise SdkitError(
                    f"{target}: sdkit did not write this, and writing {path} would replace it; "
                    "move it away or choose another folder"
                )
            blocker = next(
                (
                    p
                    for p in target.parents
                    if p != path and path in p.parents and (p.is_symlink() or (p.exists() and not p.is_dir()))
                ),
                None,
            )
            if blocker is not None:
                raise SdkitError(f"{blocker}: sdkit did not write this, and writing {path} needs a folder there")
        # While files move the record lists both the old files and the new, marked incomplete: a
        # crash then leaves a folder the next write still recognises, and nothing unlisted.
        interim = {**record, "files": sorted(before | set(written)), "complete": False}
        write_json(path / FOLDER_RECORD, interim)
        old = Path(tempfile.mkdtemp(prefix=f"{_temp_prefix(path)}{os.getpid()}-", suffix=".tmp", dir=path.parent))
        for name in written:
            target = path / name
            target.parent.mkdir(parents=True, exist_ok=True)
            if target.exists():
                (old / name).parent.mkdir(parents=True, exist_ok=True)
                os.replace(target, old / name)
            os.replace(tmp / name, target)
        for name in sorted(before - set(written)):  # ours, from the last write, not written now
            stale = path / name
            if stale.is_file() or stale.is_symlink():
                stale.unlink()
                for parent in stale.parents:
                    if parent == path or any(parent.iterdir()):
                        break
                    parent.rmdir()
        write_json(path / FOLDER_RECORD, record)
        shutil.rmtree(old)
        shutil.rmtree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def first_line(error: BaseException) -> str:
    """The first line of an exception's message (library errors can run to pages)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def check_output(path: str | os.PathLike, what: str = "output", folder: bool = False, inputs=()) -> Path:
    """Refuse, before any work, an output path that cannot be written: a folder where a file is
    wanted (or the reverse), a parent that is a file, a place this user cannot write to, or a file
    that is one of the command's `inputs` (a file, or a file that a model folder given as input
    holds: a command never overwrites what it reads).

    Probes by creating (and removing) a file in the nearest folder that exists, which is the only
    test the kernel does not second-guess (root, read-only mounts, /proc). A device or a pipe is
    checked for writing only: it is written through, not replaced.
    """
    path = Path(path)
    if folder and path.exists() and not path.is_dir():
        raise SdkitError(f"{path}: {what} must be a folder, but a file is there")
    if not folder and path.is_dir():
        raise SdkitError(f"{path}: {what} must be a file, but a folder is there")
    if not folder and path.exists() and not os.access(path, os.W_OK):
        raise SdkitError(f"{path}: {what} exists and cannot be overwritten (permission denied)")
    if not folder:
        source = next((i for i in inputs if i and _reads(Path(i), path)), None)
        if source is not None:
            raise SdkitError(
                f"{path}: the {what} would land on what this command reads ({source}); choose another path"
            )
    if is_special(path):
        return path
    existing = path if folder and path.is_dir() else path.parent
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise SdkitError(f"{path}: cannot create the {what} ({existing} is a file, not a folder)")
    try:
        fd, probe = tempfile.mkstemp(prefix=".sdkit-probe-", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise SdkitError(f"{path}: cannot write the {what} in {existing} ({e.strerror or e})") from None
    return path


def _reads(source: Path, path: Path) -> bool:
    """Whether a command reading `source` (a file or a folder) may read `path`, or writing `path`
    could change what it reads.

    A file reads itself. A folder sdkit wrote reads the files its record lists, the record, and its
    component folders (unet/, scheduler/); its other entries (findings/) are not read. Any other
    folder (a text encoder, a diffusers pipeline) reads its top-level files and everything inside a
    folder of it that holds a config, weights or a tokenizer (unet/, text_encoder/, 1_Pooling/)."""
    if not source.exists():
        return False
    source, path = source.resolve(), path.resolve()
    if source.is_file():
        return path == source or (path.exists() and os.path.samefile(source, path))
    if path == source:
        return True
    try:
        inside = path.relative_to(source)
    except ValueError:
        return False
    record = folder_record(source)
    if record is None:
        return len(inside.parts) == 1 or any(
            _holds_model_files(source.joinpath(*inside.parts[:k])) for k in range(1, len(inside.parts))
        )
    components = {Path(name).parts[0] for name in record["files"] if len(Path(name).parts) > 1}
    return inside.parts[0] == FOLDER_RECORD or str(inside) in record["files"] or inside.parts[0] in components


def _holds_model_files(folder: Path) -> bool:
    return folder.is_dir() and any(
        any(folder.glob(pattern)) for pattern in ("*config*.json", "*.safetensors", "*.bin", "tokenizer*", "vocab*")
    )


def check_output_folder(path: str | os.PathLike, kind: str, what: str = "output folder", inputs=()) -> Path:
    """Refuse, before any work, an output folder that holds what sdkit did not write: a folder may be
    new, empty, or a folder of this `kind` that sdkit wrote before (its FOLDER_RECORD says so),
    whose own files are then replaced while everything else in it is kept (see atomic_folder)."""
    path = check_output(path, what, folder=True)
    for source in inputs:
        if source and (
            _reads(Path(source), path)
            or (Path(source).exists() and path.resolve() in (Path(source).resolve(), *Path(source).resolve().parents))
        ):
            raise SdkitError(
                f"{path}: the {what} would hold or land on what this command reads ({source}); choose another folder"
            )
    if not path.is_dir() or not any(path.iterdir()):
        return path
    record = folder_record(path)
    if record is None:
        why = "its sdkit.json is not one sdkit wrote" if (path / FOLDER_RECORD).exists() else "no sdkit.json there"
        raise SdkitError(
            f"{path}: the {what} is not empty and sdkit did not write it ({why}); choose a new or empty folder"
        )
    if record["kind"] != kind:
        raise SdkitError(
            f"{path}: the {what} holds {_KIND_WORDS[record['kind']]} that sdkit wrote, not "
            f"{_KIND_WORDS[kind]}; choose another folder"
        )
    if record["version"] > FOLDER_RECORD_VERSION:
        raise SdkitError(
            f"{path}: the {what} was written by a newer sdkit (folder record version "
            f"{record['version']}); choose another folder or upgrade sdkit"
        )
    return path


_KIND_WORDS = {"minisd-model": "a mini SD model", "adapters": "trained adapters", "maps": "attention maps"}


def write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_json(path: str | os.PathLike, data) -> None:
    write_text(path, json.dumps(data, indent=2) + "\n")


FIGURE_FORMATS = (".png", ".svg", ".pdf")


def save_figure(fig, path: str | os.PathLike) -> Path:
    """Save a matplotlib figure atomically, as PNG, SVG or PDF by the name's suffix (PNG without
    one), and close it."""
    import matplotlib.pyplot as plt

    suffix = Path(path).suffix.lower()
    if suffix and suffix not in FIGURE_FORMATS:
        raise SdkitError(f"{path}: pictures are written as {', '.join(FIGURE_FORMATS)} (by the name's suffix)")
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format=(suffix or ".png")[1:], bbox_inches="tight")
    plt.close(fig)
    return Path(path)


def default_cache() -> Path:
    """Where sdkit keeps what it can rebuild (encoded prompt states, the demo's tiny encoders):
    $SDKIT_CACHE, else the platform's cache folder (~/.cache/sdkit on Linux), never the user's
    working tree."""
    if os.environ.get("SDKIT_CACHE"):
        return Path(os.environ["SDKIT_CACHE"]).expanduser()
    if sys.platform == "win32":
        base = Path(os.environ.get("LOCALAPPDATA", Path.home() / "AppData" / "Local"))
    elif sys.platform == "darwin":
        base = Path.home() / "Library" / "Caches"
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "sdkit"


def available_memory() -> int:
    """Bytes of memory this machine can still give (MemAvailable), or all of it where /proc is absent."""
    try:
        meminfo = Path("/proc/meminfo").read_text()
        return int(re.search(r"MemAvailable:\s+(\d+) kB", meminfo).group(1)) * 1024
    except (OSError, AttributeError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def peak_rss(fn):
    """Run fn(); return (its result, the peak resident set during it above the resident set before).

    The kernel's high-water mark (VmHWM) is reset through /proc/self/clear_refs first, so the peak
    is this call's alone. Linux only. Memory the process had freed but kept (glibc heaps) can be
    reused without showing, so measure in a fresh process when it matters.
    """
    status = Path("/proc/self/status")
    if not status.exists():
        raise SdkitError("peak memory on the CPU is measured through /proc, which this system lacks")

    def kib(field: str) -> int:
        return int(re.search(rf"{field}:\s+(\d+) kB", status.read_text()).group(1))

    Path("/proc/self/clear_refs").write_text("5")
    baseline = kib("VmRSS")
    result = fn()
    return result, (kib("VmHWM") - baseline) * 1024


def synchronize(device) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously): before reading a clock or a peak."""
    if str(device).startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)


def format_table(headers: Sequence[str], rows: Sequence[Sequence], title: str | None = None) -> str:
    """A plain text table: first column left-aligned, the others right-aligned."""
    cells = [[str(h) for h in headers]] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))

    out = [title] if title else []
    out += [line(cells[0]), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in cells[1:]]
    return "\n".join(out)


def _cell(value) -> str:
    if isinstance(value, bool) or value is None:
        return "-" if value is None else str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(text: str) -> int:
    """'8GiB', '512 MiB', '2e9' -> bytes (argparse type)."""
    import argparse

    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 8GiB, 512MiB or a number of bytes)")
    try:
        value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 8GiB, 512MiB or a number of bytes)") from None
    if not math.isfinite(value) or value > 2**63:
        raise argparse.ArgumentTypeError(f"not a usable size: {text!r} (too large)")
    if int(value) < 1:
        raise argparse.ArgumentTypeError(f"a size must be at least one byte, not {text!r}")
    return int(value)
