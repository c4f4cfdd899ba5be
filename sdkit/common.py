"""Plumbing shared by every capability: the user-facing error, atomic writes, tables."""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Iterator, Sequence


class SdkitError(Exception):
    """A problem with the user's input. The CLI prints it as one line and exits with code 2."""


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `path`; rename it onto `path` only if the body succeeds.

    A crash half-way leaves the old file (or no file), never a truncated one.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_json(path: str | os.PathLike, data) -> None:
    write_text(path, json.dumps(data, indent=2) + "\n")


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
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
