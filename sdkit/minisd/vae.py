"""The latent mini SD's VAE: diffusers' AutoencoderKL shaped like SD's, scaled down, trained here.

SD 1.x's VAE takes 512 x 512 pixels to a 64 x 64 x 4 latent grid: 8x down in three halvings, four
latent channels, and its U-Net denoises that grid. This one keeps the halvings and the channels,
with an eighth of SD's widths and one ResNet per level instead of two, and reads the generator's
images at 128 px: a 16 x 16 x 4 grid in which an object (0.28 of the side) is about 4.5 cells
wide, as a cat in a 512-pixel photo is several of SD's cells wide. At 64 px an object would be
2 cells and the 3x3 grid's cells under 3 each, too coarse to place them; at 256 px every training
step would cost 4x for nothing the judge can see.

Losses, as SD's were trained (Rombach et al. 2022, appendix G) as far as they fit here: an L1
reconstruction and a KL term weighted 1e-6, both summed per image. No perceptual or adversarial
term: they sharpen textures a photo has and these images do not; the judge on round trips decides
whether the VAE is good enough (`judge_round_trips`), and it passes without them.

    result = train_vae("weights/minisd-latent/vae")
    vae = AutoencoderKL.from_pretrained("weights/minisd-latent/vae")

The scaling factor is measured as SD's was: one over the standard deviation of latents drawn from
the encoder's posterior on training images (SD 1.x's 0.18215), so that scaled latents have unit
variance and the U-Net's noise schedule means what it means for SD.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..common import SdkitError, atomic_path
from .data import sample_at, to_model

LATENT_SIZE = 128  # pixels the VAE reads: 16 x 16 latent cells
VAE_CONFIG = {
    "in_channels": 3,
    "out_channels": 3,
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "block_out_channels": [16, 32, 64, 64],  # SD's 128, 256, 512, 512 over 8
    "layers_per_block": 1,
    "act_fn": "silu",
    "latent_channels": 4,
    "norm_num_groups": 16,
    "sample_size": LATENT_SIZE,
    "scaling_factor": 1.0,  # measured after training (measure_scaling_factor)
}
CHECKPOINT = "vae-checkpoint.safetensors"


@dataclass
class VAESettings:
    steps: int = 1500
    batch_size: int = 16
    lr: float = 1e-3  # peak, after a linear warm-up, then cosine to zero
    warmup_steps: int = 100
    kl_weight: float = 1e-6  # SD's
    pair_fraction: float = 0.5
    image_size: int = LATENT_SIZE
    seed: int = 0
    # Train the decoder alone, the encoder (and so the latent space, and any U-Net trained on it)
    # kept: how SD's VAE was improved after its U-Net was trained (sd-vae-ft-mse fine-tuned the
    # decoder only). Needs a trained VAE to start from.
    decoder_only: bool = False

    def check(self) -> None:
        for name in ("steps", "batch_size", "image_size"):
            if getattr(self, name) <= 0:
                raise SdkitError(f"{name} must be positive, not {getattr(self, name)}")
        if not 0 < self.lr <= 1 or not math.isfinite(self.lr):
            raise SdkitError(f"lr must be in (0, 1], not {self.lr}")
        if not 0 <= self.kl_weight < math.inf or not 0 <= self.pair_fraction <= 1:
            raise SdkitError("kl_weight must be a finite number >= 0 and pair_fraction a fraction")
        if self.image_size % 8:
            raise SdkitError(f"image_size must be a multiple of 8 (three halvings), not {self.image_size}")


@dataclass
class VAEResult:
    out: str
    settings: dict
    seconds: float
    scaling_factor: float
    history: list[dict] = field(default_factory=list)


def build_vae(config: dict | None = None, seed: int = 0):
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    return AutoencoderKL(**(config or VAE_CONFIG))


def images_at(seed: int, first: int, count: int, side: int, pair_fraction: float = 0.5) -> torch.Tensor:
    """(count, 3, side, side) in [-1, 1]: the generator's samples first..first+count of stream `seed`."""
    return torch.from_numpy(
        np.stack([to_model(sample_at(seed, i, side, pair_fraction).image) for i in range(first, first + count)])
    )


def vae_loss(vae, pixels: torch.Tensor, kl_weight: float, generator: torch.Generator) -> tuple[torch.Tensor, float]:
    """(loss, mean absolute error per pixel value): L1 summed per image plus kl_weight x KL, as SD's."""
    posterior = vae.encode(pixels).latent_dist
    latents = posterior.mean + posterior.std * torch.randn(posterior.mean.shape, generator=generator)
    decoded = vae.decode(latents).sample
    l1 = (decoded - pixels).abs()
    loss = l1.sum(dim=(1, 2, 3)).mean() + kl_weight * posterior.kl().mean()
    return loss, float(l1.detach().mean())


def learning_rate(step: int, settings: VAESettings) -> float:
    if step < settings.warmup_steps:
        return settings.lr * (step + 1) / settings.warmup_steps
    progress = (step - settings.warmup_steps) / max(1, settings.steps - settings.warmup_steps)
    return settings.lr * 0.5 * (1 + math.cos(math.pi * progress))


@torch.no_grad()
def measure_scaling_factor(vae, count: int = 512, seed: int = 10_000, batch_size: int = 64) -> float:
    """One over the standard deviation of posterior samples on `count` training images (SD's rule)."""
    generator = torch.Generator().manual_seed(seed)
    drawn = []
    for first in range(0, count, batch_size):
        pixels = images_at(seed, first, min(batch_size, count - first), vae.config.sample_size)
        posterior = vae.encode(pixels).latent_dist
        drawn.append(posterior.mean + posterior.std * torch.randn(posterior.mean.shape, generator=generator))
    return 1.0 / float(torch.cat(drawn).std())


def _fingerprint(settings: VAESettings, vae) -> str:
    """The settings and the starting weights: a checkpoint of another run is refused, not resumed."""
    import hashlib

    from .train import vae_fingerprint

    return hashlib.sha256(json.dumps([asdict(settings), vae_fingerprint(vae)], sort_keys=True).encode()).hexdigest()


def _save_checkpoint(path: Path, vae, optimizer, step: int, history: list, seconds: float, fingerprint: str) -> None:
    from safetensors.torch import save_file

    from .train import optimizer_tensors

    tensors = {f"model.{k}": v.detach().contiguous() for k, v in vae.state_dict().items()}
    tensors.update(optimizer_tensors(optimizer))
    metadata = {
        "step": str(step),
        "history": json.dumps(history),
        "seconds": repr(seconds),
        "param_groups": json.dumps(optimizer.state_dict()["param_groups"]),
        "fingerprint": fingerprint,
    }
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)


def _load_checkpoint(path: Path, vae, optimizer, fingerprint: str) -> tuple[int, list, float]:
    from .train import load_optimizer, read_checkpoint

    other = "another VAE run (other settings or starting weights)"
    tensors, metadata = read_checkpoint(path, fingerprint, other)
    vae.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")})
    load_optimizer(optimizer, tensors, metadata)
    return int(metadata["step"]), json.loads(metadata["history"]), float(metadata["seconds"])


def train_vae(
    out: str | os.PathLike,
    settings: VAESettings | None = None,
    checkpoint_dir: str | os.PathLike | None = None,
    checkpoint_every: int = 250,
    progress: bool = True,
    config: dict | None = None,
    start_from: str | os.PathLike | None = None,
) -> VAEResult:
    """Train the VAE (VAE_CONFIG unless `config`, or the VAE in `start_from`) on the generator's
    images and save it, with its measured scaling factor, to `out`: a diffusers AutoencoderKL
    folder. With `checkpoint_dir`, a stopped run resumes there."""
    from tqdm import tqdm

    settings = settings or VAESettings()
    settings.check()
    if settings.decoder_only and start_from is None:
        raise SdkitError("decoder_only fine-tunes a trained VAE's decoder: give the VAE to start from")
    earlier_record = None
    if start_from is not None:
        from .pipeline import load_vae

        vae = load_vae(start_from).train()
        record = Path(start_from) / "training.json"
        if record.is_file():  # the VAE's whole making in one record: its own, then each fine-tuning
            earlier_record = {k: v for k, v in json.loads(record.read_text()).items() if k != "history"}
        if vae.config.sample_size != settings.image_size:
            raise SdkitError(f"{start_from}: reads {vae.config.sample_size}-pixel images, not {settings.image_size}")
    else:
        vae = build_vae({**(config or VAE_CONFIG), "sample_size": settings.image_size}, settings.seed).train()
    if settings.decoder_only:
        vae.encoder.requires_grad_(False)
        if vae.quant_conv is not None:
            vae.quant_conv.requires_grad_(False)
    trained = [p for p in vae.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=settings.lr, weight_decay=0.0)
    checkpoint = Path(checkpoint_dir) / CHECKPOINT if checkpoint_dir else None
    start, history, earlier = 0, [], 0.0
    fingerprint = _fingerprint(settings, vae)
    if checkpoint and checkpoint.is_file():
        start, history, earlier = _load_checkpoint(checkpoint, vae, optimizer, fingerprint)
    began = time.perf_counter()
    window = []
    with tqdm(total=settings.steps, initial=start, desc="training VAE", unit="step", disable=not progress) as bar:
        for step in range(start, settings.steps):
            pixels = images_at(
                settings.seed,
                step * settings.batch_size,
                settings.batch_size,
                settings.image_size,
                settings.pair_fraction,
            )
            generator = torch.Generator().manual_seed(settings.seed * 1_000_003 + step)
            loss, l1 = vae_loss(vae, pixels, settings.kl_weight, generator)
            if not math.isfinite(float(loss.detach())):
                raise SdkitError(
                    f"VAE training diverged at step {step + 1}: the loss is {float(loss)} (try a lower lr)"
                )
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, settings)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trained, 1.0)
            optimizer.step()
            window.append(l1)
            done = step + 1
            if done % 25 == 0 or done == settings.steps:
                history.append(
                    {
                        "step": done,
                        "l1": sum(window) / len(window),
                        "seconds": round(earlier + time.perf_counter() - began, 1),
                    }
                )
                bar.set_postfix(l1=f"{history[-1]['l1']:.4f}")
                window = []
            if checkpoint and (done % checkpoint_every == 0) and done < settings.steps:
                _save_checkpoint(
                    checkpoint, vae, optimizer, done, history, earlier + time.perf_counter() - began, fingerprint
                )
            bar.update(1)
    seconds = earlier + time.perf_counter() - began
    vae.eval()
    # the encoder kept, its latents' scale is the one a U-Net was trained on: kept to the bit
    scaling = vae.config.scaling_factor if settings.decoder_only else measure_scaling_factor(vae)
    vae.register_to_config(scaling_factor=scaling)
    out = Path(out)
    if out.exists():
        raise SdkitError(f"{out}: already exists; the VAE is written to a new folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    vae.save_pretrained(tmp)
    (tmp / "training.json").write_text(
        json.dumps(
            {
                "settings": asdict(settings),
                "started_from": None if start_from is None else str(start_from),
                "started_from_record": earlier_record,
                "seconds": round(seconds, 1),
                "history": history,
            },
            indent=1,
        )
    )
    os.replace(tmp, out)
    return VAEResult(str(out), asdict(settings), seconds, scaling, history)


@torch.no_grad()
def round_trip(vae, pixels: torch.Tensor, sample_posterior: bool = False) -> torch.Tensor:
    """Encode and decode (the posterior's mean, as a pipeline's latents come from the U-Net, not the
    encoder); pixels in [-1, 1] in and out, clamped."""
    posterior = vae.encode(pixels).latent_dist
    latents = posterior.sample() if sample_posterior else posterior.mode()
    return vae.decode(latents).sample.clamp(-1, 1)


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    """Peak signal-to-noise ratio in dB of images in [-1, 1] (peak-to-peak 2)."""
    mse = float(((a - b) ** 2).mean())
    return math.inf if mse == 0 else 10 * math.log10(4 / mse)


def _judged(pixels: torch.Tensor, scenes) -> dict:
    from .data import from_model
    from .judge import accuracy, judge

    return accuracy([judge(from_model(p), s) for p, s in zip(pixels, scenes)])


@torch.no_grad()
def judge_round_trips(vae, count: int = 64, batch_size: int = 32) -> dict:
    """The judge on VAE round trips of the evaluation sets' scenes (rendered with the generator's
    jitter): per set, the judged accuracy of the originals and of the round trips, and PSNR."""
    import random

    from .data import render
    from .evaluate import prompt_set

    side = vae.config.sample_size
    out = {}
    for name in ("singles", "pairs"):
        scenes = prompt_set(name, count)
        originals = torch.from_numpy(
            np.stack([to_model(render(s, side, random.Random(f"vae:{i}")).image) for i, s in enumerate(scenes)])
        )
        trips = torch.cat([round_trip(vae, originals[i : i + batch_size]) for i in range(0, count, batch_size)])

        out[name] = {
            "originals": _judged(originals, scenes),
            "round_trips": _judged(trips, scenes),
            "psnr_db": psnr(trips, originals),
        }
    return out


@torch.no_grad()
def latent_separation(vae) -> dict:
    """How far apart the VAE's latents, scaled as the U-Net reads them, put what the judge tells
    apart: for each pair of colours, the RMS distance between the latents of a centred circle on the
    cells it covers most (wholly, at 128 px); for each pair of shapes (one colour), on the cells
    either covers at all.

    The U-Net's loss weighs a colour by this distance. SD's KL weight (1e-6) leaves the latent space
    free to put the generator's blue, cyan and green 0.2-0.5 apart while an object's latents sit ~2.5
    from zero (the latents' spread is 1 by the scaling factor): a precision the U-Net's MSE hardly
    rewards, and the blue drawn as cyan of docs/latent.md."""
    from .data import COLOURS, SHAPES, render, single_scene
    from .pipeline import scaled_latents, vae_downscale

    side = vae.config.sample_size
    cell = vae_downscale(vae)
    cells = side // cell

    def encoded(colour: str, shape: str) -> tuple[torch.Tensor, torch.Tensor]:
        sample = render(single_scene(colour, shape, "center"), side)
        latents = scaled_latents(vae, torch.from_numpy(to_model(sample.image))[None])[0]
        coverage = (
            torch.from_numpy(sample.masks[0].astype(np.float32)).reshape(cells, cell, cells, cell).mean(dim=(1, 3))
        )
        return latents, coverage

    def distances(codes: dict, where) -> dict:
        names = list(codes)
        return {
            f"{a}-{b}": float(((codes[a][0] - codes[b][0])[:, where(codes[a][1], codes[b][1])] ** 2).mean().sqrt())
            for i, a in enumerate(names)
            for b in names[i + 1 :]
        }

    colour_codes = {colour: encoded(colour, SHAPES[0]) for colour in COLOURS}
    shape_codes = {shape: encoded(next(iter(COLOURS)), shape) for shape in SHAPES}
    return {
        "colours": distances(colour_codes, lambda a, b: a == a.max()),
        "shapes": distances(shape_codes, lambda a, b: (a > 0) | (b > 0)),
    }


def format_round_trips(result: dict) -> str:
    """The judged round trips as a table (one row per set: originals, round trips, PSNR)."""
    from ..common import format_table

    rows = [
        [
            name,
            f"{100 * judged['originals']['all']:.1f} %",
            f"{100 * judged['round_trips']['all']:.1f} %",
            f"{judged['psnr_db']:.1f} dB",
        ]
        for name, judged in result["round_trips"].items()
    ]
    lines = [
        format_table(["set", "originals judged all", "round trips judged all", "PSNR"], rows, f"VAE {result['vae']}")
    ]
    if "latent_separation" in result:
        nearest = {
            kind: min(apart.items(), key=lambda item: item[1]) for kind, apart in result["latent_separation"].items()
        }
        lines.append(
            "nearest in the scaled latents (RMS; the latents' spread is 1): colours "
            f"{nearest['colours'][0]} {nearest['colours'][1]:.2f}, shapes {nearest['shapes'][0]} {nearest['shapes'][1]:.2f}"
        )
    if "seconds" in result:
        lines.append(
            f"trained {result['settings']['steps']} steps in {result['seconds']:.0f} s; "
            f"scaling factor {result['scaling_factor']:.5f}"
        )
    if "installed_into" in result:
        lines.append(f"put it into {result['installed_into']}")
    return "\n".join(lines)


def total_training_seconds(record: dict | None) -> float | None:
    """A VAE's training time, its fine-tunings' and the runs they started from added up."""
    if not record:
        return None
    return record.get("seconds", 0.0) + (total_training_seconds(record.get("started_from_record")) or 0.0)


def install_vae(model: str | os.PathLike, vae_folder: str | os.PathLike, record: dict | None = None) -> None:
    """Put the VAE in `vae_folder` into the latent mini SD `model` in place of its own, as SD's users
    swap in a fine-tuned decoder: refused unless its encoder (and scaling factor) is the model's, to
    the bit, so that the latents the U-Net was trained on are unchanged. `record` (how the VAE was
    trained) goes into the model's minisd.json."""
    from .pipeline import MiniSDPipeline, load_vae

    pipe = MiniSDPipeline.from_pretrained(model)
    if pipe.spec.space != "latents":
        raise SdkitError(f"{model}: a pixel mini SD has no VAE")
    new = load_vae(vae_folder)
    old_state, new_state = pipe.vae.state_dict(), new.state_dict()
    kept = [k for k in old_state if k.startswith(("encoder.", "quant_conv."))]
    if (
        set(old_state) != set(new_state)
        or any(not torch.equal(old_state[k], new_state[k]) for k in kept)
        or new.config.scaling_factor != pipe.vae.config.scaling_factor
    ):
        raise SdkitError(
            f"{vae_folder}: its encoder is not {model}'s (the latents its U-Net was trained on); only a "
            "decoder fine-tuned from the model's own VAE (--decoder-only) can replace it"
        )
    pipe.vae = new.eval()
    if record is not None:
        pipe.spec.training["vae"] = record
    pipe.save_pretrained(model)
