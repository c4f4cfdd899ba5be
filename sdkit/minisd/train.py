"""Train a mini SD: SD 1.x's recipe at the size of a laptop.

epsilon-prediction under diffusers' DDPMScheduler (scaled_linear betas; or v-prediction on betas
rescaled to zero terminal SNR, `zero_terminal_snr`), the frozen text encoder's
token states (encoded once per caption and cached), about 10 % empty captions for classifier-free
guidance, Min-SNR loss weighting (with a floor for the noisiest steps), AdamW with warm-up and cosine decay, EMA weights (what is saved),
all through accelerate (`accelerate launch -m sdkit.cli minisd train` spreads each batch over GPUs).

Every batch is a function of (seed, step): the images come from the generator by index, the noise
and timesteps from a generator seeded by the step. So a run killed after a checkpoint resumes to
the very same weights as a run that never stopped.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import math
import os
import platform
import random
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from ..common import (
    MODEL_FOLDER,
    SdkitError,
    atomic_path,
    available_memory,
    check_output,
    check_output_folder,
    format_bytes,
)
from ..encoders import TextEncoder, encoder_fingerprint
from ..geometry import halved
from . import LR_SCHEDULES, POSTERIORS, PRECISIONS
from .data import all_captions, parse_caption, sample_at, to_model
from .pipeline import (
    CONDITIONINGS,
    LATENT_DOWNSCALE,
    MAX_IMAGE_SIZE,
    SCHEDULER_CONFIG,
    SPACES,
    MiniSDPipeline,
    MiniSDSpec,
    add_coordinates,
    add_place_embeddings,
    pool_states,
    posterior,
    scaled_latents,
)

CHECKPOINT = "checkpoint.safetensors"
IN_PROGRESS = "model"  # beside the checkpoint: its EMA weights as a mini SD folder


def kept_model(step: int) -> str:
    """The folder beside the checkpoint that keeps the EMA weights of `step` (train's keep_models_every)."""
    return f"{IN_PROGRESS}-{step}"


@dataclass
class TrainSettings:
    steps: int = 3600
    batch_size: int = 32  # images per step, over all processes
    lr: float = 1e-3  # peak, after a linear warm-up
    warmup_steps: int = 100
    # After the warm-up: "cosine" decays to zero at the last step; "constant" holds the peak, as SD 1.x
    # trained (its EMA weights, what is saved, average the last few hundred steps either way).
    lr_schedule: str = "cosine"
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    snr_gamma: float = 5.0  # Min-SNR clip on the image-error weight; 0 for the plain epsilon MSE
    x0_weight_floor: float = 1.0  # added to that weight, so the noisiest steps (where layout is decided) count
    ema_max_decay: float = 0.9999
    ema_power: float = 2 / 3  # EMA warm-up: decay = 1 - (1 + step) ** -power
    empty_fraction: float = 0.1  # captions dropped for classifier-free guidance
    pair_fraction: float = 0.5  # images with two objects
    image_size: int = 32
    # Token positions the U-Net reads. all-MiniLM-L6-v2 leaves zeros past a caption, which take
    # attention weight like any key; 24 holds every caption and keeps them from drowning it.
    context_length: int = 24
    conditioning: str = "tokens"  # or "pooled": the mean token state, one key/value
    coordinates: bool = False  # x and y channels at the U-Net's input (a departure from SD 1.x; see MiniSDSpec)
    place_embeddings: bool = (
        True  # sinusoidal places before each transformer block's attention (a departure; see MiniSDSpec)
    )
    # Weight of the grounding loss (see grounding_loss): each object's words made to attend to its
    # mask, TokenCompose's token loss. A departure from SD's recipe, which has no masks to do it; 0: off.
    grounding_weight: float = 0.0
    # Weight of the relation loss (see relation_loss): in a pair, the first object's words made to
    # attend left of the second's when the caption says "left of". Also a departure; 0: off.
    relation_weight: float = 0.0
    attention_loss_from: int = 0  # both losses only on images noised to at least this timestep (of 1,000)
    # The fraction of pair images noised, at timesteps of at least swap_from, from the pair with its
    # two objects exchanged (each cell kept), while the loss still asks for the true image. In SD's
    # recipe the noisy image always shows its caption's objects where they are, so a model can take
    # which object is where from the noise instead of the text; at sampling, the noise shows nothing.
    # At 0.5 the noisy image says nothing about which object is where: only the caption does. A
    # departure from SD's recipe; 0: off.
    swap_fraction: float = 0.0
    swap_from: int = 600
    # SD 1.x's schedule stops at SNR 0.0047, not 0: at the last timestep a training image still shows
    # where its objects are (an object's pixels, matched-filtered, stand about 0.7 noise deviations
    # out), so the model can learn to take the layout from the noise, and at sampling, pure noise has
    # no layout to give. True: betas rescaled to end at SNR 0 (Lin et al. 2024) and the U-Net predicts
    # v (SD 2.x's target), since at SNR 0 the noise is the input and predicting it teaches nothing.
    # The recipe's, with place_embeddings and timestep_bias: the three together (not one of them
    # alone) are what made the mini SD draw pairs; each is off in SD 1.x's recipe.
    zero_terminal_snr: bool = True
    # Timesteps of at least timestep_bias_from drawn timestep_bias times as often as the others
    # (diffusers' SDXL training script's "later" timestep bias; the loss is not reweighted back).
    # A pair's order is decided there, and there only the caption can give it, but uniform timesteps
    # put a tenth of the images there (a twentieth of them pairs). Trained on pairs at 900-999 alone
    # (with place embeddings), the U-Net's relation word moved the colours the asked way in 9 pairs
    # of 10 after about 1,000 steps: more steps than uniform timesteps give there. At 3, a quarter of
    # the images land there; at 9, half, which in 3,600 steps left too few where shapes are drawn
    # (the ablation's x9 and x3 3,600-step rows). 1: uniform, SD's recipe.
    timestep_bias: float = 3.0
    timestep_bias_from: int = 900
    seed: int = 0
    # "pixels": the U-Net denoises the images; "latents": it denoises a VAE's latents of them (image_size
    # is the pixel side either way), drawn from the encoder's posterior (see posterior) and scaled, as SD trained.
    space: str = "pixels"
    # What a latent run denoises: "sample", a draw from the encoder's posterior (SD's recipe); "mean",
    # the posterior's mean. The shipped VAE's posterior is wide where the image is flat (std 0.46
    # in the background, 0.07 on the objects, of scaled latents whose std is 1): noise the U-Net
    # must learn to draw and the decoder ignores. Sampling is the same either way.
    posterior: str = "sample"
    # A latent run's images. 0: every sample a new image of the stream, encoded by the VAE at its step
    # (about a quarter of a float32 step on 2 CPU cores). N: the stream's first N images, encoded once
    # before the first step (and cached beside the captions' states), each pass over them in a new order
    # and each use a new draw from the image's posterior, as training scripts that cache SD's latents
    # do. The pool's encoding is part of the run's time.
    latent_pool: int = 0
    # "bf16": torch's autocast (bfloat16 convolutions and matmuls on float32 weights); "bf16-fp32-ends":
    # the same with the U-Net's first and last layers in float32 (ends_in_float32); "fp32";
    # "auto": bf16-fp32-ends on a GPU that has bfloat16, fp32 on a CPU (resolve_precision).
    # Either is the weights' recipe: part of the fingerprint.
    precision: str = "auto"
    compile: bool = True  # torch.compile the U-Net (see compile_unet): ~1.1-1.2x here, after 30-90 s

    def check(self) -> None:
        for name in ("steps", "batch_size", "image_size", "context_length"):
            if getattr(self, name) <= 0:
                raise SdkitError(f"{name} must be positive, not {getattr(self, name)}")
        for name in (
            "lr",
            "weight_decay",
            "max_grad_norm",
            "snr_gamma",
            "x0_weight_floor",
            "empty_fraction",
            "pair_fraction",
            "grounding_weight",
            "relation_weight",
            "swap_fraction",
            "timestep_bias",
        ):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise SdkitError(f"{name} must be a finite number >= 0, not {value}")
        if self.lr == 0 or self.timestep_bias == 0:
            raise SdkitError("lr and timestep_bias must be positive")
        if self.lr > 1:  # AdamW moves each weight by about lr a step: past 1, by more than its scale
            raise SdkitError(f"lr must be at most 1, not {self.lr:g}")
        if not 12 <= self.image_size <= MAX_IMAGE_SIZE:
            raise SdkitError(
                f"image_size must be 12 (a 3x3 grid of objects) to {MAX_IMAGE_SIZE} pixels, not {self.image_size}"
            )
        if self.empty_fraction > 1 or self.pair_fraction > 1 or self.swap_fraction > 1:
            raise SdkitError("empty_fraction, pair_fraction and swap_fraction are fractions (0 to 1)")
        if self.swap_fraction and not self.pair_fraction:
            raise SdkitError("swap_fraction exchanges the objects of pair images, and pair_fraction 0 draws none")
        if self.conditioning not in CONDITIONINGS:
            raise SdkitError(f"unknown conditioning {self.conditioning!r}; choose one of {', '.join(CONDITIONINGS)}")
        for name in ("attention_loss_from", "swap_from", "timestep_bias_from"):
            if not 0 <= getattr(self, name) < SCHEDULER_CONFIG["num_train_timesteps"]:
                raise SdkitError(
                    f"{name} must be a timestep from 0 to "
                    f"{SCHEDULER_CONFIG['num_train_timesteps'] - 1}, not {getattr(self, name)}"
                )
        if (self.grounding_weight or self.relation_weight) and self.conditioning != "tokens":
            raise SdkitError(
                "the grounding and relation losses need token conditioning: a pooled caption is one key, "
                "whose weight is 1 everywhere"
            )
        if self.lr_schedule not in LR_SCHEDULES:
            raise SdkitError(f"unknown lr_schedule {self.lr_schedule!r}; choose one of {', '.join(LR_SCHEDULES)}")
        if self.precision not in PRECISIONS:
            raise SdkitError(f"unknown precision {self.precision!r}; choose one of {', '.join(PRECISIONS)}")
        if self.space not in SPACES:
            raise SdkitError(f"unknown space {self.space!r}; choose one of {', '.join(SPACES)}")
        if self.posterior not in POSTERIORS:
            raise SdkitError(f"unknown posterior {self.posterior!r}; choose one of {', '.join(POSTERIORS)}")
        if self.space == "pixels" and self.posterior != "sample":
            raise SdkitError("posterior is a latent run's: a pixel mini SD denoises the images themselves")
        if self.latent_pool < 0:
            raise SdkitError(f"latent_pool must be 0 (no pool) or a number of images, not {self.latent_pool}")
        if self.space == "pixels" and self.latent_pool:
            raise SdkitError("latent_pool is a latent run's: a pixel mini SD has no VAE encode to save")
        if self.space == "latents" and self.coordinates:
            raise SdkitError(
                "a latent mini SD is a stock StableDiffusionPipeline, whose pipeline feeds the U-Net the "
                "latents alone: no coordinate channels"
            )


# Settings added after models were trained and recorded, with the value every earlier run had.
ADDED_SETTINGS = {
    "coordinates": False,
    "grounding_weight": 0.0,
    "relation_weight": 0.0,
    "attention_loss_from": 0,
    "zero_terminal_snr": False,
    "swap_fraction": 0.0,
    "swap_from": 600,
    "place_embeddings": False,
    "timestep_bias": 1.0,
    "timestep_bias_from": 900,
    "lr_schedule": "cosine",
    "space": "pixels",
    "posterior": "sample",
    "latent_pool": 0,
}


def recorded_settings(recorded: dict) -> dict:
    """A run's settings as its record holds them, with the settings added since filled in as it had them."""
    return {**ADDED_SETTINGS, **recorded}


def resolve_precision(precision: str, device: torch.device) -> str:
    """ "auto" -> "bf16-fp32-ends" on a GPU that computes bfloat16, "fp32" on a CPU (see the comments)."""
    if precision != "auto":
        return precision
    if device.type == "cuda":
        # Not plain bfloat16: CUDA's autocast runs the output convolution in bfloat16 too, whose weight
        # gradient (summed over every pixel) came out 26 % off float32's on the CPU, and plain bfloat16
        # cost 28 and 31 points of pairs there (seeds 0 and 1); the ends are a few % of the U-Net's work.
        return "bf16-fp32-ends" if torch.cuda.is_bf16_supported() else "fp32"
    # On a CPU, float32: the precision the shipped model was trained in, so that the defaults
    # rebuild it to the bit. bfloat16 is faster on some CPUs (AMX; an AMD EPYC's AVX512-BF16: 1.77x
    # a plain loop, where float32 is 1.10x) and slower on others (a Xeon showing AVX512-BF16 without
    # AMX). Plain bfloat16 runs of the shipped recipe drew 42 and 23 % of pairs (seeds 0 and 1) where
    # float32 drew 70 and 55 %; with float32 ends, 50, 55, 23 and 55 % where float32 drew 70, 55, 56
    # and 36 % (seeds 0 to 3; the ablation's last rows; docs/training.md, "Speed"): gaps of either sign, as
    # wide as float32's own from seed to seed, and a run's result moves with the float order alone
    # (seed 2 with float32 ends: 23 % in two threads, 64 % in one).
    return "fp32"


# --- caption states, encoded once ----------------------------------------------------------------


@dataclass
class CaptionStates:
    """Every training caption's token states (zeros past its tokens), looked up by caption."""

    captions: list[str]
    states: torch.Tensor  # (captions, longest caption in tokens, width) float32
    lengths: torch.Tensor  # (captions,) real tokens of each
    max_length: int  # positions the U-Net reads; states are padded with zeros to it

    def __post_init__(self):
        self.row = {c: i for i, c in enumerate(self.captions)}

    def lookup(self, captions: list[str], conditioning: str = "tokens") -> torch.Tensor:
        try:
            rows = torch.tensor([self.row[c] for c in captions])
        except KeyError as e:
            raise SdkitError(f"caption {e.args[0]!r} was not encoded") from None
        states = self.states[rows]
        if conditioning == "pooled":
            real = torch.arange(states.shape[1]) < self.lengths[rows, None]
            return pool_states(states, real)
        return F.pad(states, (0, 0, 0, self.max_length - states.shape[1]))


def cached_tensors(
    cache_dir: str | os.PathLike | None, name: str, key: dict, shape: dict[str, int], make
) -> dict[str, torch.Tensor]:
    """make()'s tensors, read from cache_dir when a file keyed by `key` holds them (`shape`: each
    tensor's name and rows), else made and written there (a damaged file is made again, replaced)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file, save_file

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = Path(cache_dir) / f"{name}-{digest}.safetensors" if cache_dir else None
    if path and path.is_file():
        try:
            tensors = load_file(path)
            if {tensor_name: len(tensor) for tensor_name, tensor in tensors.items()} == shape:
                return tensors
        except (SafetensorError, OSError):
            pass  # damaged: made again and replaced
    tensors = make()
    if path:
        with atomic_path(path) as tmp:
            save_file(tensors, str(tmp))
    return tensors


def encode_captions(
    encoder: TextEncoder,
    captions: list[str],
    cache_dir: str | os.PathLike | None,
    batch_size: int = 128,
    progress: bool = True,
) -> CaptionStates:
    """Encode captions (or read them from the cache, keyed by the encoder and the captions)."""
    from tqdm import tqdm

    def encode() -> dict[str, torch.Tensor]:
        parts, lengths = [], []
        batches = range(0, len(captions), batch_size)
        for start in tqdm(batches, desc="encoding captions", unit="batch", disable=not progress):
            batch = captions[start : start + batch_size]
            parts.append(encoder.encode(batch).float().cpu())
            lengths.append(encoder.real_mask(batch).sum(1))
        lengths = torch.cat(lengths)
        states = torch.cat(parts)
        if not encoder.pads_with_states:  # masked encoders leave zeros past the caption: keep only the tokens
            states = states[:, : int(lengths.max())].contiguous()
        return {"states": states, "lengths": lengths}

    key = {"format": 1, "encoder": encoder_fingerprint(encoder), "captions": captions}
    tensors = cached_tensors(
        cache_dir, "minisd-captions", key, {"states": len(captions), "lengths": len(captions)}, encode
    )
    return CaptionStates(captions, tensors["states"], tensors["lengths"], encoder.max_length)


# --- a latent run's pool of images, encoded once ---------------------------------------------------


@dataclass
class LatentPool:
    """The VAE posteriors of the stream's first images, scaled as the U-Net reads latents."""

    mean: torch.Tensor  # (images, 4, h, w) float32
    std: torch.Tensor  # (images, 4, h, w) float32

    def draw(self, images: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """The latents of `images` (stream indices): each posterior's mean, or with a generator a
        draw from it, the draw scaled_latents makes of those images with that generator."""
        mean = self.mean[images]
        if generator is None:
            return mean
        return mean + self.std[images] * torch.randn(mean.shape, generator=generator)


def encode_pool(
    vae,
    settings: TrainSettings,
    cache_dir: str | os.PathLike | None,
    batch_size: int = 64,
    progress: bool = True,
) -> LatentPool:
    """Encode the stream's first settings.latent_pool images (or read them from the cache, keyed by
    the VAE's weights, the stream and whether the encode runs in bfloat16, as settings.precision says)."""
    from tqdm import tqdm

    def encode() -> dict[str, torch.Tensor]:
        scale = vae.config.scaling_factor
        autocast = training_autocast(settings.precision, vae.device)
        means, stds = [], []
        starts = range(0, settings.latent_pool, batch_size)
        for start in tqdm(starts, desc="encoding the latent pool", unit="batch", disable=not progress):
            stop = min(start + batch_size, settings.latent_pool)
            images = [
                sample_at(settings.seed, i, settings.image_size, settings.pair_fraction).image
                for i in range(start, stop)
            ]
            pixels = torch.from_numpy(np.stack([to_model(image) for image in images])).to(vae.device)
            with torch.no_grad(), autocast:  # as scaled_latents encodes at a step
                dist = posterior(vae, pixels)
            means.append((dist.mean * scale).float().cpu())
            stds.append((dist.std * scale).float().cpu())
        return {"mean": torch.cat(means).contiguous(), "std": torch.cat(stds).contiguous()}

    key = {
        "format": 1,
        "vae": vae_fingerprint(vae),
        "seed": settings.seed,
        "image_size": settings.image_size,
        "pair_fraction": settings.pair_fraction,
        "images": settings.latent_pool,
        "bf16": settings.precision.startswith("bf16"),
    }
    tensors = cached_tensors(
        cache_dir, "minisd-latents", key, {"mean": settings.latent_pool, "std": settings.latent_pool}, encode
    )
    return LatentPool(tensors["mean"], tensors["std"])


# --- batches ---------------------------------------------------------------------------------------


class Batch(NamedTuple):
    pixels: torch.Tensor  # (n, 3, H, W) in [-1, 1]
    states: torch.Tensor  # (n, context, width) or (n, 1, width) pooled
    noise: torch.Tensor
    timesteps: torch.Tensor
    captions: list[str]  # "" where dropped for guidance
    masks: torch.Tensor  # (n, 2, H, W) float: each object's mask, zeros where the image has no second object
    noised_from: torch.Tensor  # (n, 3, H, W): the image the noise is added to (pixels, or a pair swapped)
    images: torch.Tensor  # (n,) long: each sample's image, its index in the stream (image_index)


def image_index(settings: TrainSettings, sample: int) -> int:
    """The stream index of the image that the run's sample-th sample shows: the sample's own, or
    with a latent pool, the pool's image at that place of this pass's order."""
    if not settings.latent_pool:
        return sample
    rank, place = divmod(sample, settings.latent_pool)
    return int(pool_order(settings.seed, rank, settings.latent_pool)[place])


@functools.lru_cache(maxsize=2)
def pool_order(seed: int, rank: int, size: int) -> torch.Tensor:
    """The order of the rank-th pass over a latent pool of `size` images."""
    return torch.randperm(size, generator=torch.Generator().manual_seed(hash_seed(seed, rank, "pool")))


def batch_at(
    step: int, settings: TrainSettings, captions: CaptionStates, process: int = 0, processes: int = 1
) -> Batch:
    """This process's share of the batch of `step`."""
    per_process = settings.batch_size // processes
    first = step * settings.batch_size + process * per_process
    images = [image_index(settings, i) for i in range(first, first + per_process)]
    samples = [sample_at(settings.seed, image, settings.image_size, settings.pair_fraction) for image in images]
    texts = [
        "" if random.Random(f"drop:{settings.seed}:{i}").random() < settings.empty_fraction else s.caption
        for i, s in zip(range(first, first + per_process), samples)
    ]
    pixels = torch.from_numpy(np.stack([to_model(s.image) for s in samples]))
    masks = torch.zeros(per_process, 2, settings.image_size, settings.image_size)
    for i, sample in enumerate(samples):
        masks[i, : len(sample.masks)] = torch.from_numpy(sample.masks)
    # The whole batch's noise and timesteps, of which this process takes its share: drawn per
    # process, a batch over two processes would be another batch than over one.
    generator = torch.Generator().manual_seed(hash_seed(settings.seed, step, 0))
    share = slice(process * per_process, (process + 1) * per_process)
    side = settings.image_size // LATENT_DOWNSCALE
    shape = (4, side, side) if settings.space == "latents" else pixels.shape[1:]
    noise = torch.randn((settings.batch_size, *shape), generator=generator)[share]
    timesteps = draw_timesteps(settings, generator)[share]
    noised_from = pixels
    if settings.swap_fraction:
        noised_from = pixels.clone()
        for i, (index, image, sample) in enumerate(zip(range(first, first + per_process), images, samples)):
            if (
                len(sample.masks) == 2
                and timesteps[i] >= settings.swap_from
                and random.Random(f"swap:{settings.seed}:{index}").random() < settings.swap_fraction
            ):
                swapped = sample_at(settings.seed, image, settings.image_size, settings.pair_fraction, swapped=True)
                noised_from[i] = torch.from_numpy(to_model(swapped.image))
    return Batch(
        pixels,
        captions.lookup(texts, settings.conditioning),
        noise,
        timesteps,
        texts,
        masks,
        noised_from,
        torch.tensor(images),
    )


def draw_timesteps(settings: TrainSettings, generator: torch.Generator) -> torch.Tensor:
    """The whole batch's timesteps: uniform (torch.randint's draw, as every run before the bias had),
    or with those from timestep_bias_from on timestep_bias times as likely."""
    count = SCHEDULER_CONFIG["num_train_timesteps"]
    if settings.timestep_bias == 1.0:
        return torch.randint(0, count, (settings.batch_size,), generator=generator)
    weights = torch.ones(count, dtype=torch.float64)
    weights[settings.timestep_bias_from :] = settings.timestep_bias
    return torch.multinomial(weights, settings.batch_size, replacement=True, generator=generator)


def training_autocast(precision: str, device: torch.device):
    """bfloat16 autocast under the bf16 precisions, off in fp32 (precision resolved, not "auto")."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision.startswith("bf16"))


def hash_seed(*parts) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little") >> 1


def learning_rate(step: int, settings: TrainSettings) -> float:
    if step < settings.warmup_steps:
        return settings.lr * (step + 1) / settings.warmup_steps
    if settings.lr_schedule == "constant":
        return settings.lr
    progress = (step - settings.warmup_steps) / max(1, settings.steps - settings.warmup_steps)
    return settings.lr * 0.5 * (1 + math.cos(math.pi * progress))


@contextmanager
def freed_memory_kept():
    """glibc's malloc keeps freed blocks for reuse while inside, instead of handing them back to the
    system; glibc's default thresholds (128 KiB) are set again on the way out and the memory returned.

    Each training step frees and reallocates its activations. By default glibc maps large blocks
    afresh and unmaps them when freed, so every step faulted their pages in again, each zeroed by
    the kernel: 21,700 page faults a step in the mini SD's training on 2 cores (36 with this) and
    about 4 % of its time. PyTorch's CPU tuning guide gets this from jemalloc or tcmalloc; mallopt is
    glibc's own switch for it. Elsewhere than glibc, nothing changes."""
    if platform.libc_ver()[0] != "glibc":
        yield
        return
    libc = ctypes.CDLL(None)
    trim_threshold, mmap_threshold = -1, -3  # mallopt's M_TRIM_THRESHOLD, M_MMAP_THRESHOLD
    libc.mallopt(mmap_threshold, 32 << 20)  # glibc's ceiling for it on 64-bit systems
    libc.mallopt(trim_threshold, 1 << 30)
    try:
        yield
    finally:
        libc.mallopt(mmap_threshold, 128 << 10)
        libc.mallopt(trim_threshold, 128 << 10)
        libc.malloc_trim(0)


def flat_parameters(module) -> torch.nn.Parameter:
    """One parameter holding all of `module`'s, each of them now a view into it, and each one's
    gradient a view into its gradient: clipping, AdamW and the EMA then run a kernel each over the
    whole model instead of one per tensor (326 in the mini SD; 28 ms of a 455 ms step on 2 cores
    became 14). AdamW and the EMA work element by element, so they give the same bits either way;
    clipping's norm sums in another order.

    The gradient must be zeroed in place (`zero_grad(set_to_none=False)`): set to None, the views
    would go on filling a buffer the optimizer no longer reads."""
    params = list(module.parameters())
    flat = torch.nn.Parameter(torch.nn.utils.parameters_to_vector(params).detach())
    flat.grad = torch.zeros_like(flat)
    sizes = [p.numel() for p in params]
    for param, value, grad in zip(params, flat.data.split(sizes), flat.grad.split(sizes)):
        param.data, param.grad = value.view_as(param), grad.view_as(param)
    return flat


def compile_unet(unet, precision: str) -> None:
    """torch.compile the U-Net for training, in place: whole in bfloat16, block by block in float32.

    In bfloat16 the whole U-Net compiled trains about 1.1x faster than its blocks compiled (the AMX
    Xeon, batch 32, forward and backward: 310-322 against 349-354 ms), as inductor fuses its norms,
    activations and casts around the convolutions too. In float32 it was no faster (667-675 against
    647-659 ms), and the blocks are the path the shipped model's bits come from, so float32 keeps them.

    Compiled whole, the U-Net's gradients were wrong until its upsamplers were rewritten (see
    upsample_by_broadcast): training ran, the loss fell, and a 1,600-step model drew nothing it was
    asked. A test holds every gradient to eager's on the mini SD itself, in each precision."""
    if precision == "fp32":
        compile_blocks(unet)
    else:
        upsample_by_broadcast(unet)
        unet.compile(dynamic=False)


def compile_blocks(unet) -> None:
    """torch.compile each Transformer2D block of the U-Net in place (its layer norms, projections,
    attention and GEGLU fuse into a few kernels).

    Each block is compiled for its own shapes (dynamic=False): the blocks share one forward, so
    dynamo would otherwise make the second level's shapes symbolic, and inductor then fails to
    lower float32 scaled_dot_product_attention ("cannot determine truth value of Relational"), where
    bfloat16 training had hidden it by using bmm attention. Static, blocks of one shape share one
    compiled graph (two for the mini SD: 16x16 and 8x8)."""
    from diffusers.models.transformers.transformer_2d import Transformer2DModel

    for module in unet.modules():
        if isinstance(module, Transformer2DModel):
            module.compile(dynamic=False)


def upsample_by_broadcast(unet) -> None:
    """Draw each upsampler's nearest 2x upsampling as a broadcast of every pixel to a 2x2 block:
    the same bits forward, and a gradient that sums each block instead of scattering into a buffer.

    Inductor (torch 2.13, CPU) compiles nearest upsampling's gradient as a scatter-add into a zeroed
    buffer, and in the whole U-Net's backward it fused the zero fill with the kernel that reads the
    buffer's result, ahead of the scatter: the gradient below the last upsampler was computed from
    zeros, and 296 of the mini SD's 326 parameters got gradients as far from eager's as a guess."""
    from diffusers.models.upsampling import Upsample2D

    def broadcast_forward(module):
        forward = module.forward

        def run(hidden_states, output_size=None, *args, **kwargs):
            if output_size is not None:  # a size that is not twice the input's: interpolate as diffusers does
                return forward(hidden_states, output_size, *args, **kwargs)
            b, c, h, w = hidden_states.shape
            doubled = hidden_states[:, :, :, None, :, None].expand(b, c, h, 2, w, 2).reshape(b, c, 2 * h, 2 * w)
            return module.conv(doubled)

        return run

    for module in unet.modules():
        if (
            isinstance(module, Upsample2D)
            and module.interpolate
            and module.use_conv
            and module.name == "conv"
            and module.norm is None
            and not module.use_conv_transpose
        ):
            module.forward = broadcast_forward(module)


def ends_in_float32(unet) -> None:
    """Under bfloat16 autocast, run the U-Net's ends in float32: its input convolution, timestep
    embedding, output norm and output convolution (a few percent of its time).

    The output convolution's weight gradient sums over every pixel of the batch, and in bfloat16 it
    was 26 % off float32's on a batch of the shipped model's training (17 % for the whole gradient,
    of which it is 62 % of the norm); with the ends in float32, 3 % and 4 %. The rest of the U-Net's
    gradients were within 2 % either way (median per tensor)."""

    def float32_forward(module):
        forward = module.forward

        def run(*args, **kwargs):
            args = [a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args]
            # the device it runs on now: train() moves the U-Net after wrapping it
            with torch.autocast(next(module.parameters()).device.type, enabled=False):
                return forward(*args, **kwargs)

        return run

    for module in (unet.conv_in, unet.time_embedding, unet.conv_norm_out, unet.conv_out):
        module.forward = float32_forward(module)


def scheduler_config(settings: TrainSettings) -> dict:
    """The noise schedule and prediction target a run trains with (and its model samples with)."""
    if settings.zero_terminal_snr:
        return {**SCHEDULER_CONFIG, "rescale_betas_zero_snr": True, "prediction_type": "v_prediction"}
    return dict(SCHEDULER_CONFIG)


def training_target(noise_scheduler, pixels, noise, timesteps) -> torch.Tensor:
    """What the U-Net is asked to predict: the noise, or v where the schedule says v_prediction."""
    if noise_scheduler.config.prediction_type == "v_prediction":
        return noise_scheduler.get_velocity(pixels, noise, timesteps)
    return noise


def recipe_unet(config: dict, settings: TrainSettings):
    """The U-Net a run starts from: `config` at random weights from the seed, with the place
    embeddings where the settings ask for them."""
    from ..presets import build_unet

    unet = build_unet(config, weights="random", seed=settings.seed).train()
    if settings.place_embeddings:
        add_place_embeddings(unet, settings.image_size)
    return unet


def weighted_loss(prediction, pixels, noise, timesteps, noise_scheduler, settings: TrainSettings) -> torch.Tensor:
    """The batch's MSE on the scheduler's target (epsilon or v), each sample weighted by its timestep
    (float32 whatever the precision)."""
    from diffusers.training_utils import compute_snr

    v_prediction = noise_scheduler.config.prediction_type == "v_prediction"
    target = training_target(noise_scheduler, pixels, noise, timesteps)
    loss = F.mse_loss(prediction.float(), target, reduction="none").mean(dim=(1, 2, 3))
    if settings.snr_gamma:
        # The epsilon error is sqrt(SNR) x the error of the implied clean image, and the v error
        # sqrt(SNR + 1) x it, so dividing the MSE by SNR (or SNR + 1) and multiplying by
        # w = min(SNR, gamma) + floor weights the image error by w, whichever the target: Min-SNR's
        # clip at the clean end, and at least `floor` at the noisy end, where plain epsilon MSE
        # (w = SNR) gives the layout and colours the text decides almost no weight.
        snr = compute_snr(noise_scheduler, timesteps)
        loss = loss * (torch.clamp(snr, max=settings.snr_gamma) + settings.x0_weight_floor) / (snr + v_prediction)
    return loss.mean()


def noised_from_swapped(pixels, noised_from, noise, timesteps, noise_scheduler) -> tuple[torch.Tensor, torch.Tensor]:
    """(noisy images, the noise that takes each true image to its noisy one): the images noised from
    `noised_from`, and for the loss the noise that, added to `pixels`, gives that same noisy image
    (so the model is asked for the true image). Where the two agree, both are exactly add_noise's."""
    noisy = noise_scheduler.add_noise(noised_from, noise, timesteps)
    signal = noise_scheduler.alphas_cumprod.to(pixels.device)[timesteps].view(-1, 1, 1, 1)
    implied = (noisy - signal.sqrt() * pixels) / (1 - signal).sqrt()
    differs = (noised_from != pixels).flatten(1).any(1).view(-1, 1, 1, 1)
    return noisy, torch.where(differs, implied, noise)


# --- losses on the attention (departures from SD's recipe; off by default) ---------------------------


def relation_signs(captions: list[str]) -> torch.Tensor:
    """(captions,): 1 where a pair's first object is left of the second, -1 where right, 0 otherwise."""
    scenes = [parse_caption(c) for c in captions]
    return torch.tensor(
        [0.0 if s is None or s.relation is None else 1.0 if s.relation == "left of" else -1.0 for s in scenes]
    )


def object_tokens(encoder: TextEncoder, captions: list[str], length: int) -> torch.Tensor:
    """(captions, 2, length): 1 at the positions of each object's colour and shape words, the very
    words steering's layout objective moves (the objects in the caption's order, as the generator's
    masks are); all zero for "" and a missing object."""
    from .steer import caption_guide

    table = torch.zeros(len(captions), 2, length)
    for row, caption in enumerate(captions):
        scene = parse_caption(caption)
        if scene is not None:
            for index, (positions, _) in enumerate(caption_guide(encoder, scene, side=1).layout):
                table[row, index, positions] = 1.0
    return table


class CrossAttentionMaps:
    """Every cross-attention (attn2) layer's attention weights of the latest forward pass, with their
    graph, for a loss on them. Each layer runs diffusers' AttnProcessor (bmm + softmax) with its
    get_attention_scores wrapped to keep what it returns, so the layer's output is unchanged."""

    def __init__(self, unet):
        from diffusers.models.attention_processor import AttnProcessor

        # One holder per layer, written and never read inside the layer: a shared dict, read and
        # grown inside compiled code, made torch.compile recompile it past its limit.
        self.layers: dict[str, SimpleNamespace] = {}
        for name, module in unet.named_modules():
            if name.endswith("attn2"):
                module.set_processor(AttnProcessor())
                self.layers[name] = SimpleNamespace(probs=None)
                module.get_attention_scores = self._keeping(self.layers[name], module.get_attention_scores)

    @property
    def probs(self) -> dict[str, torch.Tensor]:
        """layer -> (batch * heads, cells, tokens)"""
        return {name: layer.probs for name, layer in self.layers.items() if layer.probs is not None}

    @staticmethod
    def _keeping(layer: SimpleNamespace, scores):
        def get_attention_scores(query, key, attention_mask=None):
            layer.probs = scores(query, key, attention_mask)
            return layer.probs

        return get_attention_scores


def object_attention(probs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """(batch, 2, cells): each object's attention at one layer, its words' weights summed, the mean
    over heads. probs: (batch * heads, cells, context) as kept; tokens: (batch, 2, context)."""
    attention = probs.float().view(tokens.shape[0], -1, *probs.shape[1:]).mean(1)
    return torch.einsum("bct,bot->boc", attention, tokens)


def grounding_loss(maps: CrossAttentionMaps, tokens: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """TokenCompose's token loss (Wang et al. 2024), on the generator's true masks: for each object,
    (1 - the share of its words' attention that falls inside its mask)^2, the attention averaged over
    heads and the mask over each layer's cells; the mean over objects present and over layers.

    tokens: (batch, 2, context) from object_tokens; masks: (batch, 2, H, W) from batch_at."""
    present = tokens.sum(-1) > 0
    if not present.any():
        return masks.new_zeros(())
    losses = []
    for probs in maps.probs.values():
        object_maps = object_attention(probs, tokens)
        side = math.isqrt(probs.shape[1])  # training images are square
        inside = F.adaptive_avg_pool2d(masks, side).flatten(2)
        share = (object_maps * inside).sum(-1) / object_maps.sum(-1).clamp_min(1e-12)
        losses.append(((1 - share) ** 2)[present].mean())
    return torch.stack(losses).mean()


RELATION_MARGIN = 0.25  # of the image width: adjacent cells' centres lie a third apart


def relation_loss(maps: CrossAttentionMaps, tokens: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """For each pair: max(0, margin - sign x (x2 - x1))^2, x1 and x2 the horizontal centres (0 to 1)
    of the two objects' attention (mean over heads), at each layer; the mean over pairs and layers.

    What the caption alone decides, the objects' order, and nothing it does not (where in its row
    and column each object lands), so unlike grounding_loss it asks nothing of the attention that
    only the image could answer. tokens: (batch, 2, context); signs: (batch,) from relation_signs."""
    pairs = signs != 0
    if not pairs.any():
        return signs.new_zeros(())
    losses = []
    for probs in maps.probs.values():
        side = math.isqrt(probs.shape[1])
        object_maps = object_attention(probs, tokens).view(-1, 2, side, side).sum(2)  # summed over rows: (b, 2, x)
        x = (torch.arange(side, device=probs.device) + 0.5) / side
        centre = (object_maps * x).sum(-1) / object_maps.sum(-1).clamp_min(1e-12)
        gap = signs * (centre[:, 1] - centre[:, 0])
        losses.append(F.relu(RELATION_MARGIN - gap)[pairs].pow(2).mean())
    return torch.stack(losses).mean()


# --- training ----------------------------------------------------------------------------------------


class Interrupted(Exception):
    """Raised by train's stop_after hook, to stand for a run killed after a checkpoint."""


@dataclass
class TrainResult:
    folder: str
    settings: dict  # as trained: "auto" precision resolved
    steps: int
    resumed_from: int
    seconds: float  # this process's training
    samples_per_second: float  # this process's
    history: list[dict]
    total_seconds: float  # the run's training, every process that resumed it counted


def training_bytes_per_image(config: dict) -> int:
    """A floor under the memory one image of a batch takes to train: the feature maps that the
    backward pass keeps for the skip connections, on the way down and up, in float32. The real
    figure is several times this (attention tables, the GEGLU's wide halves), so a batch refused
    here could never have run."""
    side = config["sample_size"]
    kept = 0
    for depth, channels in enumerate(config.get("block_out_channels", ())):
        cells = math.prod(halved(side, side, depth))
        kept += 2 * (config.get("layers_per_block", 2) + 1) * channels * cells * 4
    return kept + config.get("in_channels", 3) * side * side * 4


def check_training_fits(config: dict, batch_size: int, device: torch.device) -> None:
    """Refuse, before any allocation, a batch whose training step could not fit in free memory."""
    need = batch_size * training_bytes_per_image(config)
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else available_memory()
    if need > free:
        side = config["sample_size"]
        raise SdkitError(
            f"a batch of {batch_size:,} images at {side}x{side} needs at least {format_bytes(need)} to "
            f"train; {format_bytes(free)} is free (lower --batch-size or --image-size)"
        )


def vae_fingerprint(vae) -> str | None:
    """The VAE's config and a hash of its weights (a few MB: hashed in well under a second)."""
    if vae is None:
        return None
    digest = hashlib.sha256(json.dumps(dict(vae.config), sort_keys=True, default=str).encode())
    for name, tensor in sorted(vae.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def run_fingerprint(settings: TrainSettings, unet_config: dict, encoder: TextEncoder, vae=None) -> str:
    """Everything that decides the trained weights; a checkpoint from another run is refused."""
    data = {
        "format": 2,
        "settings": asdict(settings),
        "unet": dict(unet_config),
        "encoder": encoder_fingerprint(encoder),
    }
    if vae is not None:
        data["vae"] = vae_fingerprint(vae)
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


def train(
    out: str | os.PathLike,
    encoder: TextEncoder,
    settings: TrainSettings | None = None,
    unet_config: dict | None = None,
    checkpoint_dir: str | os.PathLike | None = None,
    checkpoint_every: int = 200,
    cache_dir: str | os.PathLike | None = None,
    progress: bool = True,
    stop_after: int | None = None,
    vae=None,
    vae_record: dict | None = None,
    keep_models_every: int | None = None,
) -> TrainResult:
    """Train a mini SD and save it (EMA weights) to `out` as a model folder.

    With settings.space "latents", `vae` (a diffusers AutoencoderKL, kept frozen) makes the latents,
    the encoder must encode as a stock pipeline does (encoders.for_stock_pipeline), and `out` is a
    stock StableDiffusionPipeline folder; `vae_record` (how the VAE was trained) goes into its record.

    With `checkpoint_dir`, the full state (weights, EMA, optimizer, step) is written there every
    `checkpoint_every` steps, and a run that finds a checkpoint of the same run resumes from it.
    Its EMA weights go to `checkpoint_dir`/model each time, and with `keep_models_every` (a multiple
    of `checkpoint_every`) also to `checkpoint_dir`/model-STEP at every such step, kept: the run's
    course, to judge afterwards.
    """
    from accelerate import Accelerator
    from diffusers import DDPMScheduler
    from diffusers.models.attention_processor import AttnProcessor
    from diffusers.training_utils import EMAModel
    from tqdm import tqdm

    from ..presets import preset_config

    settings = settings or TrainSettings()
    settings.check()
    if checkpoint_every <= 0:
        raise SdkitError(f"checkpoint_every must be positive, not {checkpoint_every}")
    check_output_folder(out, MODEL_FOLDER, "model folder")
    if keep_models_every is not None and (not checkpoint_dir or keep_models_every % checkpoint_every):
        raise SdkitError(
            f"keep_models_every ({keep_models_every}) keeps checkpoints' models: it needs a checkpoint "
            f"folder and must be a multiple of checkpoint_every ({checkpoint_every})"
        )
    kept_steps = range(keep_models_every, settings.steps + 1, keep_models_every) if keep_models_every else ()
    if checkpoint_dir:
        check_output(checkpoint_dir, "checkpoint folder", folder=True)
        for name in (IN_PROGRESS, *(kept_model(step) for step in kept_steps)):
            check_output_folder(Path(checkpoint_dir) / name, MODEL_FOLDER, "checkpoint's model folder")
    latent = settings.space == "latents"
    config = dict(unet_config or preset_config("minisd-latent" if latent else "minisd"))
    if latent:
        if vae is None or vae.config.sample_size != settings.image_size:
            raise SdkitError(
                f"latent training needs a VAE made for {settings.image_size}-pixel images"
                + ("" if vae is None else f" (this one reads {vae.config.sample_size})")
            )
        if not encoder.pads_with_states or encoder.max_length != settings.context_length:
            raise SdkitError(
                "latent training encodes captions as the stock pipeline will: use "
                "encoders.for_stock_pipeline(encoder, context_length)"
            )
        config.update(sample_size=settings.image_size // LATENT_DOWNSCALE, in_channels=4, out_channels=4)
    elif vae is not None:
        raise SdkitError("a VAE is for space 'latents'; a pixel mini SD denoises the images themselves")
    else:
        config["sample_size"] = settings.image_size
        config["in_channels"] = config.get("out_channels", 3) + (2 if settings.coordinates else 0)
    halvings = 2 ** (len(config.get("block_out_channels", ())) - 1) * (LATENT_DOWNSCALE if latent else 1)
    if settings.image_size % halvings:
        raise SdkitError(
            f"image_size {settings.image_size} does not halve {halvings.bit_length() - 1} times "
            f"through the U-Net's levels: use a multiple of {halvings}"
        )
    if config.get("cross_attention_dim") != encoder.width:
        raise SdkitError(
            f"the U-Net config reads {config.get('cross_attention_dim')}-wide states, the text encoder "
            f"gives {encoder.width}"
        )
    # Precision and compilation are set here, not through Accelerator(mixed_precision=...,
    # dynamo_backend=...): accelerate keeps those in a process-wide state that a second run in the
    # same process (a notebook, the ablation) could not change. The Accelerator comes first: a
    # PartialState made before it would fix that state as one process, whatever the launcher said.
    accelerator = Accelerator()
    device = accelerator.device
    settings = replace(settings, precision=resolve_precision(settings.precision, device))
    if settings.batch_size % accelerator.num_processes:
        raise SdkitError(f"batch size {settings.batch_size} does not split over {accelerator.num_processes} processes")
    check_training_fits(config, settings.batch_size // accelerator.num_processes, device)
    captions = encode_captions(
        encoder, ["", *all_captions()], cache_dir, progress=progress and accelerator.is_main_process
    )
    if int(captions.lengths.max()) > settings.context_length or settings.context_length > encoder.max_length:
        raise SdkitError(
            f"context length {settings.context_length} must hold the longest caption "
            f"({int(captions.lengths.max())} tokens) and fit the encoder ({encoder.max_length})"
        )
    captions.max_length = settings.context_length
    noise_scheduler = DDPMScheduler.from_config(scheduler_config(settings))
    unet = recipe_unet(config, settings)
    if device.type == "cpu":
        # On the CPU, attention as bmm + softmax trains 1.6x faster in bfloat16 than the fused
        # scaled_dot_product_attention, whose bfloat16 backward is slow there. In float32 the two
        # train alike (2 cores without AMX, medians of 3 runs: eager 33.1 and 32.0 samples/s,
        # compiled 32.9 and 33.0), so the CPU takes bmm in both: one attention path, the one whose
        # compiled gradients a test holds to eager's and the one CrossAttentionMaps reads.
        unet.set_attn_processor(AttnProcessor())
    if settings.precision == "bf16-fp32-ends":
        ends_in_float32(unet)
    attention_weights = {
        name: weight
        for name, weight in (("grounding", settings.grounding_weight), ("relation", settings.relation_weight))
        if weight
    }
    maps = CrossAttentionMaps(unet) if attention_weights else None
    tokens = object_tokens(encoder, captions.captions, settings.context_length) if maps else None
    signs = relation_signs(captions.captions) if maps else None
    # Flattened after the model is prepared: its move to the device, and DDP's first broadcast,
    # give each parameter a storage of its own.
    model = accelerator.prepare(unet)
    weights = flat_parameters(unet)
    ema = EMAModel(
        [weights], decay=settings.ema_max_decay, use_ema_warmup=True, inv_gamma=1.0, power=settings.ema_power
    )
    optimizer = torch.optim.AdamW(
        [weights], lr=settings.lr, weight_decay=settings.weight_decay, fused=device.type in ("cpu", "cuda")
    )
    if vae is not None:
        vae = vae.to(device).eval().requires_grad_(False)
    fingerprint = run_fingerprint(settings, config, encoder, vae)
    checkpoint = Path(checkpoint_dir) / CHECKPOINT if checkpoint_dir else None
    start, history, earlier = 0, [], 0.0
    if checkpoint and checkpoint.is_file():
        start, history, earlier = load_checkpoint(checkpoint, unet, ema, optimizer, fingerprint)
    optimizer = accelerator.prepare(optimizer)
    if settings.compile:
        compile_unet(unet, settings.precision)
    ema.to(accelerator.device)
    autocast = training_autocast(settings.precision, device)
    # what every saved model's record says of the run (each adds its step, times and history)
    trained_on = {"settings": asdict(settings), "processes": accelerator.num_processes, "device": str(device)}
    if vae_record is not None:
        trained_on["vae"] = vae_record

    # Each step's losses stay on the device until they are read, every 25 steps (and before a
    # checkpoint): reading one (.item()) waits for the device, and on a GPU a wait per step would keep
    # the CPU from drawing the next batch while the GPU runs this one.
    # what a diverged run should change: the attention losses' weights when they dwarf the denoising loss's 1
    heavy = [f"--{name}-weight" for name, weight in attention_weights.items() if weight > 100]
    remedy = f"lower {' and '.join(heavy)}" if heavy else "try a lower lr"
    began = time.perf_counter()
    # built after the clock starts: the pool's encode is part of the run's time (and read from the
    # cache when a stopped run resumes)
    pool = (
        encode_pool(vae, settings, cache_dir, progress=progress and accelerator.is_main_process)
        if settings.latent_pool
        else None
    )
    if pool is not None:
        trained_on["latent_pool_seconds"] = round(time.perf_counter() - began, 1)
    window_began = time.perf_counter()
    unread, window = [], []  # per step: [loss, total, *attention losses]; tensors, then floats
    with (
        freed_memory_kept(),
        tqdm(
            total=settings.steps,
            initial=start,
            desc="training mini SD",
            unit="step",
            disable=not progress or not accelerator.is_main_process,
        ) as bar,
    ):
        for step in range(start, settings.steps):
            batch = batch_at(step, settings, captions, accelerator.process_index, accelerator.num_processes)
            pixels, states, noise, timesteps = (t.to(accelerator.device) for t in batch[:4])
            noised_from = batch.noised_from.to(device)
            if latent:  # "pixels" from here on are the latents the U-Net denoises
                draw = (  # None: the posterior's mean (TrainSettings.posterior)
                    torch.Generator().manual_seed(hash_seed(settings.seed, step, "latents"))
                    if settings.posterior == "sample"
                    else None
                )
                # Under bf16 the frozen VAE encodes in bfloat16 too, as diffusers' text-to-image
                # script casts its VAE to the weight dtype: on the CPU it halves the encoder's third
                # of a step, and moves the scaled latents by 0.004 RMS (colours stand 0.4 apart).
                # A pair swapped in is not in the pool: with swap_fraction, the images the noise is added
                # to are encoded at their step, pool or not.
                with autocast:
                    pixels = pool.draw(batch.images, draw).to(device) if pool else scaled_latents(vae, pixels, draw)
                    noised_from = pixels if not settings.swap_fraction else scaled_latents(vae, noised_from, draw)
            if settings.swap_fraction:
                noisy, noise = noised_from_swapped(pixels, noised_from, noise, timesteps, noise_scheduler)
            else:
                noisy = noise_scheduler.add_noise(pixels, noise, timesteps)
            noisy = add_coordinates(noisy) if settings.coordinates else noisy
            with autocast:
                prediction = model(noisy, timesteps, encoder_hidden_states=states).sample
            loss = weighted_loss(prediction, pixels, noise, timesteps, noise_scheduler, settings)
            total = loss
            if maps:
                rows = [captions.row[text] for text in batch.captions]
                noisy_enough = (batch.timesteps >= settings.attention_loss_from).float()
                words = (tokens[rows] * noisy_enough[:, None, None]).to(device)
                values = {}
                if "grounding" in attention_weights:
                    values["grounding"] = grounding_loss(maps, words, batch.masks.to(device))
                if "relation" in attention_weights:
                    values["relation"] = relation_loss(maps, words, (signs[rows] * noisy_enough).to(device))
                for name, value in values.items():
                    total = total + attention_weights[name] * value
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, settings)
            optimizer.zero_grad(set_to_none=False)  # in place: the parameters' gradients are views into it
            accelerator.backward(total)
            accelerator.clip_grad_norm_([weights], settings.max_grad_norm)
            optimizer.step()
            ema.step([weights])
            unread.append(torch.stack([loss, total, *(values[name] for name in attention_weights)]).detach())
            done = step + 1
            log = done % 25 == 0 or done == settings.steps
            keep = checkpoint is not None and (done % checkpoint_every == 0 or done == settings.steps)
            stop = stop_after is not None and stop_after <= done < settings.steps
            if log or keep or stop:  # the same steps in every process
                for offset, row in enumerate(torch.stack(unread).tolist(), start=done - len(unread) + 1):
                    if not math.isfinite(row[1]):
                        raise SdkitError(f"training diverged at step {offset}: the loss is {row[1]} ({remedy})")
                    window.append(row)
                unread = []
            if log:
                # seconds: the run's training so far, the processes it was resumed from counted (up to
                # their last checkpoint: the steps a stopped process did after it were done again)
                # loss: the denoising loss alone; grounding and relation, when on: each its own, unweighted
                sums = [sum(row[i] for row in window) for i in range(len(window[0]))]
                now = time.perf_counter()
                history.append(
                    {
                        "step": done,
                        "loss": sums[0] / len(window),
                        **{name: sums[2 + i] / len(window) for i, name in enumerate(attention_weights)},
                        "seconds": round(earlier + now - began, 3),
                    }
                )
                bar.set_postfix(
                    loss=f"{window[-1][0]:.4f}",
                    samples_s=f"{len(window) * settings.batch_size / (now - window_began):.1f}",
                )
                window, window_began = [], now
            bar.update(1)
            if keep and accelerator.is_main_process:
                so_far = earlier + time.perf_counter() - began
                save_checkpoint(checkpoint, unet, ema, optimizer, done, history, fingerprint, so_far)
                # the run so far as a model folder, for `sdkit minisd eval` or `sample` while it goes on
                record = {**trained_on, "checkpoint_step": done, "total_seconds": round(so_far, 1), "history": history}
                for name in (IN_PROGRESS, kept_model(done)) if done in kept_steps else (IN_PROGRESS,):
                    save_ema_model(checkpoint.parent / name, ema, config, settings, encoder, record, vae)
            if stop:
                raise Interrupted(f"stopped after step {done}")
    seconds = time.perf_counter() - began
    result = TrainResult(
        str(out),
        asdict(settings),
        settings.steps,
        start,
        seconds,
        (settings.steps - start) * settings.batch_size / max(seconds, 1e-9),
        history,
        earlier + seconds,
    )
    if accelerator.is_main_process:
        save_ema_model(
            out,
            ema,
            config,
            settings,
            encoder,
            {
                **trained_on,
                "resumed_from_step": start,
                "seconds": round(seconds, 1),
                "total_seconds": round(result.total_seconds, 1),
                "samples_per_second": round(result.samples_per_second, 2),
                "history": history,
            },
            vae,
        )
    return result


def save_ema_model(
    out: str | os.PathLike, ema, config: dict, settings: TrainSettings, encoder: TextEncoder, training: dict, vae=None
) -> None:
    """The EMA weights as a mini SD folder, with `training` as its record of how they were made."""
    from ..presets import build_unet

    # Shapes only, then every weight from the EMA: no initialisation to throw away, and no draw from
    # the global generator in the middle of a run. A diffusers U-Net has parameters and no buffers.
    unet = build_unet(config).to_empty(device="cpu")
    torch.nn.utils.vector_to_parameters(ema.shadow_params[0].detach().cpu(), unet.parameters())
    spec = MiniSDSpec(
        text_encoder=Path(encoder.source).name,
        layer=encoder.layer,
        max_length=settings.context_length,
        conditioning=settings.conditioning,
        image_size=settings.image_size,
        coordinates=settings.coordinates,
        place_embeddings=settings.place_embeddings,
        space=settings.space,
        training=training,
    )
    if vae is not None:
        vae = vae.to("cpu")
    MiniSDPipeline(unet, scheduler_config(settings), spec, encoder if vae is not None else None, vae).save_pretrained(
        out
    )
    if vae is not None:
        vae.to(ema.shadow_params[0].device)


def save_checkpoint(
    path: Path, unet, ema, optimizer, step: int, history: list[dict], fingerprint: str, seconds: float
) -> None:
    from safetensors.torch import save_file

    names, sizes = zip(*((n, p.numel()) for n, p in unet.named_parameters()))
    tensors = {f"model.{k}": v.detach().cpu().contiguous() for k, v in unet.state_dict().items()}
    # The EMA keeps one flat tensor (see flat_parameters); the file has it per parameter, by name.
    tensors.update({f"ema.{n}": part.cpu() for n, part in zip(names, ema.shadow_params[0].detach().split(sizes))})
    tensors.update(optimizer_tensors(optimizer))
    metadata = {
        "step": str(step),
        "ema_step": str(ema.optimization_step),
        "fingerprint": fingerprint,
        "history": json.dumps(history),
        "param_groups": json.dumps(optimizer.state_dict()["param_groups"]),
        "seconds": repr(seconds),
    }
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)


def optimizer_tensors(optimizer) -> dict[str, torch.Tensor]:
    """The optimizer's per-parameter state as named tensors for a safetensors checkpoint (its
    param_groups go into the file's metadata)."""
    return {
        f"optimizer.{index}.{name}": torch.as_tensor(value).detach().cpu().contiguous()
        for index, state in optimizer.state_dict()["state"].items()
        for name, value in state.items()
    }


def load_optimizer(optimizer, tensors: dict, metadata: dict) -> None:
    """Restore what optimizer_tensors and the metadata's param_groups saved."""
    state: dict = {}
    for k, v in tensors.items():
        if k.startswith("optimizer."):
            _, index, name = k.split(".", 2)
            state.setdefault(int(index), {})[name] = v
    optimizer.load_state_dict({"state": state, "param_groups": json.loads(metadata["param_groups"])})


def read_checkpoint(path: Path, fingerprint: str, other_run: str) -> tuple[dict, dict]:
    """(tensors, metadata) of a resume checkpoint, refused with one line when it cannot be read or
    its fingerprint is not this run's (other_run says what another run's would differ in)."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file

    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
        tensors = load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise SdkitError(f"{path}: cannot resume from this checkpoint ({e}); delete it to start over") from None
    if metadata.get("fingerprint") != fingerprint:
        raise SdkitError(
            f"{path}: this checkpoint belongs to {other_run}; delete it or choose another checkpoint folder"
        )
    return tensors, metadata


def load_checkpoint(path: Path, unet, ema, optimizer, fingerprint: str) -> tuple[int, list[dict], float]:
    """(step, history, seconds of training so far) of the checkpoint, its state loaded into the rest."""
    other = "another run (other settings, model or text encoder, or an older sdkit's checkpoint format)"
    tensors, metadata = read_checkpoint(path, fingerprint, other)
    unet.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")})
    names = [n for n, _ in unet.named_parameters()]
    ema.shadow_params = [torch.cat([tensors[f"ema.{n}"].reshape(-1) for n in names])]
    ema.optimization_step = int(metadata["ema_step"])
    load_optimizer(optimizer, tensors, metadata)
    history = json.loads(metadata["history"])
    # checkpoints written before they kept their seconds: their process's time at its last record
    seconds = float(metadata.get("seconds", history[-1]["seconds"] if history else 0.0))
    return int(metadata["step"]), history, seconds
