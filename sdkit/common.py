"""Plumbing shared by every capability: the user-facing error, atomic writes, tables."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Iterator, Sequence


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


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `path`; rename it onto `path` only if the body succeeds.

    A crash half-way leaves the old file (or no file), never a truncated one; a temp file left by
    a killed run is removed by the next write to the same path. The file gets the mode a plain
    open() would give it under the umask.
    """
    path = Path(path)
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


@contextlib.contextmanager
def atomic_folder(path: str | os.PathLike) -> Iterator[Path]:
    """Like atomic_path, for a folder written by someone else's save_pretrained: the body fills a
    temporary folder, which then replaces `path` (an old folder there is removed only after)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(path)
    tmp = Path(tempfile.mkdtemp(prefix=f"{_temp_prefix(path)}{os.getpid()}-", suffix=".tmp", dir=path.parent))
    try:
        yield tmp
        os.chmod(tmp, 0o777 & ~_umask())
        if path.exists():
            old = Path(tempfile.mkdtemp(prefix=f"{_temp_prefix(path)}{os.getpid()}-", suffix=".tmp", dir=path.parent))
            os.replace(path, old / "old")
            os.replace(tmp, path)
            shutil.rmtree(old)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def first_line(error: BaseException) -> str:
    """The first line of an exception's message (library errors can run to pages)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def check_output(path: str | os.PathLike, what: str = "output", folder: bool = False) -> Path:
    """Refuse, before any work, an output path that cannot be written: a folder where a file is
    wanted (or the reverse), a parent that is a file, or a place this user cannot write to.

    Probes by creating (and removing) a file in the nearest folder that exists, which is the only
    test the kernel does not second-guess (root, read-only mounts, /proc).
    """
    path = Path(path)
    if folder and path.exists() and not path.is_dir():
        raise SdkitError(f"{path}: {what} must be a folder, but a file is there")
    if not folder and path.is_dir():
        raise SdkitError(f"{path}: {what} must be a file, but a folder is there")
    if not folder and path.exists() and not os.access(path, os.W_OK):
        raise SdkitError(f"{path}: {what} exists and cannot be overwritten (permission denied)")
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


def write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_json(path: str | os.PathLike, data) -> None:
    write_text(path, json.dumps(data, indent=2) + "\n")


def save_png(fig, path: str | os.PathLike) -> Path:
    """Save a matplotlib figure as PNG, atomically, and close it."""
    import matplotlib.pyplot as plt

    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", bbox_inches="tight")
    plt.close(fig)
    return Path(path)


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


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip


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
    return int(value)
