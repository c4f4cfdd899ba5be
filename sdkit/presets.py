"""Named U-Net architectures, from the diffusers configs shipped in sdkit/configs."""

from __future__ import annotations

import json
from importlib import resources

from .common import SdkitError

PRESETS = ("sd15", "sd21", "sdxl", "tiny", "minisd")


def preset_config(name: str) -> dict:
    if name not in PRESETS:
        raise SdkitError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    text = resources.files("sdkit.configs").joinpath(name, "config.json").read_text()
    return json.loads(text)


def build_unet(config: dict, weights: str = "meta", seed: int = 0):
    """A U-Net from a diffusers config.

    weights="meta": shapes only, no memory (for counting and analytic work);
    weights="random": diffusers' own initialisation under a fixed seed.
    """
    import torch
    from accelerate import init_empty_weights
    from diffusers import UNet2DConditionModel

    if weights == "meta":  # with buffers: every tensor is born on the meta device, nothing is allocated
        with init_empty_weights(include_buffers=True):
            return UNet2DConditionModel.from_config(config)
    if weights == "random":
        torch.manual_seed(seed)
        return UNet2DConditionModel.from_config(config).eval()
    raise ValueError(f"weights must be 'meta' or 'random', not {weights!r}")
