"""U-Nets as torch modules: from presets, local diffusers folders and single checkpoint files.

Which tensors a source holds, and under which names, is decided from its index (checkpoints.py);
this module reads the tensors themselves, builds the module and writes single files.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from diffusers import UNet2DConditionModel

from .checkpoints import (
    ORIGINAL_UNET_PREFIX,
    PICKLE_SUFFIXES,
    CheckpointIndex,
    diffusers_to_original_names,
    index_checkpoint,
    index_tensors,
    infer_unet_config,
    resolve_local,
    unet_folder,
)
from .common import SdkitError, atomic_path, first_line
from .presets import PRESETS, build_unet, preset_config
from .tensors import load_pickle, module_index, tensor_info


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
    spec = resolve_local(spec)
    if spec in PRESETS:
        return build_unet(preset_config(spec), weights=weights, seed=seed)
    path = Path(spec)
    if path.is_dir():
        unet_dir = unet_folder(path)
        try:
            folder_config = json.loads((unet_dir / "config.json").read_text())
        except (OSError, ValueError) as e:
            raise SdkitError(f"{unet_dir / 'config.json'}: cannot read it ({e})") from None
        _check_fits(_meta_unet(folder_config, str(unet_dir)), str(unet_dir))
        try:
            unet = UNet2DConditionModel.from_pretrained(
                unet_dir, local_files_only=True, use_safetensors=None if allow_pickle else True
            )
        except Exception as e:  # diffusers raises many types for a folder it cannot load; all mean that
            raise SdkitError(f"{unet_dir}: cannot load the U-Net ({first_line(e)})") from None
        if any(p.is_meta for p in unet.parameters()):
            raise SdkitError(f"{unet_dir}: the weights do not hold every U-Net tensor")
        _check_finite(unet, str(unet_dir))
        return _aligned(unet).eval()
    tensors, index = _read_unet_tensors(path, allow_pickle)
    if config is None:
        try:
            config = infer_unet_config(index.unet)
        except (KeyError, ValueError, IndexError) as e:
            raise SdkitError(
                f"{path}: these U-Net tensors are not an architecture sdkit can build (missing or odd {first_line(e)})"
            ) from None
    unet = _meta_unet(config, str(path))
    expected = module_index(unet)
    if set(expected) != set(tensors) or any(expected[n].shape != tuple(t.shape) for n, t in tensors.items()):
        wrong = sorted(n for n in set(expected) ^ set(tensors)) or sorted(
            n for n in tensors if expected[n].shape != tuple(tensors[n].shape)
        )
        raise SdkitError(f"{path}: U-Net tensors do not fit the architecture ({len(wrong)} differ, e.g. {wrong[0]!r})")
    for name, tensor in tensors.items():
        if not (tensor.is_floating_point() and tensor.element_size() >= 2):
            # float8 (and integer) checkpoints are storage formats: compute in float32
            if tensor.is_complex():
                raise SdkitError(f"{path}: U-Net tensor {name!r} is complex ({tensor.dtype}); a U-Net's are real")
            tensors[name] = tensor.float()
    unet.load_state_dict(tensors, strict=True, assign=True)
    del tensors
    _check_finite(unet, str(path))
    return _aligned(unet).eval()


def _check_finite(unet: UNet2DConditionModel, source: str) -> None:
    """Weights holding NaN or infinity make every output NaN: refuse them rather than report NaN tables."""
    bad = [
        name for name, tensor in unet.state_dict().items() if tensor.is_floating_point() and not tensor.isfinite().all()
    ]
    if bad:
        raise SdkitError(f"{source}: {len(bad)} U-Net tensors hold NaN or infinite values (e.g. {bad[0]!r})")


# Far past any real U-Net; a config beyond them would take hours to build, not fail.
STRUCTURE_LIMITS = {
    "layers_per_block": 64,
    "transformer_layers_per_block": 64,
    "block_out_channels": 16,
    "down_block_types": 16,
    "up_block_types": 16,
}


def _check_structure(config: dict, source: str) -> None:
    for key, limit in STRUCTURE_LIMITS.items():
        value = config.get(key)
        values = value if isinstance(value, (list, tuple)) else [value]
        counts = (
            [len(value)]
            if isinstance(value, (list, tuple)) and key.endswith(("channels", "types"))
            else [v for v in values if isinstance(v, int) and not isinstance(v, bool)]
        )
        if any(v > limit for v in counts):
            raise SdkitError(
                f"{source}: config {key} = {str(value)[:60]} is past anything sdkit builds (at most {limit})"
            )


def _meta_unet(config: dict, source: str) -> UNet2DConditionModel:
    """The architecture of a config on the meta device, or one line saying why it cannot be built."""
    if not isinstance(config, dict):
        raise SdkitError(f"{source}: its config is not a JSON object")
    _check_structure(config, source)
    try:
        return build_unet(config, weights="meta")
    except Exception as e:  # diffusers validates configs with many error types
        raise SdkitError(f"{source}: not a U-Net config diffusers can build ({first_line(e)})") from None


def _check_fits(unet: UNet2DConditionModel, source: str) -> None:
    """Refuse a U-Net whose weights would not fit in the memory that is free (a config asking for
    a 144 GB model dies in the allocator otherwise)."""
    from .common import available_memory, format_bytes

    need = sum(p.numel() for p in unet.parameters()) * 4
    free = available_memory()
    if need > free:
        raise SdkitError(f"{source}: this U-Net needs {format_bytes(need)} in float32; {format_bytes(free)} are free")


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
        data = load_pickle(path, allow_pickle)
        index = index_tensors(str(path), "file", {k: tensor_info(v, str(path)) for k, v in data.items()}, None)
        return {name: data[key] for name, key in index.unet_file_keys.items()}, index
    from safetensors import SafetensorError, safe_open

    index = index_checkpoint(path, allow_pickle)
    try:
        with safe_open(path, framework="pt") as f:
            return {name: f.get_tensor(key) for name, key in index.unet_file_keys.items()}, index
    except SafetensorError as e:
        raise SdkitError(f"{path}: cannot read tensors ({e})") from None


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
