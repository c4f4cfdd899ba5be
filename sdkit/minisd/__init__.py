"""The mini Stable Diffusion trained here: data with an answer key, training, sampling, the judge.

data.py      captioned shapes with known masks (the generator)
judge.py     reads colour, place and shape back from pixels
pipeline.py  the model folder and text -> image sampling
train.py     `sdkit minisd train` (pixels, or a VAE's latents as a stock StableDiffusionPipeline)
vae.py       `sdkit minisd vae`: the latent mini SD's VAE
evaluate.py  `sdkit minisd eval`: judged accuracy against floors
"""

from __future__ import annotations

from pathlib import Path

# In float32, the default on a CPU, alone on 2 cores: 55 min on a Xeon without AMX (the shipped
# model), 37-43 min on a Xeon with AMX (seeds 2, 4, 5 and 6), 48 at bench_minisd's 40.5 samples/s on
# an AMD EPYC (docs/training.md, "Speed" and "Reproducible").
SHIPPED_TRAINING_TIME = "37-55 min on 2 CPU cores"
# train.py's choices, here so that the CLI offers them without importing torch
PRECISIONS = ("auto", "bf16", "bf16-fp32-ends", "fp32")
LR_SCHEDULES = ("cosine", "constant")
POSTERIORS = ("sample", "mean")  # what a latent run denoises: a draw from the VAE's posterior, or its mean
# A latent run's steps when none are asked for: what the shipped latent model trained (its hour on
# 2 CPU cores; at step 2,000 a latent run does not yet show whether it learns left/right).
LATENT_STEPS = 5000
# The classifier-free guidance a mini SD samples at when none is asked for, by space (a pipeline's
# spec.guidance_scale): the pixel model was trained and judged at 4; the latent models draw extra
# objects at 4 and compose most at 2 (chosen on another draw of captions than eval's:
# findings/guidance.json, docs/latent.md).
SAMPLING_GUIDANCE = {"pixels": 4.0, "latents": 2.0}
# The draw of captions `sdkit minisd eval` judges on (the same prompts on every run); another is
# for choosing a setting without fitting it to these.
EVAL_SET_SEED = 1234


def explanation(model: str = "weights/minisd", encoders_dir: str = "weights/encoders") -> str:
    have_model = (Path(model) / "minisd.json").is_file()
    have_encoder = (Path(encoders_dir) / "all-MiniLM-L6-v2" / "config.json").is_file()
    state = [
        f"model: {model} {'is here' if have_model else 'is missing (sdkit minisd train writes it)'}",
        f"text encoder: {Path(encoders_dir) / 'all-MiniLM-L6-v2'} "
        f"{'is here' if have_encoder else 'is missing (python scripts/get_real_encoders.py)'}",
    ]
    return f"""sdkit minisd: a mini Stable Diffusion that has learned, with an answer key.

An SD-1.x-shaped U-Net (cross-attention down/up blocks, GEGLU feed-forward, a cross-attention mid
block; with place embeddings before its attentions) that denoises 32x32 RGB pixels directly (no
VAE), reading the token states of the frozen, pretrained all-MiniLM-L6-v2 encoder (384 wide). It
is trained here (zero terminal SNR, v-prediction, the noisiest timesteps drawn 3x as often), on
captioned images of one or two coloured shapes whose masks are known, so attention maps and
generated images can be scored.

  sdkit minisd train                      train (the shipped model: the defaults, {SHIPPED_TRAINING_TIME})
  sdkit minisd sample "a red circle at the top left" --seeds 8 --out grid.png
  sdkit minisd eval --panel panel.png     judge generated images, against floors

weights/minisd-latent is the same on a VAE's 16x16x4 latents, as a stock diffusers
StableDiffusionPipeline folder (single objects 100 %, pairs 47 % at its guidance 2: docs/latent.md).

{chr(10).join(state)}"""
