"""Named U-Net architectures, from the diffusers configs shipped in sdkit/configs."""

from __future__ import annotations

import json
from importlib import resources

from .common import SdkitError

PRESETS = ("sd15", "sd21", "sdxl", "tiny", "minisd", "minisd-latent")


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


def tiny_sd_pipeline(seed: int = 0):
    """A tiny stock diffusers `StableDiffusionPipeline` with random weights: a U-Net with
    cross-attention at 32x32 and 16x16 latent cells, a two-level VAE, a CLIP-shaped text encoder
    32 wide and SD 1.5's DDIM schedule. It shows the mechanics of any SD pipeline offline, in
    seconds; its images are noise."""
    import tempfile

    import torch
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTokenizer

    from .encoders import write_tiny_clip_encoder

    with tempfile.TemporaryDirectory() as folder:
        encoder = write_tiny_clip_encoder(folder, width=32, seed=seed)
        text_encoder = CLIPTextModel.from_pretrained(encoder / "text_encoder")
        tokenizer = CLIPTokenizer.from_pretrained(encoder / "tokenizer")
    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        sample_size=32,
        in_channels=4,
        out_channels=4,
        block_out_channels=(16, 32),
        layers_per_block=1,
        norm_num_groups=8,
        attention_head_dim=4,
        cross_attention_dim=32,
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    )
    vae = AutoencoderKL(
        block_out_channels=(8, 8),
        norm_num_groups=4,
        latent_channels=4,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
    )
    scheduler = DDIMScheduler(
        beta_schedule="scaled_linear",
        beta_start=0.00085,
        beta_end=0.012,
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
    )  # SD 1.5's: 50 steps start at 981
    return StableDiffusionPipeline(
        vae=vae.eval(),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet.eval(),
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


def write_tiny_sd_pipeline(folder, seed: int = 0):
    """tiny_sd_pipeline() saved as a stock pipeline folder, which `StableDiffusionPipeline.from_pretrained`
    loads offline; returns the folder's path."""
    from pathlib import Path

    tiny_sd_pipeline(seed).save_pretrained(folder)
    return Path(folder)
