"""Names, shapes and dtypes from a .safetensors header, validated exactly as safetensors does.

Reads 8 + header-length bytes and never the tensor data; imports neither torch nor safetensors,
so an audit of a multi-GB checkpoint starts and ends in milliseconds. A file this module accepts
is one `safetensors.safe_open` accepts, and the other way round (tests/test_reliability.py fuzzes
the two side by side): the rules are safetensors' own (a JSON object of at most 100,000,000
bytes; tensor entries with a known dtype, non-negative integer shape and two offsets; offsets
that tile the data buffer from 0 to its end, without gaps or overlaps; sizes that fit in 64 bits).
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from .common import SdkitError

# Bits per element of every dtype safetensors 0.8 knows (sub-byte ones pack several per byte).
DTYPE_BITS = {
    "BOOL": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
}
MAX_HEADER_BYTES = 100_000_000  # safetensors refuses longer headers
MAX_JSON_DEPTH = 127  # serde_json's recursion limit, counting the header object itself
_USIZE_MAX = 2**64 - 1


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype name: F16, F32, BF16, ...

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BITS[self.dtype] // 8


class _Negative(int):
    """A negative JSON integer: valid JSON, but never a size (serde reads it as a signed number)."""


def _parse_int(text: str):
    value = int(text)
    return _Negative(value) if text.startswith("-") else value


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _size(value) -> bool:
    """What serde accepts as a usize: a JSON integer, not negative, that fits in 64 bits."""
    return type(value) is int and 0 <= value <= _USIZE_MAX


def _depth(value, limit: int) -> int:
    """Nesting depth of containers (a scalar: 0), giving up past `limit`."""
    if limit < 0 or not isinstance(value, (dict, list)):
        return 0
    children = value.values() if isinstance(value, dict) else value
    return 1 + max((_depth(child, limit - 1) for child in children), default=0)


def _strings(value):
    """Every string in a JSON value: keys and values, at any depth."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, child in value.items():
            yield key
            yield from _strings(child)
    elif isinstance(value, list):
        for child in value:
            yield from _strings(child)


def _unicode(text: str) -> bool:
    """Whether a string is Unicode text: JSON's \\ud800 escape gives Python a lone surrogate, which
    serde_json (and so safetensors) refuses."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def parse_header(raw: bytes, data_bytes: int, source: str = "file") -> dict[str, TensorInfo]:
    """Validate a header (the JSON bytes) for a data buffer of `data_bytes`; tensors by name."""
    corrupt = f"{source}: corrupt safetensors header"
    try:
        text = raw.decode("utf-8")
        header = json.loads(text, parse_int=_parse_int, parse_constant=_reject_constant)
    except UnicodeDecodeError:
        raise SdkitError(f"{corrupt} (not UTF-8 text)") from None
    except (ValueError, RecursionError) as e:
        reason = "nested too deeply" if isinstance(e, RecursionError) else str(e).splitlines()[0][:120]
        raise SdkitError(f"{corrupt} ({reason})") from None
    if not isinstance(header, dict):
        raise SdkitError(f"{corrupt} (not a JSON object)")
    if _depth(header, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise SdkitError(f"{corrupt} (JSON nested more than {MAX_JSON_DEPTH} levels deep)")
    if not all(_unicode(text) for text in _strings(header)):
        raise SdkitError(f"{corrupt} (a string escapes a lone surrogate, which is not Unicode text)")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise SdkitError(f"{corrupt} (__metadata__ must map names to strings)")
    entries = []
    for name, entry in header.items():
        ok = isinstance(entry, dict) and {"dtype", "shape", "data_offsets"} <= entry.keys()
        ok = ok and isinstance(entry["dtype"], str) and entry["dtype"] in DTYPE_BITS
        ok = ok and isinstance(entry["shape"], list) and all(_size(d) for d in entry["shape"])
        offsets = entry.get("data_offsets") if ok else None
        ok = ok and isinstance(offsets, list) and len(offsets) == 2 and all(_size(o) for o in offsets)
        if not ok:
            raise SdkitError(
                f"{corrupt} (bad entry for tensor {name!r}: it needs a known dtype, a shape of "
                "non-negative integers and two integer data_offsets)"
            )
        entries.append((tuple(offsets), name, TensorInfo(tuple(entry["shape"]), entry["dtype"])))
    end = 0
    for (begin, stop), name, info in sorted(entries, key=lambda e: e[0]):
        if begin != end or stop < begin:
            raise SdkitError(
                f"{corrupt} (tensor {name!r} starts at byte {begin:,} of the data, not at {end:,}: "
                "offsets overlap or leave a gap)"
            )
        bits = info.numel * DTYPE_BITS[info.dtype]
        if info.numel > _USIZE_MAX or bits > _USIZE_MAX:
            raise SdkitError(f"{corrupt} (tensor {name!r}: shape {list(info.shape)} overflows 64 bits)")
        if bits % 8 or stop - begin != bits // 8:
            raise SdkitError(
                f"{corrupt} (tensor {name!r}: {list(info.shape)} {info.dtype} does not take the "
                f"{stop - begin:,} bytes its offsets give)"
            )
        end = stop
    if end != data_bytes:
        raise SdkitError(
            f"{source}: truncated or corrupt safetensors file (the header describes {end:,} bytes "
            f"of data, the file holds {data_bytes:,})"
        )
    return {name: info for _, name, info in entries}


def read_safetensors_header(path: str | os.PathLike) -> tuple[dict[str, TensorInfo], int]:
    """Names, shapes and dtypes from a .safetensors file's header; also the number of bytes read."""
    path = Path(path)
    if not path.exists():
        raise SdkitError(f"{path}: no such file")
    if not path.is_file():
        raise SdkitError(f"{path}: not a file")
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise SdkitError(f"{path}: not a safetensors file (only {size} bytes)")
            (header_len,) = struct.unpack("<Q", head)
            if header_len > MAX_HEADER_BYTES:
                raise SdkitError(
                    f"{path}: not a safetensors file (header length {header_len:,} is over "
                    f"safetensors' limit of {MAX_HEADER_BYTES:,})"
                )
            if 8 + header_len > size:
                raise SdkitError(
                    f"{path}: not a safetensors file (header length {header_len:,} does not fit in "
                    f"a file of {size:,} bytes)"
                )
            raw = f.read(header_len)
    except PermissionError:
        raise SdkitError(f"{path}: cannot read this file (permission denied)") from None
    return parse_header(raw, size - 8 - header_len, str(path)), 8 + header_len
