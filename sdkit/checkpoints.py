"""What a checkpoint holds, from names, shapes and dtypes alone: the index every audit counts.

A preset, a diffusers folder or a single file becomes a CheckpointIndex: its tensors by component,
the U-Net's in diffusers names whatever the file's layout. For .safetensors files this reads the
headers only and imports neither torch nor diffusers, so `sdkit audit FILE` is over in well under a
second; presets (built on the meta device) and pickles (behind --allow-pickle) import torch.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from .common import SdkitError, first_line
from .presets import PRESETS, preset_config
from .safetensors_header import TensorInfo, read_safetensors_header

PICKLE_SUFFIXES = (".ckpt", ".bin", ".pt", ".pth")
# Prefixes of the original (CompVis / SGM) single-file layout and the component each holds.
COMPONENT_PREFIXES = {
    "model.diffusion_model.": "unet",
    "first_stage_model.": "vae",
    "cond_stage_model.": "text_encoder",
    "conditioner.": "text_encoder",
    "model_ema.": "ema",
}
ORIGINAL_UNET_PREFIX = "model.diffusion_model."


@dataclass
class CheckpointIndex:
    """What a model source holds, by component, without the tensor data."""

    source: str
    kind: str  # "preset", "file" or "folder"
    layout: str  # "diffusers" or "original"
    components: dict[str, dict[str, TensorInfo]]  # the "unet" entry in diffusers names
    unet_file_keys: dict[str, str] = field(default_factory=dict)  # diffusers name -> key in file
    bytes_read: int | None = None  # of the file(s) to build this index, when read from headers alone
    config: dict | None = None  # the U-Net's diffusers config, when the source has one

    @property
    def unet(self) -> dict[str, TensorInfo]:
        return self.components["unet"]


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
    inputs = {int(n.split(".")[1]) for n in names if n.startswith("input_blocks.") and n.split(".")[1].isdigit()}
    if not inputs:
        raise SdkitError("an original-layout U-Net needs input_blocks (this one has none)")
    downsamplers = {n.split(".")[1] for n in names if n.startswith("input_blocks.") and ".0.op." in n}
    levels = len(downsamplers) + 1
    return (max(inputs) - len(downsamplers)) // levels


def original_to_diffusers_names(names, source: str = "checkpoint") -> dict[str, str]:
    """Map original-layout U-Net names (no prefix) to diffusers names: {diffusers: original}.

    The inverse of diffusers_to_original_names, read off the names alone (no torch, no diffusers);
    tests check it against diffusers' own convert_ldm_unet_checkpoint on every preset.
    """
    names = list(names)
    try:
        layers_per_block = _original_layers_per_block(names)
    except SdkitError as e:
        raise SdkitError(f"{source}: {e}") from None
    mid_attention = any(
        n.startswith("middle_block.1.") and not _is_resnet_part(n[len("middle_block.1.") :]) for n in names
    )
    mapping, unmapped = {}, []
    for name in names:
        module, _, tensor = name.rpartition(".")
        new = _original_module_to_diffusers(module, layers_per_block, mid_attention)
        if new is None or f"{new}.{tensor}" in mapping:
            unmapped.append(name)
        else:
            mapping[f"{new}.{tensor}"] = name
    if unmapped:
        raise SdkitError(
            f"{source}: {len(unmapped)} U-Net tensors have no diffusers name, e.g. {sorted(unmapped)[0]!r}"
        )
    return mapping


def _is_resnet_part(rest: str) -> bool:
    return rest.split(".")[0] in ("in_layers", "emb_layers", "out_layers", "skip_connection")


def _original_module_to_diffusers(module: str, layers_per_block: int, mid_attention: bool) -> str | None:
    """input_blocks.i.slot.rest / middle_block.k.rest / output_blocks.i.slot.rest -> diffusers."""
    if module in _TOP_FROM_ORIGINAL:
        return _TOP_FROM_ORIGINAL[module]
    parts = module.split(".")
    if len(parts) < 3 or not parts[1].isdigit():
        return None

    def inner(kind: str, j: int, rest: str) -> str | None:
        if kind == "resnets":
            mapped = _RESNET_FROM_ORIGINAL.get(rest)
            return None if mapped is None else f"resnets.{j}.{mapped}"
        return f"attentions.{j}.{rest}" if rest else None

    block, index = parts[0], int(parts[1])
    if block == "middle_block":  # resnet, transformer, resnet (or resnet, resnet without attention)
        rest = ".".join(parts[2:])
        if index == 1 and mid_attention:
            found = inner("attentions", 0, rest)
        else:
            found = inner("resnets", 0 if index == 0 else 1, rest) if index in (0, 1, 2) else None
        return None if found is None else f"mid_block.{found}"
    if not parts[2].isdigit():
        return None
    slot, rest = int(parts[2]), ".".join(parts[3:])
    step = layers_per_block + 1
    if block == "input_blocks" and index >= 1:
        level, j = divmod(index - 1, step)
        if j == layers_per_block:
            return f"down_blocks.{level}.downsamplers.0.conv" if slot == 0 and rest == "op" else None
        found = inner("resnets" if slot == 0 else "attentions", j, rest) if slot in (0, 1) else None
        return None if found is None else f"down_blocks.{level}.{found}"
    if block == "output_blocks":
        level, j = divmod(index, step)
        if rest == "conv" and slot in (1, 2) and j == layers_per_block:
            return f"up_blocks.{level}.upsamplers.0.conv"
        found = inner("resnets" if slot == 0 else "attentions", j, rest) if slot in (0, 1) else None
        return None if found is None else f"up_blocks.{level}.{found}"
    return None


_RESNET_TO_ORIGINAL = {
    "norm1": "in_layers.0",
    "conv1": "in_layers.2",
    "time_emb_proj": "emb_layers.1",
    "norm2": "out_layers.0",
    "conv2": "out_layers.3",
    "conv_shortcut": "skip_connection",
}
_TOP_TO_ORIGINAL = {
    "time_embedding.linear_1": "time_embed.0",
    "time_embedding.linear_2": "time_embed.2",
    "add_embedding.linear_1": "label_emb.0.0",
    "add_embedding.linear_2": "label_emb.0.2",
    "conv_in": "input_blocks.0.0",
    "conv_norm_out": "out.0",
    "conv_out": "out.2",
}
_RESNET_FROM_ORIGINAL = {original: name for name, original in _RESNET_TO_ORIGINAL.items()}
_TOP_FROM_ORIGINAL = {original: name for name, original in _TOP_TO_ORIGINAL.items()}


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


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_FILE_SUFFIXES = (".safetensors", *PICKLE_SUFFIXES)


def resolve_local(spec: str | os.PathLike) -> str:
    """A Hugging Face hub id (owner/name) as its snapshot folder in the local hub cache, offline;
    anything else as it is. A hub id that is not in the cache gets one line saying where to put it."""
    spec = str(spec)
    if spec in PRESETS or Path(spec).exists() or not HUB_ID.fullmatch(spec) or spec.endswith(_FILE_SUFFIXES):
        return spec
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(spec, local_files_only=True)
    except (LocalEntryNotFoundError, OSError, ValueError):
        raise SdkitError(
            f"{spec}: no such file or folder, and not in the local Hugging Face cache "
            f"({constants.HF_HUB_CACHE}); sdkit never downloads: fetch it there with "
            f"`huggingface-cli download {spec}` where there is a network, or pass a local path"
        ) from None


def index_checkpoint(spec: str | os.PathLike, allow_pickle: bool = False) -> CheckpointIndex:
    """Index a preset name, a diffusers model or pipeline folder (or a hub id in the local Hugging
    Face cache), or a checkpoint file."""
    source = str(spec)
    spec = resolve_local(spec)
    if spec in PRESETS:
        from .presets import build_unet
        from .tensors import module_index

        unet = build_unet(preset_config(spec), weights="meta")
        return CheckpointIndex(spec, "preset", "diffusers", {"unet": module_index(unet)}, config=preset_config(spec))
    path = Path(spec)
    if path.is_dir():
        index = _index_folder(path, allow_pickle)
        index.source = source  # the hub id, when it came from the cache
        return index
    if not path.exists():
        hint = "" if os.sep in spec or "." in spec else f" (and not a preset: {', '.join(PRESETS)})"
        raise SdkitError(f"{spec}: no such file or folder{hint}")
    if path.suffix == ".safetensors":
        tensors, bytes_read = read_safetensors_header(path)
    elif path.suffix in PICKLE_SUFFIXES:
        tensors, bytes_read = _pickle_index(path, allow_pickle), None
    else:
        raise SdkitError(f"{path}: unknown checkpoint type {path.suffix!r} (expected .safetensors)")
    index = index_tensors(str(path), "file", tensors, bytes_read)
    try:  # a single file has no config; the structure's preset (or SD 1.x's conventions) stands in
        index.config = infer_unet_config(index.unet)
    except (SdkitError, KeyError, ValueError, IndexError):
        index.config = None  # not a structure we can build: counting by role still works
    return index


def index_tensors(source: str, kind: str, tensors: dict, bytes_read: int | None) -> CheckpointIndex:
    components = split_components(tensors)
    unet = components.get("unet", {})
    layout = _unet_layout(unet)
    if layout is None:
        if unet:
            raise SdkitError(
                f"{source}: the U-Net part (model.diffusion_model.*) has no down/mid/up blocks "
                f"({len(unet)} tensors, e.g. {sorted(unet)[0]!r})"
            )
        found = ", ".join(f"{name} ({len(t)} tensors)" for name, t in sorted(components.items())) or "no tensors"
        raise SdkitError(f"{source}: no U-Net in this checkpoint (found: {found})")
    prefix = ORIGINAL_UNET_PREFIX if any(k.startswith(ORIGINAL_UNET_PREFIX) for k in tensors) else ""
    if layout == "original":
        names = original_to_diffusers_names(unet, source)
        components["unet"] = {d: unet[o] for d, o in names.items()}
        file_keys = {d: prefix + o for d, o in names.items()}
    else:
        file_keys = {d: prefix + d for d in unet}
    return CheckpointIndex(source, kind, layout, components, file_keys, bytes_read)


def unet_folder(path: Path) -> Path:
    for candidate in (path, path / "unet"):
        if (candidate / "config.json").is_file():
            return candidate
    raise SdkitError(f"{path}: not a diffusers U-Net folder (no config.json here or in unet/)")


def _weights_files(folder: Path, stem: str = "") -> list[Path]:
    """A component folder's safetensors files (shards included), without the variants diffusers saves
    beside them (model.fp16.safetensors), which hold the same tensors again."""
    files = sorted(folder.glob(f"{stem}*.safetensors"))
    plain = [f for f in files if "." not in f.stem]
    return plain or files


def _read_headers(files: list[Path]) -> tuple[dict[str, TensorInfo], int]:
    tensors, bytes_read = {}, 0
    for f in files:
        part, n = read_safetensors_header(f)
        tensors.update(part)
        bytes_read += n
    return tensors, bytes_read


def _pipeline_components(path: Path) -> tuple[dict[str, dict[str, TensorInfo]], int]:
    """A pipeline folder's parts besides the U-Net (vae, text_encoder, ...), each from its
    safetensors headers (the folders model_index.json names, or every sibling folder with weights),
    and the bytes read."""
    try:
        names = [k for k, v in json.loads((path / "model_index.json").read_text()).items() if isinstance(v, list)]
    except (OSError, ValueError, AttributeError):
        names = sorted(p.name for p in path.iterdir() if p.is_dir())
    components, bytes_read = {}, 0
    for name in names:
        files = _weights_files(path / name) if name != "unet" and (path / name).is_dir() else []
        if files:
            components[name], n = _read_headers(files)
            bytes_read += n
    return components, bytes_read


def _index_folder(path: Path, allow_pickle: bool) -> CheckpointIndex:
    unet_dir = unet_folder(path)
    files = _weights_files(unet_dir, "diffusion_pytorch_model")
    tensors, bytes_read = _read_headers(files)
    if not files:
        pickles = sorted(unet_dir.glob("diffusion_pytorch_model*.bin"))
        if not pickles:
            raise SdkitError(f"{unet_dir}: no diffusion_pytorch_model weights in this folder")
        for f in pickles:
            tensors.update(_pickle_index(f, allow_pickle))
        bytes_read = None  # the whole pickle was read, not a header
    index = index_tensors(str(path), "folder", tensors, bytes_read)
    if unet_dir != path:  # a pipeline folder: its VAE and text encoder are counted beside the U-Net
        others, n = _pipeline_components(path)
        index.components.update(others)
        if index.bytes_read is not None:
            index.bytes_read += n
    try:
        index.config = json.loads((unet_dir / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise SdkitError(f"{unet_dir / 'config.json'}: cannot read it ({first_line(e)})") from None
    if not isinstance(index.config, dict):
        raise SdkitError(
            f"{unet_dir / 'config.json'}: a U-Net config is a JSON object, not a {type(index.config).__name__}"
        )
    return index


def _pickle_index(path: Path, allow_pickle: bool) -> dict[str, TensorInfo]:
    """Names, shapes and dtypes of a pickle checkpoint (read whole, behind --allow-pickle; needs torch)."""
    from .tensors import load_pickle, tensor_info

    return {k: tensor_info(v, str(path)) for k, v in load_pickle(path, allow_pickle).items()}


def infer_unet_config(unet: dict[str, TensorInfo]) -> dict:
    """A diffusers config for U-Net tensors in diffusers names.

    Shapes fix the structure. What shapes cannot tell (head counts, group-norm groups, the SDXL
    time-embedding sizes) comes from the preset with the same structure; an unknown structure gets
    the SD 1.x conventions (8 heads, 32 groups).
    """
    blocks = sorted({int(n.split(".")[1]) for n in unet if n.startswith("down_blocks.")})
    if blocks != list(range(len(blocks))) or len(blocks) > 16:  # a real U-Net numbers its few levels 0, 1, 2, ...
        raise ValueError(f"down_blocks numbered {blocks[:4]}{'...' if len(blocks) > 4 else ''}, not 0, 1, 2, ...")
    levels = len(blocks)
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
        raise SdkitError(
            f"U-Net cross-attention reads several text widths {sorted(cross_dims)}; pass its config to load_unet(config=...)"
        )
    structure = (
        "block_out_channels",
        "layers_per_block",
        "down_block_types",
        "up_block_types",
        "transformer_layers_per_block",
        "cross_attention_dim",
        "use_linear_projection",
    )
    for name in PRESETS:
        candidate = {"transformer_layers_per_block": 1, "use_linear_projection": False, **preset_config(name)}
        if all(_plain(candidate[k]) == _plain(config[k]) for k in structure):
            return {**candidate, **config}
    return {"_class_name": "UNet2DConditionModel", "attention_head_dim": 8, "norm_num_groups": 32, **config}


def _plain(value):
    return list(value) if isinstance(value, (list, tuple)) else value
