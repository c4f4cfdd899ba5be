"""The mini Stable Diffusion: an SD-1.x-shaped U-Net that denoises 32x32 RGB pixels (no VAE),
conditioned on the token states of a frozen, pretrained text encoder (all-MiniLM-L6-v2).

A model folder holds what diffusers would write, plus one small JSON:

    unet/        config.json + diffusion_pytorch_model.safetensors (the EMA weights)
    scheduler/   scheduler_config.json (DDPM, SD 1.x's scaled_linear betas)
    minisd.json  the text encoder and layer it reads, how it conditions, how it was trained
    sdkit.json   the folder's record: a mini SD model that sdkit wrote, and the files it wrote

    pipe = MiniSDPipeline.from_pretrained("weights/minisd")
    images = pipe(["a red circle at the top left"], seeds=[0]).images    # (1, 32, 32, 3) in [0, 1]
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..common import MODEL_FOLDER, SdkitError, atomic_folder, available_memory, first_line, format_bytes, write_json
from ..encoders import TextEncoder
from . import SAMPLING_GUIDANCE
from .data import from_model

SPEC_FILE = "minisd.json"
CONDITIONINGS = ("tokens", "pooled")
MAX_IMAGE_SIZE = 512  # far past the 32 and 64 pixels trained here; the data are drawn at this side
MAX_TRAIN_TIMESTEPS = 10_000  # SD's 1,000 ten times over; the scheduler allocates tables of this length
PREDICTION_TYPES = ("epsilon", "v_prediction")  # what the sampler turns into a clean image
# "pixels": the U-Net denoises RGB in [-1, 1] (no VAE); "latents": a VAE's grid, 8x smaller a side
# with 4 channels, as SD's (the folder is then a stock diffusers StableDiffusionPipeline folder too).
SPACES = ("pixels", "latents")
LATENT_DOWNSCALE = 8
DEFAULT_ENCODERS_DIR = "weights/encoders"
# SD 1.x's training schedule (and, as SD, no clipping of the predicted image: with guidance, DDIM's
# clipped x0 turns the guided noise estimate into noise). "trailing" spacing starts sampling at the
# last trained timestep, where the noise is.
SCHEDULER_CONFIG = {
    "num_train_timesteps": 1000,
    "beta_schedule": "scaled_linear",
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "prediction_type": "epsilon",
    "clip_sample": False,
    "timestep_spacing": "trailing",
}


@dataclass
class MiniSDSpec:
    """What a mini SD folder needs besides its U-Net: the text side, and a record of training."""

    text_encoder: str = "all-MiniLM-L6-v2"  # a folder name under the encoders folder
    layer: str = "last"
    max_length: int = 77  # token positions the U-Net reads (zeros past the caption, as encoded)
    conditioning: str = "tokens"  # "tokens": every token state; "pooled": their mean, one key/value
    image_size: int = 32
    space: str = "pixels"  # one of SPACES; image_size is the pixel side in either
    # Two coordinate channels (x and y in [-1, 1]) beside the pixels at the U-Net's input: a
    # positional signal SD 1.x does not have (a departure, for the ablation).
    coordinates: bool = False
    # Sinusoidal place embeddings before each transformer block's attentions (see add_place_embeddings):
    # queries that know where they are, which SD 1.x's have only from the convolutions' padding (a
    # departure, for the ablation).
    place_embeddings: bool = False
    training: dict = field(default_factory=dict)

    @property
    def guidance_scale(self) -> float:
        """The guidance this mini SD samples at when none is asked for (SAMPLING_GUIDANCE)."""
        return SAMPLING_GUIDANCE[self.space]

    @classmethod
    def read(cls, folder: str | os.PathLike) -> MiniSDSpec:
        path = Path(folder) / SPEC_FILE
        if not path.is_file():
            raise SdkitError(f"{folder}: not a mini SD folder (no {SPEC_FILE}; train one with `sdkit minisd train`)")
        try:
            spec = cls(**json.loads(path.read_text()))
        except (ValueError, TypeError) as e:
            raise SdkitError(f"{path}: not a valid {SPEC_FILE} ({e})") from None
        problem = spec.problem()
        if problem:
            raise SdkitError(f"{path}: {problem}")
        return spec

    def problem(self) -> str | None:
        """What makes this spec unusable, in a few words (None when nothing does)."""
        from ..encoders import LAYERS

        def whole(value, least: int) -> bool:
            return type(value) is int and value >= least

        if (
            not isinstance(self.text_encoder, str)
            or not self.text_encoder
            or Path(self.text_encoder).name != self.text_encoder
        ):
            return f"text_encoder must be a folder name, not {self.text_encoder!r}"
        if self.layer not in LAYERS:
            return f"layer must be one of {', '.join(LAYERS)}, not {self.layer!r}"
        if not whole(self.max_length, 1):
            return f"max_length must be a whole number of token positions (1 or more), not {self.max_length!r}"
        if self.conditioning not in CONDITIONINGS:
            return f"unknown conditioning {self.conditioning!r}; one of {', '.join(CONDITIONINGS)}"
        if not whole(self.image_size, 12) or self.image_size > MAX_IMAGE_SIZE:
            return f"image_size must be a whole number of pixels from 12 to {MAX_IMAGE_SIZE}, not {self.image_size!r}"
        if self.space not in SPACES:
            return f"space must be one of {', '.join(SPACES)}, not {self.space!r}"
        if self.space == "latents" and (self.image_size % LATENT_DOWNSCALE or self.coordinates):
            return (
                f"a latent mini SD's image_size is a multiple of {LATENT_DOWNSCALE}, and it has no coordinate "
                "channels (a stock StableDiffusionPipeline could not feed them)"
            )
        if not isinstance(self.training, dict):
            return "training must be an object"
        # the parts of the record that commands read back
        if not isinstance(self.training.get("settings", {}), dict):
            return "training.settings must be an object"
        if "checkpoint_step" in self.training and not whole(self.training["checkpoint_step"], 1):
            return f"training.checkpoint_step must be a whole number of steps, not {self.training['checkpoint_step']!r}"
        for name in ("coordinates", "place_embeddings"):
            if not isinstance(getattr(self, name), bool):
                return f"{name} must be true or false, not {getattr(self, name)!r}"
        return None

    def write(self, folder: str | os.PathLike) -> None:
        write_json(Path(folder) / SPEC_FILE, asdict(self))

    def check_unet(self, unet, source: str = "this mini SD") -> None:
        """Refuse a U-Net this spec cannot drive: the U-Net's image side and channels must be the
        spec's (pixels, and coordinate channels where it has them)."""
        config = unet.config
        if self.space == "latents":
            side = self.image_size // LATENT_DOWNSCALE
            if config.sample_size != side or config.in_channels != 4 or config.out_channels != 4:
                raise SdkitError(
                    f"{source}: a latent mini SD's U-Net reads and writes {side}x{side}x4 latents "
                    f"({SPEC_FILE}'s image_size {self.image_size} over {LATENT_DOWNSCALE}), not "
                    f"{config.sample_size!r} a side with {config.in_channels} in and {config.out_channels} out"
                )
            return
        if config.sample_size != self.image_size:
            raise SdkitError(
                f"{source}: unet/config.json sample_size {config.sample_size!r} is not {SPEC_FILE}'s "
                f"image_size {self.image_size}"
            )
        channels = 3 + (2 if self.coordinates else 0)
        if config.out_channels != 3 or config.in_channels != channels:
            raise SdkitError(
                f"{source}: the U-Net reads {config.in_channels} and writes {config.out_channels} channels; "
                f"{SPEC_FILE} needs {channels} in (RGB{' and 2 coordinates' if self.coordinates else ''}) "
                "and 3 out"
            )

    def checkpoint_note(self) -> str | None:
        """For the weights a run in progress saved (`--checkpoints DIR` writes them to DIR/model),
        "a checkpoint's model, step N of M"; None for a finished run's model."""
        step = self.training.get("checkpoint_step")
        if step is None:
            return None
        return f"a checkpoint's model, step {step} of {self.training.get('settings', {}).get('steps', '?')}"


def add_coordinates(sample: torch.Tensor) -> torch.Tensor:
    """(batch, C, H, W) -> (batch, C + 2, H, W): the pixels, then x and y, each from -1 to 1."""
    batch, _, height, width = sample.shape
    y = torch.linspace(-1, 1, height, dtype=sample.dtype, device=sample.device)[:, None].expand(height, width)
    x = torch.linspace(-1, 1, width, dtype=sample.dtype, device=sample.device)[None, :].expand(height, width)
    return torch.cat([sample, torch.stack([x, y]).expand(batch, 2, height, width)], dim=1)


def add_place_embeddings(unet, image_size: int) -> None:
    """Give each of the U-Net's transformer blocks diffusers' own sinusoidal positional embedding
    (BasicTransformerBlock's positional_embeddings="sinusoidal"): added to the normed cells before
    self- and cross-attention, by each cell's place in raster order, so a query knows where it is.

    The embedding is a function of the shapes alone: kept out of the state dict, so the weights file
    stays a stock UNet2DConditionModel's. Adding them twice changes nothing."""
    from diffusers.models.attention import BasicTransformerBlock
    from diffusers.models.embeddings import SinusoidalPositionalEmbedding

    for block in unet.modules():
        if isinstance(block, BasicTransformerBlock) and block.pos_embed is None:
            embedding = SinusoidalPositionalEmbedding(block.norm1.normalized_shape[0], max_seq_length=image_size**2)
            table = embedding.pe
            del embedding.pe
            embedding.register_buffer("pe", table, persistent=False)
            block.pos_embed = embedding.to(unet.device)


def pool_states(states: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """(batch, tokens, width) -> (batch, 1, width): the mean over real tokens, one key/value.

    The mean of the token states is how all-MiniLM-L6-v2 itself pools a sentence."""
    weights = real.to(states.dtype).unsqueeze(-1)
    return (states * weights).sum(1, keepdim=True) / weights.sum(1, keepdim=True).clamp_min(1)


def find_text_encoder(
    spec: MiniSDSpec,
    text_encoder: str | os.PathLike | None = None,
    encoders_dir: str | os.PathLike = DEFAULT_ENCODERS_DIR,
    allow_pickle: bool = False,
) -> TextEncoder:
    """The encoder a mini SD reads: `text_encoder` if given, else encoders_dir / spec.text_encoder."""
    from ..encoders import load_text_encoder

    if text_encoder:  # named by the user: load_text_encoder says what is wrong with it
        folder = Path(text_encoder)
    else:
        folder = Path(encoders_dir) / spec.text_encoder
        if not (folder / "config.json").is_file():
            raise SdkitError(
                f"{folder}: the mini SD reads {spec.text_encoder}, which is not there; "
                "python scripts/get_real_encoders.py puts it in weights/encoders"
            )
    encoder = load_text_encoder(folder, layer=spec.layer, context_length=spec.max_length, allow_pickle=allow_pickle)
    if encoder.max_length != spec.max_length:
        raise SdkitError(f"{folder}: reads at most {encoder.max_length} tokens, the model {spec.max_length}")
    return encoder


def load_vae(folder: str | os.PathLike):
    """The AutoencoderKL in `folder` (a VAE folder, or a pipeline folder's vae/), with a few words on
    what is wrong when it cannot be read."""
    from diffusers import AutoencoderKL

    path = Path(folder) / "vae" if (Path(folder) / "vae" / "config.json").is_file() else Path(folder)
    if not (path / "config.json").is_file():
        raise SdkitError(f"{folder}: no VAE here (no config.json here or in vae/)")
    try:
        vae = AutoencoderKL.from_pretrained(path, local_files_only=True)
    except Exception as e:  # diffusers raises many types for a bad folder: all mean that
        raise SdkitError(f"{path}: cannot load the VAE ({first_line(e)})") from None
    if vae.config.latent_channels != 4 or vae_downscale(vae) != LATENT_DOWNSCALE:
        raise SdkitError(f"{path}: the VAE must make 4 latent channels at 1/{LATENT_DOWNSCALE} of the side")
    return vae.eval()


def vae_downscale(vae) -> int:
    """Pixels per latent cell along a side: a halving per level after the first (as diffusers reads it)."""
    return 2 ** (len(vae.config.block_out_channels) - 1)


@torch.no_grad()
def posterior(vae, pixels: torch.Tensor):
    """The VAE encoder's posterior of pixels in [-1, 1] (diffusers' DiagonalGaussianDistribution),
    unscaled; encoded channels-last (see scaled_latents)."""
    return vae.encode(pixels.to(vae.dtype, memory_format=torch.channels_last)).latent_dist


def scaled_latents(vae, pixels: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Pixels in [-1, 1] -> the VAE's latents, scaled as the U-Net reads them: the posterior's
    mean, or with a generator a draw from the posterior (as SD's training draws them).

    The pixels go in channels-last: oneDNN's convolutions then skip a reorder to and from their own
    layout at each layer, and the shipped VAE encodes a training batch 1.3-1.5x faster on 2 CPU
    cores (scripts/bench_vae_encode.py; the encode is about a quarter of a float32 latent training
    step). The latents move by 2e-4 RMS, against a posterior deviation of 0.07 on the objects."""
    dist = posterior(vae, pixels)
    latents = dist.mean
    if generator is not None:
        latents = latents + dist.std * torch.randn(latents.shape, generator=generator).to(latents.device)
    return (latents * vae.config.scaling_factor).float()


def read_scheduler_config(folder: str | os.PathLike) -> dict:
    """The model's scheduler config, checked by building the scheduler it names."""
    from diffusers import DDPMScheduler

    path = Path(folder) / "scheduler" / "scheduler_config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SdkitError(f"{path}: cannot read the scheduler config ({e})") from None
    if not isinstance(config, dict):
        raise SdkitError(f"{path}: the scheduler config is not a JSON object")
    steps = config.get("num_train_timesteps", 1000)
    if type(steps) is not int or not 2 <= steps <= MAX_TRAIN_TIMESTEPS:
        raise SdkitError(
            f"{path}: num_train_timesteps must be a whole number from 2 to {MAX_TRAIN_TIMESTEPS:,}, not {steps!r}"
        )
    if config.get("prediction_type", "epsilon") not in PREDICTION_TYPES:
        raise SdkitError(
            f"{path}: prediction_type must be one of {', '.join(PREDICTION_TYPES)}, "
            f"not {config.get('prediction_type')!r}"
        )
    try:
        betas = DDPMScheduler.from_config(config).betas
    except Exception as e:  # diffusers raises NotImplementedError, ValueError, ...: all mean a bad config
        raise SdkitError(f"{path}: not a usable scheduler config ({first_line(e)})") from None
    # each step keeps part of the signal and adds some noise: 0 < beta < 1 (zero terminal SNR's last is 1)
    if not (torch.isfinite(betas).all() and (betas > 0).all() and (betas <= 1).all()):
        span = (
            f"run from {float(betas.min()):.4g} to {float(betas.max()):.4g}"
            if torch.isfinite(betas).all()
            else "are not all finite"
        )
        raise SdkitError(
            f"{path}: the noise schedule's betas must lie in (0, 1]; these {span} (check beta_start and beta_end)"
        )
    return config


# Bytes each pixel of an image takes while a batch of images is made and kept: its starting noise,
# the float32 image returned (both 3 channels of 4 bytes) and a uint8 copy for pictures.
KEPT_BYTES_PER_PIXEL = 3 * 4 + 3 * 4 + 3


def check_images_fit(count: int, side: int, what: str) -> None:
    """Refuse, before allocating, work that keeps more images in memory than is free."""
    need = count * side * side * KEPT_BYTES_PER_PIXEL
    free = available_memory()
    if need > free:
        raise SdkitError(
            f"{what} {count:,} images of {side}x{side} keeps at least {format_bytes(need)} in memory; "
            f"{format_bytes(free)} is free (ask for fewer images)"
        )


@dataclass
class MiniSDOutput:
    images: object  # output_type "np": (batch, H, W, 3) float32 in [0, 1]; "pt": (batch, 3, H, W); "pil": a list
    prompts: list[str]
    seeds: list[int] | None  # None when the noise came from generators
    steering: list = field(default_factory=list)  # with steering: [step, image, loss] per steered step


class MiniSDPipeline:
    """Text -> image for a mini SD, in diffusers' manner: classifier-free guidance, a diffusers
    scheduler (DDIM by default), one seed per image so any image can be made again alone."""

    def __init__(self, unet, scheduler_config: dict, spec: MiniSDSpec, encoder: TextEncoder | None = None, vae=None):
        spec.check_unet(unet)
        if (vae is not None) != (spec.space == "latents"):
            raise SdkitError(f"a mini SD in {spec.space} {'needs' if spec.space == 'latents' else 'has no'} VAE")
        self.unet, self.scheduler_config, self.spec, self.encoder = unet.eval(), dict(scheduler_config), spec, encoder
        self.vae = vae.eval() if vae is not None else None
        if spec.place_embeddings:
            add_place_embeddings(unet, spec.image_size)

    @classmethod
    def from_pretrained(
        cls,
        folder: str | os.PathLike,
        text_encoder: str | os.PathLike | None = None,
        encoders_dir: str | os.PathLike = DEFAULT_ENCODERS_DIR,
        allow_pickle: bool = False,
    ) -> MiniSDPipeline:
        from ..loading import load_unet

        spec = MiniSDSpec.read(folder)
        unet = load_unet(folder, allow_pickle=allow_pickle)
        spec.check_unet(unet, str(folder))
        vae = load_vae(folder) if spec.space == "latents" else None
        # a latent mini SD is a stock pipeline folder and carries its own text encoder
        own = spec.space == "latents" and not text_encoder
        encoder = find_text_encoder(spec, folder if own else text_encoder, encoders_dir, allow_pickle)
        if encoder.width != unet.config.cross_attention_dim:
            raise SdkitError(
                f"{folder}: the U-Net reads {unet.config.cross_attention_dim}-wide token states, "
                f"{encoder.source} gives {encoder.width}-wide ones"
            )
        return cls(unet, read_scheduler_config(folder), spec, encoder, vae)

    def save_pretrained(self, folder: str | os.PathLike) -> None:
        """A pixel mini SD: unet/, scheduler/ and minisd.json. A latent one: a stock diffusers
        StableDiffusionPipeline folder (model_index.json, unet/, vae/, text_encoder/, tokenizer/,
        scheduler/ with DDIM, no safety checker) with minisd.json beside.

        A latent one with place embeddings (the ablation's) is written without model_index.json:
        diffusers would load it and sample without the embeddings, silently another model."""
        from diffusers import DDIMScheduler, DDPMScheduler

        with atomic_folder(folder, MODEL_FOLDER) as tmp:  # a crash leaves the old model (or none), never half of one
            if self.spec.space == "latents":
                # steps_offset 1, or diffusers' pipeline rewrites it with a deprecation notice at
                # each load; under "trailing" spacing (every mini SD's) DDIM does not read it
                scheduler = DDIMScheduler.from_config({**self.scheduler_config, "steps_offset": 1})
                self._diffusers_pipeline(scheduler).save_pretrained(tmp)
                if self.spec.place_embeddings:
                    (tmp / "model_index.json").unlink()
            else:
                self.unet.save_pretrained(tmp / "unet")
                DDPMScheduler.from_config(self.scheduler_config).save_pretrained(tmp / "scheduler")
            self.spec.write(tmp)

    def stock_pipeline(self, scheduler=None):
        """This latent mini SD as diffusers' own StableDiffusionPipeline (the same modules, shared)."""
        if self.spec.place_embeddings:
            raise SdkitError(
                "this latent mini SD has place embeddings, which a stock StableDiffusionPipeline saves and "
                "loads without: sample it with MiniSDPipeline"
            )
        return self._diffusers_pipeline(scheduler)

    def _diffusers_pipeline(self, scheduler=None):
        from diffusers import DDIMScheduler, StableDiffusionPipeline

        if self.spec.space != "latents" or self.encoder is None:
            raise SdkitError("only a latent mini SD with its text encoder is a StableDiffusionPipeline")
        return StableDiffusionPipeline(
            vae=self.vae,
            text_encoder=self.encoder.model,
            tokenizer=self.encoder.tokenizer,
            unet=self.unet,
            scheduler=scheduler or DDIMScheduler.from_config(self.scheduler_config),
            safety_checker=None,
            feature_extractor=None,
            requires_safety_checker=False,
        )

    def model_input(self, sample: torch.Tensor) -> torch.Tensor:
        """What the U-Net reads for a (noisy) sample: the pixels, and coordinate channels if it has them."""
        return add_coordinates(sample) if self.spec.coordinates else sample

    def encode(self, prompts: list[str]) -> torch.Tensor:
        """The states the U-Net reads for these prompts, under the model's conditioning."""
        if self.encoder is None:
            raise SdkitError("this pipeline has no text encoder; pass prompt_embeds, or load it with one")
        states = self.encoder.encode(list(prompts)).float().cpu()
        if self.spec.conditioning == "pooled":
            return pool_states(states, self.encoder.real_mask(list(prompts)))
        return states

    def scheduler(self, name: str = "ddim"):
        from diffusers import DDIMScheduler, DPMSolverMultistepScheduler

        classes = {"ddim": DDIMScheduler, "dpm": DPMSolverMultistepScheduler}
        if name not in classes:
            raise SdkitError(f"unknown sampler {name!r}; choose one of {', '.join(classes)}")
        return classes[name].from_config(self.scheduler_config)

    def guidance(self, scale: float | None) -> float:
        """`scale`, or this model's own guidance (spec.guidance_scale) when it is None."""
        return self.spec.guidance_scale if scale is None else scale

    def __call__(
        self,
        prompt: str | list[str] | None = None,
        num_inference_steps: int = 25,
        guidance_scale: float | None = None,
        generator=None,
        seeds: list[int] | None = None,
        sampler: str = "ddim",
        prompt_embeds: torch.Tensor | None = None,
        negative_prompt_embeds: torch.Tensor | None = None,
        output_type: str = "np",
        steering=None,
        guides: list | None = None,
        batch_size: int = 64,
        progress=None,
        callback_on_step_end=None,
    ) -> MiniSDOutput:
        """Generate one image per prompt (or per row of prompt_embeds), with diffusers' argument names.

        guidance_scale defaults to the model's own (spec.guidance_scale: 4 in pixels, 2 in latents).
        The starting noise of image i comes from seeds[i] (so any image can be made again alone), or
        from `generator` (one torch.Generator per image, or one for all); by default seeds 0, 1, ...
        negative_prompt_embeds defaults to the encoding of the empty prompt, as in training. With
        `steering` (sdkit.steering.SteeringSettings) and one sdkit.steering.Guide per image, the
        cross-attention is steered before each of the first steering.steps denoising steps.
        `progress` (a tqdm bar counting images, say) moves on by fractions of images at each step.
        `callback_on_step_end(step_index, timestep, first_image, sample, prediction)` is called at
        each step of each batch with the batch's (steered) sample and its guided prediction, before
        the scheduler steps; first_image is the batch's first image's index.
        """
        steps = num_inference_steps
        guidance_scale = self.guidance(guidance_scale)
        trained = self.scheduler_config.get("num_train_timesteps", 1000)
        for name, value in (("num_inference_steps", steps), ("batch_size", batch_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise SdkitError(f"{name} must be a whole number of at least 1, not {value!r}")
        if not 1 <= steps <= trained:
            raise SdkitError(
                f"sampling steps must be 1 to {trained} (the timesteps the model was trained on), not {steps}"
            )
        if output_type not in ("np", "pt", "pil"):
            raise SdkitError(f"output_type must be 'np', 'pt' or 'pil', not {output_type!r}")
        prompts = [prompt] if isinstance(prompt, str) else prompt
        if prompt_embeds is None:
            if not prompts:
                raise SdkitError("give prompts or prompt_embeds")
            prompt_embeds = self.encode(prompts)
        n = len(prompt_embeds)
        check_images_fit(n, self.spec.image_size, "sampling")
        prompts = list(prompts) if prompts is not None else [""] * n
        if generator is None:
            seeds = list(seeds) if seeds is not None else list(range(n))
        elif seeds is not None:
            raise SdkitError("give seeds or generator, not both")
        noise = self._noise(n, seeds, generator)
        if len(prompts) != n:
            raise SdkitError(f"{n} prompt embeddings need {n} prompts (got {len(prompts)})")
        if steering is not None and (guides is None or len(guides) != n):
            raise SdkitError(f"steering needs one guide per image ({n}), not {0 if guides is None else len(guides)}")
        if negative_prompt_embeds is None:
            negative_prompt_embeds = (
                self.encode([""]) if self.encoder is not None else torch.zeros_like(prompt_embeds[:1])
            )
        width = self.unet.config.cross_attention_dim
        for name, states in (("prompt_embeds", prompt_embeds), ("negative_prompt_embeds", negative_prompt_embeds)):
            if states.ndim != 3 or states.shape[-1] != width:
                raise SdkitError(f"{name} must be (batch, tokens, {width}), not {list(states.shape)}")
        if len(negative_prompt_embeds) not in (1, n):
            raise SdkitError(
                f"negative_prompt_embeds holds {len(negative_prompt_embeds)} rows; give one for all "
                f"images or one per image ({n})"
            )
        if steering is not None:
            from ..steering import check_guides

            check_guides(guides, prompt_embeds.shape[1])
        images, losses = [], []
        for start in range(0, n, batch_size):
            stop = min(start + batch_size, n)
            part = None if steering is None else guides[start:stop]
            on_step = (
                None
                if callback_on_step_end is None
                else lambda i, t, sample, prediction, start=start: callback_on_step_end(i, t, start, sample, prediction)
            )
            pixels, steered = self._generate(
                prompt_embeds[start:stop],
                negative_prompt_embeds,
                noise[start:stop],
                guidance_scale,
                steps,
                sampler,
                steering,
                part,
                progress,
                on_step,
            )
            images.append(pixels)
            losses += [[step, start + image, loss] for step, image, loss in steered]
        pixels = torch.cat(images)
        return MiniSDOutput(_as_output(pixels, output_type), prompts, seeds, losses)

    def _noise(self, n: int, seeds, generator) -> torch.Tensor:
        """The starting noise, (n, C, H, W): each image's from its seed, or from the generator(s)."""
        side, channels = self.unet.config.sample_size, self.unet.config.out_channels
        if generator is None:
            if len(seeds) != n:
                raise SdkitError(f"{n} prompts need {n} seeds (got {len(seeds)})")
            bad = next((s for s in seeds if not isinstance(s, int) or isinstance(s, bool) or not 0 <= s < 2**63), None)
            if bad is not None:
                raise SdkitError(f"a seed is a whole number from 0 to 2^63 - 1, not {bad!r}")
            generator = [torch.Generator().manual_seed(s) for s in seeds]
        if isinstance(generator, (list, tuple)):
            if len(generator) != n:
                raise SdkitError(f"{n} prompts need {n} generators (got {len(generator)})")
            return torch.cat([torch.randn(1, channels, side, side, generator=g) for g in generator])
        return torch.randn(n, channels, side, side, generator=generator)

    def guided_prediction(self, model_input, timestep, states, negative, guidance_scale: float) -> torch.Tensor:
        """The U-Net's prediction for `model_input` (batch, C, H, W) under classifier-free guidance:
        epsilon, or v where it was trained on v (the scheduler's config says). `negative` is one
        state per image or one for all; a scale of 1 is the conditional prediction alone."""
        if guidance_scale == 1.0:
            return self.unet(model_input, timestep, encoder_hidden_states=states).sample
        negative = negative.expand(len(states), *negative.shape[1:])
        # One batch for both halves when they are the same length (as diffusers does); two calls
        # otherwise, since padding either with extra tokens would change what the cells read.
        if negative.shape[1] == states.shape[1]:
            both = self.unet(
                torch.cat([model_input, model_input]), timestep, encoder_hidden_states=torch.cat([negative, states])
            ).sample
            uncond, prediction = both.chunk(2)
        else:
            uncond = self.unet(model_input, timestep, encoder_hidden_states=negative).sample
            prediction = self.unet(model_input, timestep, encoder_hidden_states=states).sample
        return uncond + guidance_scale * (prediction - uncond)

    @torch.no_grad()
    def _generate(
        self,
        states,
        negative,
        noise,
        guidance_scale,
        steps,
        sampler,
        steering=None,
        guides=None,
        progress=None,
        on_step=None,
    ):
        """(pixels (batch, 3, H, W) in [-1, 1], the steering losses of this batch). `progress` moves on
        by the batch's images over the steps at each step: a batch of 64 images takes minutes."""
        param = next(self.unet.parameters())
        scheduler = self.scheduler(sampler)
        scheduler.set_timesteps(steps)
        sample = noise.to(param.device, param.dtype) * scheduler.init_noise_sigma
        states = states.to(param.device, param.dtype)
        negative = negative.to(param.device, param.dtype)
        if steering is not None:
            from ..steering import Steerer

            steerer = Steerer(self.unet, steering, self.model_input)
        moved = 0  # in 1/1024 images: dyadic updates add up exactly, so a count ends on its total
        for i, t in enumerate(scheduler.timesteps):
            if steering is not None:
                sample = steerer.step(sample, t, states, guides, i, len(scheduler.timesteps))
            model_input = self.model_input(scheduler.scale_model_input(sample, t))
            prediction = self.guided_prediction(model_input, t, states, negative, guidance_scale)
            if on_step is not None:
                on_step(i, t, sample, prediction)
            sample = scheduler.step(prediction, t, sample).prev_sample
            if progress is not None:
                done = round(1024 * len(states) * (i + 1) / len(scheduler.timesteps))
                progress.update((done - moved) / 1024)
                moved = done
        if not sample.isfinite().all():
            raise SdkitError(
                f"sampling gave non-finite pixels (guidance scale {guidance_scale:g}, {steps} steps): the "
                "guided noise prediction overflowed; use a guidance scale nearer the trained range (1-10)"
            )
        if self.vae is not None:
            sample = self.decode(sample)
        return sample.float().cpu(), (steerer.losses if steering is not None else [])

    @torch.no_grad()
    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """Pixels in [-1, 1] -> what the U-Net denoises: the pixels themselves, or the VAE's scaled
        latents. The posterior's mean, not a draw from it: a reading of given images is then the
        same on every run (training drew from the posterior unless TrainSettings.posterior said
        "mean"; its spread is small beside the noise any timestep past the first few adds)."""
        return pixels if self.vae is None else scaled_latents(self.vae, pixels)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Scaled latents -> pixels in [-1, 1], as diffusers' pipeline decodes them."""
        vae = self.vae
        return vae.decode(latents.to(vae.dtype) / vae.config.scaling_factor).sample.clamp(-1, 1)


def _as_output(pixels: torch.Tensor, output_type: str):
    """(batch, 3, H, W) in [-1, 1] -> images in [0, 1], as numpy (H, W, 3), torch (3, H, W) or PIL."""
    if output_type == "pt":
        return (pixels / 2 + 0.5).clamp(0, 1)
    images = np.stack([from_model(image) for image in pixels])
    if output_type == "np":
        return images
    from PIL import Image

    return [Image.fromarray((image * 255).round().astype(np.uint8)) for image in images]
