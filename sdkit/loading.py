"""U-Nets from presets, local diffusers folders and single checkpoint files.

A checkpoint is first read as an index of tensor names, shapes and dtypes (for .safetensors: from
the header alone, without touching tensor data). The U-Net part of the index is kept in diffusers
names whatever the file's layout, so counting and loading share one vocabulary.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch
from diffusers import UNet2DConditionModel

from .common import SdkitError, atomic_path
from .presets import PRESETS, build_unet, preset_config

PICKLE_SUFFIXES = (".ckpt", ".bin", ".pt", ".pth")
DTYPE_SIZES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
}  # fmt: skip
TORCH_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}  # fmt: skip
# Prefixes of the original (CompVis / SGM) single-file layout and the component each holds.
COMPONENT_PREFIXES = {
    "model.diffusion_model.": "unet",
    "first_stage_model.": "vae",
    "cond_stage_model.": "text_encoder",
    "conditioner.": "text_encoder",
    "model_ema.": "ema",
}
ORIGINAL_UNET_PREFIX = "model.diffusion_model."
MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors itself refuses larger headers


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype name: F16, F32, BF16, ...

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_SIZES[self.dtype]


@dataclass
class CheckpointIndex:
    """What a model source holds, by component, without the tensor data."""

    source: str
    kind: str  # "preset", "file" or "folder"
    layout: str  # "diffusers" or "original"
    components: dict[str, dict[str, TensorInfo]]  # the "unet" entry in diffusers names
    unet_file_keys: dict[str, str] = field(default_factory=dict)  # diffusers name -> key in file
    bytes_read: int = 0  # of the file(s), to build this index

    @property
    def unet(self) -> dict[str, TensorInfo]:
        return self.components["unet"]


def tensor_info(tensor: torch.Tensor) -> TensorInfo:
    return TensorInfo(tuple(tensor.shape), TORCH_DTYPES[tensor.dtype])


def module_index(module: torch.nn.Module) -> dict[str, TensorInfo]:
    return {name: tensor_info(p) for name, p in module.named_parameters()}


def read_safetensors_header(path: str | os.PathLike) -> tuple[dict[str, TensorInfo], int]:
    """Names, shapes and dtypes from a .safetensors header; also the number of bytes read.

    Reads 8 + header-length bytes and checks the header against the file size, so a truncated or
    corrupt file is caught here rather than deep inside a later load.
    """
    path = Path(path)
    size = _file_size(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise SdkitError(f"{path}: not a safetensors file (only {size} bytes)")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > min(size - 8, MAX_HEADER_BYTES):
            raise SdkitError(
                f"{path}: not a safetensors file (header length {header_len:,} does not fit in "
                f"a file of {size:,} bytes)"
            )
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SdkitError(f"{path}: corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise SdkitError(f"{path}: corrupt safetensors header (not a JSON object)")
    header.pop("__metadata__", None)
    tensors, data_end = {}, 0
    for name, entry in header.items():
        try:
            info = TensorInfo(tuple(int(d) for d in entry["shape"]), entry["dtype"])
            begin, end = (int(o) for o in entry["data_offsets"])
            ok = info.dtype in DTYPE_SIZES and end - begin == info.nbytes and 0 <= begin <= end
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise SdkitError(f"{path}: corrupt safetensors header (bad entry for tensor {name!r})")
        tensors[name] = info
        data_end = max(data_end, end)
    if 8 + header_len + data_end != size:
        raise SdkitError(
            f"{path}: truncated or corrupt safetensors file (header describes "
            f"{8 + header_len + data_end:,} bytes, the file has {size:,})"
        )
    return tensors, 8 + header_len


def _file_size(path: Path) -> int:
    if not path.exists():
        raise SdkitError(f"{path}: no such file")
    if not path.is_file():
        raise SdkitError(f"{path}: not a file")
    return path.stat().st_size


def split_components(tensors: dict) -> dict[str, dict]:
    """Group a checkpoint's entries by component, with the component prefix removed.

    A file with no known prefixes is taken to be a bare U-Net (either layout).
    """
    components: dict[str, dict] = {}
    for name, value in tensors.items():
        for prefix, component in COMPONENT_PREFIXES.items():
            if name.startswith(prefix):
                components.setdefault(component, {})[name[len(prefix) :]] = value
                break
        else:
            components.setdefault("other", {})[name] = value
    if "unet" not in components and _unet_layout(components.get("other", {})):
        components["unet"] = components.pop("other")
    return components


def _unet_layout(names) -> str | None:
    if any(n.startswith(("down_blocks.", "mid_block.", "up_blocks.")) for n in names):
        return "diffusers"
    if any(n.startswith(("input_blocks.", "middle_block.", "output_blocks.")) for n in names):
        return "original"
    return None


def _original_layers_per_block(names) -> int:
    inputs = {int(n.split(".")[1]) for n in names if n.startswith("input_blocks.")}
    downsamplers = {n.split(".")[1] for n in names if n.startswith("input_blocks.") and ".0.op." in n}
    levels = len(downsamplers) + 1
    return (max(inputs) - len(downsamplers)) // levels


def original_to_diffusers_names(names, source: str = "checkpoint") -> dict[str, str]:
    """Map original-layout U-Net names (no prefix) to diffusers names with diffusers' converter.

    The converter is diffusers' own; running it over names (not tensors) costs milliseconds.
    """
    from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint

    names = list(names)
    config = {"layers_per_block": _original_layers_per_block(names)}
    if any(n.startswith("label_emb.") for n in names):
        config["addition_embed_type"] = "text_time"
    converter_log = logging.getLogger("diffusers.loaders.single_file_utils")
    level = converter_log.level
    converter_log.setLevel(logging.ERROR)  # it warns about EMA weights we never asked for
    try:
        converted = convert_ldm_unet_checkpoint({ORIGINAL_UNET_PREFIX + n: n for n in names}, config)
    except (KeyError, ValueError, IndexError) as e:
        raise SdkitError(f"{source}: U-Net keys are not an SD U-Net in the original layout ({e})") from None
    finally:
        converter_log.setLevel(level)
    mapping = {diffusers: original for diffusers, original in converted.items() if original is not None}
    unmapped = set(names) - set(mapping.values())
    if unmapped:
        raise SdkitError(
            f"{source}: {len(unmapped)} U-Net tensors have no diffusers name, e.g. {sorted(unmapped)[0]!r}"
        )
    return mapping


_RESNET_TO_ORIGINAL = {
    "norm1": "in_layers.0", "conv1": "in_layers.2", "time_emb_proj": "emb_layers.1",
    "norm2": "out_layers.0", "conv2": "out_layers.3", "conv_shortcut": "skip_connection",
}  # fmt: skip
_TOP_TO_ORIGINAL = {
    "time_embedding.linear_1": "time_embed.0", "time_embedding.linear_2": "time_embed.2",
    "add_embedding.linear_1": "label_emb.0.0", "add_embedding.linear_2": "label_emb.0.2",
    "conv_in": "input_blocks.0.0", "conv_norm_out": "out.0", "conv_out": "out.2",
}  # fmt: skip


def diffusers_to_original_names(names, layers_per_block: int) -> dict[str, str]:
    """The original (CompVis openaimodel.py) name of each diffusers U-Net tensor, without prefix.

    The original U-Net numbers its blocks in one flat sequence per direction: input block 0 is
    conv_in, then per level `layers_per_block` (ResBlock, SpatialTransformer) pairs and one
    Downsample; output blocks hold `layers_per_block + 1` pairs per level, the Upsample sitting
    after the transformer when the level has one.
    """
    names = list(names)
    step = layers_per_block + 1
    up_with_attention = {int(m.group(1)) for n in names if (m := re.match(r"up_blocks\.(\d+)\.attentions\.", n))}
    mid_has_attention = any(n.startswith("mid_block.attentions.") for n in names)
    mapping = {}
    for name in names:
        module, _, tensor = name.rpartition(".")
        parts = module.split(".")
        if module in _TOP_TO_ORIGINAL:
            new = _TOP_TO_ORIGINAL[module]
        elif parts[0] == "down_blocks":
            level, kind, j, rest = int(parts[1]), parts[2], int(parts[3]), parts[4:]
            if kind == "downsamplers":
                new = f"input_blocks.{1 + level * step + layers_per_block}.0.op"
            else:
                new = f"input_blocks.{1 + level * step + j}.{0 if kind == 'resnets' else 1}"
                new += "." + _inner_to_original(kind, rest)
        elif parts[0] == "mid_block":
            kind, j, rest = parts[1], int(parts[2]), parts[3:]
            index = (2 * j if mid_has_attention else j) if kind == "resnets" else 1
            new = f"middle_block.{index}." + _inner_to_original(kind, rest)
        elif parts[0] == "up_blocks":
            level, kind, j, rest = int(parts[1]), parts[2], int(parts[3]), parts[4:]
            if kind == "upsamplers":
                slot = 2 if level in up_with_attention else 1
                new = f"output_blocks.{level * step + layers_per_block}.{slot}.conv"
            else:
                new = f"output_blocks.{level * step + j}.{0 if kind == 'resnets' else 1}"
                new += "." + _inner_to_original(kind, rest)
        else:
            raise ValueError(f"no original name for U-Net tensor {name!r}")
        mapping[name] = f"{new}.{tensor}"
    return mapping


def _inner_to_original(kind: str, rest: list[str]) -> str:
    # Inside a transformer the names are the same in both layouts.
    inner = ".".join(rest)
    return _RESNET_TO_ORIGINAL.get(inner, inner) if kind == "resnets" else inner


def index_checkpoint(spec: str | os.PathLike, allow_pickle: bool = False) -> CheckpointIndex:
    """Index a preset name, a diffusers model or pipeline folder, or a checkpoint file."""
    spec = str(spec)
    if spec in PRESETS:
        unet = build_unet(preset_config(spec), weights="meta")
        return CheckpointIndex(spec, "preset", "diffusers", {"unet": module_index(unet)})
    path = Path(spec)
    if path.is_dir():
        return _index_folder(path, allow_pickle)
    if not path.exists():
        hint = "" if os.sep in spec or "." in spec else f" (and not a preset: {', '.join(PRESETS)})"
        raise SdkitError(f"{spec}: no such file or folder{hint}")
    if path.suffix == ".safetensors":
        tensors, bytes_read = read_safetensors_header(path)
    elif path.suffix in PICKLE_SUFFIXES:
        tensors, bytes_read = {k: tensor_info(v) for k, v in _load_pickle(path, allow_pickle).items()}, 0
    else:
        raise SdkitError(f"{path}: unknown checkpoint type {path.suffix!r} (expected .safetensors)")
    return _index_tensors(str(path), "file", tensors, bytes_read)


def _index_tensors(source: str, kind: str, tensors: dict, bytes_read: int) -> CheckpointIndex:
    components = split_components(tensors)
    unet = components.get("unet", {})
    layout = _unet_layout(unet)
    if layout is None:
        found = ", ".join(sorted(components)) or "no tensors"
        raise SdkitError(f"{source}: no U-Net in this checkpoint (found: {found})")
    prefix = ORIGINAL_UNET_PREFIX if any(k.startswith(ORIGINAL_UNET_PREFIX) for k in tensors) else ""
    if layout == "original":
        names = original_to_diffusers_names(unet, source)
        components["unet"] = {d: unet[o] for d, o in names.items()}
        file_keys = {d: prefix + o for d, o in names.items()}
    else:
        file_keys = {d: prefix + d for d in unet}
    return CheckpointIndex(source, kind, layout, components, file_keys, bytes_read)


def _folder_unet_dir(path: Path) -> Path:
    for candidate in (path, path / "unet"):
        if (candidate / "config.json").is_file():
            return candidate
    raise SdkitError(f"{path}: not a diffusers U-Net folder (no config.json here or in unet/)")


def _index_folder(path: Path, allow_pickle: bool) -> CheckpointIndex:
    unet_dir = _folder_unet_dir(path)
    files = sorted(unet_dir.glob("diffusion_pytorch_model*.safetensors"))
    tensors, bytes_read = {}, 0
    for f in files:
        part, n = read_safetensors_header(f)
        tensors.update(part)
        bytes_read += n
    if not files:
        pickles = sorted(unet_dir.glob("diffusion_pytorch_model*.bin"))
        if not pickles:
            raise SdkitError(f"{unet_dir}: no diffusion_pytorch_model weights in this folder")
        for f in pickles:
            tensors.update({k: tensor_info(v) for k, v in _load_pickle(f, allow_pickle).items()})
    return _index_tensors(str(path), "folder", tensors, bytes_read)


def _load_pickle(path: Path, allow_pickle: bool) -> dict[str, torch.Tensor]:
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
        raise SdkitError(f"{path}: cannot be read as a weights-only pickle ({type(e).__name__}: {e})") from None
    if isinstance(data, dict) and isinstance(data.get("state_dict"), dict):
        data = data["state_dict"]
    if not isinstance(data, dict) or not all(isinstance(v, torch.Tensor) for v in data.values()):
        raise SdkitError(f"{path}: not a state dict of tensors")
    return data


def infer_unet_config(unet: dict[str, TensorInfo]) -> dict:
    """A diffusers config for U-Net tensors in diffusers names.

    Shapes fix the structure. What shapes cannot tell (head counts, group-norm groups, the SDXL
    time-embedding sizes) comes from the preset with the same structure; an unknown structure gets
    the SD 1.x conventions (8 heads, 32 groups).
    """
    levels = 1 + max(int(n.split(".")[1]) for n in unet if n.startswith("down_blocks."))
    shape = {n[: -len(".weight")]: info.shape for n, info in unet.items() if n.endswith(".weight")}

    def has(prefix):
        return any(n.startswith(prefix) for n in shape)

    def count(prefix):
        return len({n[len(prefix) :].split(".")[0] for n in shape if n.startswith(prefix)})

    down_attention = [has(f"down_blocks.{i}.attentions.") for i in range(levels)]
    up_attention = [has(f"up_blocks.{i}.attentions.") for i in range(levels)]
    depth = [count(f"down_blocks.{i}.attentions.0.transformer_blocks.") or 1 for i in range(levels)]
    cross_dims = {s[1] for n, s in shape.items() if n.endswith("attn2.to_k")}
    proj_in = next((s for n, s in shape.items() if n.endswith("proj_in")), (0, 0, 1, 1))
    config = {
        "in_channels": shape["conv_in"][1],
        "out_channels": shape["conv_out"][0],
        "conv_in_kernel": shape["conv_in"][2],
        "conv_out_kernel": shape["conv_out"][2],
        "block_out_channels": [shape[f"down_blocks.{i}.resnets.0.conv1"][0] for i in range(levels)],
        "layers_per_block": count("down_blocks.0.resnets."),
        "down_block_types": ["CrossAttnDownBlock2D" if a else "DownBlock2D" for a in down_attention],
        "up_block_types": ["CrossAttnUpBlock2D" if a else "UpBlock2D" for a in up_attention],
        "mid_block_type": "UNetMidBlock2DCrossAttn" if has("mid_block.attentions.") else None,
        "transformer_layers_per_block": depth if len(set(depth)) > 1 else depth[0],
        "cross_attention_dim": max(cross_dims) if cross_dims else 1280,
        "use_linear_projection": len(proj_in) == 2,
    }
    if "add_embedding.linear_1" in shape:
        config["addition_embed_type"] = "text_time"
        config["projection_class_embeddings_input_dim"] = shape["add_embedding.linear_1"][1]
    if len(cross_dims) > 1:
        raise SdkitError(f"U-Net cross-attention reads several text widths {sorted(cross_dims)}; pass its config to load_unet(config=...)")
    structure = ("block_out_channels", "layers_per_block", "down_block_types", "up_block_types",
                 "transformer_layers_per_block", "cross_attention_dim", "use_linear_projection")  # fmt: skip
    for name in PRESETS:
        candidate = {"transformer_layers_per_block": 1, "use_linear_projection": False, **preset_config(name)}
        if all(_plain(candidate[k]) == _plain(config[k]) for k in structure):
            return {**candidate, **config}
    return {"_class_name": "UNet2DConditionModel", "attention_head_dim": 8, "norm_num_groups": 32, **config}


def _plain(value):
    return list(value) if isinstance(value, (list, tuple)) else value


def load_unet(
    spec: str | os.PathLike,
    allow_pickle: bool = False,
    config: dict | None = None,
    weights: str = "random",
    seed: int = 0,
) -> UNet2DConditionModel:
    """A U-Net from a preset (weights "random" or "meta"), a diffusers folder or a checkpoint file.

    `config` overrides the config inferred for a single file (for structures no preset shares).
    """
    spec = str(spec)
    if spec in PRESETS:
        return build_unet(preset_config(spec), weights=weights, seed=seed)
    path = Path(spec)
    if path.is_dir():
        unet_dir = _folder_unet_dir(path)
        try:
            unet = UNet2DConditionModel.from_pretrained(unet_dir, local_files_only=True, use_safetensors=None if allow_pickle else True)
        except (OSError, ValueError, RuntimeError) as e:
            raise SdkitError(f"{unet_dir}: cannot load the U-Net ({_first_line(e)})") from None
        return _aligned(unet).eval()
    tensors, index = _read_unet_tensors(path, allow_pickle)
    config = config or infer_unet_config(index.unet)
    unet = build_unet(config, weights="meta")
    expected = module_index(unet)
    if set(expected) != set(tensors) or any(expected[n].shape != tuple(t.shape) for n, t in tensors.items()):
        wrong = sorted(n for n in set(expected) ^ set(tensors)) or sorted(
            n for n in tensors if expected[n].shape != tuple(tensors[n].shape)
        )
        raise SdkitError(f"{path}: U-Net tensors do not fit the architecture ({len(wrong)} differ, e.g. {wrong[0]!r})")
    unet.load_state_dict(tensors, strict=True, assign=True)
    del tensors
    return _aligned(unet).eval()


def _aligned(unet: UNet2DConditionModel) -> UNet2DConditionModel:
    """Copy each parameter into freshly allocated memory.

    Tensors read from safetensors sit at 8-byte offsets in the file buffer; CPU kernels take other
    code paths on such memory and round differently, so a loaded U-Net would not compute exactly
    what the saved one did. One parameter at a time, so the peak is one extra tensor.
    """
    with torch.no_grad():
        for param in unet.parameters():
            param.data = param.data.clone()
    return unet


def _read_unet_tensors(path: Path, allow_pickle: bool) -> tuple[dict[str, torch.Tensor], CheckpointIndex]:
    """The U-Net's tensors of a checkpoint file, in diffusers names, and the file's index."""
    if path.suffix in PICKLE_SUFFIXES:  # one load serves both the index and the tensors
        data = _load_pickle(path, allow_pickle)
        index = _index_tensors(str(path), "file", {k: tensor_info(v) for k, v in data.items()}, 0)
        return {name: data[key] for name, key in index.unet_file_keys.items()}, index
    from safetensors import SafetensorError, safe_open

    index = index_checkpoint(path, allow_pickle)
    try:
        with safe_open(path, framework="pt") as f:
            return {name: f.get_tensor(key) for name, key in index.unet_file_keys.items()}, index
    except SafetensorError as e:
        raise SdkitError(f"{path}: cannot read tensors ({e})") from None


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def save_single_file(unet: UNet2DConditionModel, path: str | os.PathLike, layout: str = "original", extra=None) -> None:
    """Write a U-Net as one .safetensors file, atomically.

    layout="original" writes the CompVis single-file names under model.diffusion_model. (as
    A1111 and ComfyUI read them); "diffusers" writes diffusers names. `extra` adds other tensors
    as they are (a VAE or text encoder under their own prefixes).
    """
    from safetensors.torch import save_file

    state = {k: v.detach().contiguous() for k, v in unet.state_dict().items()}
    if layout == "original":
        names = diffusers_to_original_names(state, unet.config.layers_per_block)
        state = {ORIGINAL_UNET_PREFIX + names[k]: v for k, v in state.items()}
    elif layout != "diffusers":
        raise ValueError(f"layout must be 'original' or 'diffusers', not {layout!r}")
    state.update(extra or {})
    with atomic_path(path) as tmp:
        save_file(state, str(tmp), metadata={"format": "pt"})
