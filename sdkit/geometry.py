"""U-Net geometry shared by the audit, the score tables and the trace: image -> grid per level.

Latent U-Nets (SD 1.x/2.x/XL) see the image through a VAE that divides each side by 8; a U-Net
that takes RGB directly (the mini SD) sees pixels. Each level down halves the grid again.
"""

from __future__ import annotations

VAE_FACTOR = 8


def image_factor(config: dict) -> int:
    """Pixels per grid cell at the U-Net's input: 1 for a U-Net that denoises RGB (pixel space: three
    output channels, whatever it reads beside them), else the VAE's 8."""
    return 1 if config.get("out_channels", config.get("in_channels")) == 3 else VAE_FACTOR


def native_image_size(config: dict) -> int | None:
    """The image side a U-Net was made for (SD 1.5: 512, SD 2.1: 768, SDXL: 1024), if its config says."""
    side = config.get("sample_size")
    if isinstance(side, (list, tuple)):
        side = side[0]
    return side * image_factor(config) if isinstance(side, int) and side > 0 else None


def halved(h: int, w: int, times: int) -> tuple[int, int]:
    """A grid after `times` stride-2 convolutions with padding 1 (they round up).

    Rounding up twice is rounding up once by 4, so this is ceil(side / 2^times), in closed form
    (a level numbered in the billions, from a damaged checkpoint, costs no more than level 3)."""
    divisor = 1 << min(times, 128)  # past 2^128 every real side is down to one cell
    return -(-h // divisor), -(-w // divisor)


def level_depth(level: str, levels: int) -> int:
    """How many times the grid has been halved at a level (down.i, mid, up.i or stem)."""
    if level == "stem":
        return 0
    if level == "mid":
        return levels - 1
    kind, index = level.split(".")
    return int(index) if kind == "down" else levels - 1 - int(index)
