"""torch tensors as the checkpoint index sees them: their safetensors dtype names and index entries,
and pickle state dicts read with weights_only=True (behind --allow-pickle).

Below both the index of a checkpoint (checkpoints.py) and the loading of modules (loading.py),
which both use it; it imports neither.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .common import SdkitError, first_line
from .safetensors_header import TensorInfo

# torch dtypes by their safetensors names (those torch has; uint16-64 and float8 need torch >= 2.3).
TORCH_DTYPES = {
    getattr(torch, name): code
    for name, code in (
        ("float64", "F64"),
        ("float32", "F32"),
        ("float16", "F16"),
        ("bfloat16", "BF16"),
        ("int64", "I64"),
        ("int32", "I32"),
        ("int16", "I16"),
        ("int8", "I8"),
        ("uint8", "U8"),
        ("bool", "BOOL"),
        ("uint16", "U16"),
        ("uint32", "U32"),
        ("uint64", "U64"),
        ("complex64", "C64"),
        ("float8_e4m3fn", "F8_E4M3"),
        ("float8_e5m2", "F8_E5M2"),
        ("float8_e4m3fnuz", "F8_E4M3FNUZ"),
        ("float8_e5m2fnuz", "F8_E5M2FNUZ"),
        ("float8_e8m0fnu", "F8_E8M0"),
    )
    if hasattr(torch, name)
}


def tensor_info(tensor: torch.Tensor, source: str = "checkpoint") -> TensorInfo:
    if tensor.dtype not in TORCH_DTYPES:
        raise SdkitError(f"{source}: holds a {tensor.dtype} tensor, a dtype safetensors has no name for")
    return TensorInfo(tuple(tensor.shape), TORCH_DTYPES[tensor.dtype])


def module_index(module: torch.nn.Module) -> dict[str, TensorInfo]:
    return {name: tensor_info(p) for name, p in module.named_parameters()}


def load_pickle(path: Path, allow_pickle: bool) -> dict[str, torch.Tensor]:
    if not allow_pickle:
        raise SdkitError(
            f"{path}: pickle checkpoints can run code when loaded; convert it to .safetensors, "
            "or pass --allow-pickle to load it with weights_only=True"
        )
    try:
        try:
            data = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            data = torch.load(path, map_location="cpu", weights_only=True)  # pre-zip format
    except Exception as e:  # torch raises many types for a bad pickle; all mean the same here
        raise SdkitError(
            f"{path}: cannot be read as a weights-only pickle ({type(e).__name__}: {first_line(e)})"
        ) from None
    if isinstance(data, dict) and isinstance(data.get("state_dict"), dict):
        data = data["state_dict"]
    if not isinstance(data, dict) or not all(isinstance(v, torch.Tensor) for v in data.values()):
        raise SdkitError(f"{path}: not a state dict of tensors")
    return data
