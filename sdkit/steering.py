"""Steer the cross-attention at inference: nudge the noisy sample, before each denoising step, down
the gradient of a loss on the attention maps.

The maps come from the trace (`CrossAttentionTrace(keep_graph=True)`): the same attention-processor
mechanism that reads them, so one code path reads and steers, for the mini SD and for a stock
diffusers SD pipeline alike. Three objectives, which add up:

    excite   Attend-and-Excite (Chefer et al. 2023): raise the weakest object token's peak attention.
             Computed exactly as diffusers' StableDiffusionAttendAndExcitePipeline does (a test holds
             our latents against its own), iterative refinement at its threshold steps included.
    bind     each attribute word's map pulled onto its own noun's map and away from the other nouns'
             (the idea of SynGen, Rassin et al. 2023), by symmetric KL between the normalised maps.
    layout   each object's token maps pushed into the part of the image given to it (the idea of
             layout guidance, Chen et al. 2023, and BoxDiff): 1 - (its mass inside), squared.

    guide = Guide(excite=[[2], [5]], bind=[([1], [2], [[5]])], layout=[([2], left_half)])
    images = steered_sd(pipe, "a red cat and a blue dog", guide, SteeringSettings(("excite", "bind")))
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .common import SdkitError

OBJECTIVES = ("excite", "bind", "layout")
# Attend-and-Excite's defaults (diffusers' pipeline): step size scale * sqrt(linspace(1, 0.5, steps))[i],
# and at these denoising steps the latent is refined until the weakest token's peak reaches the threshold.
EXCITE_THRESHOLDS = {0: 0.05, 10: 0.5, 20: 0.8}


@dataclass
class Guide:
    """What to steer, for one prompt, as token positions of its tokenized text (a word's pieces
    together: their maps are summed).

    excite: the object tokens; bind: (attribute tokens, its noun's tokens, other nouns' tokens);
    layout: (tokens, region), the region a (H, W) map in [0, 1] at any resolution (resized to each
    map's grid)."""

    excite: list[list[int]] = field(default_factory=list)
    bind: list[tuple[list[int], list[int], list[list[int]]]] = field(default_factory=list)
    layout: list[tuple[list[int], torch.Tensor]] = field(default_factory=list)
    text: slice | None = None  # the tokens excite's softmax runs over (default: the settings')

    @classmethod
    def from_words(cls, tokenizer, prompt: str, excite=(), bind=(), layout=(), max_length: int = 77) -> Guide:
        """A guide given by words of `prompt`, each found among its tokens (a word's pieces together):
        excite: words; bind: (attribute, its noun, [other nouns]); layout: (word, region). A word the
        prompt lacks is an error that lists its words."""
        from .encoders import token_roles

        words = token_roles(tokenizer, prompt, max_length).words

        def at(word: str) -> list[int]:
            wanted = " ".join(word.lower().split())
            positions = [p for w, ps in words if w.lower() == wanted for p in ps]
            if not positions:
                raise SdkitError(f"{word!r} is not a word of {prompt!r}; its words: {', '.join(w for w, _ in words)}")
            return positions

        return cls(
            excite=[at(w) for w in excite],
            bind=[(at(a), at(n), [at(o) for o in others]) for a, n, others in bind],
            layout=[(at(w), region) for w, region in layout],
        )

    def positions(self) -> set[int]:
        used = {p for group in self.excite for p in group}
        used |= {p for a, n, others in self.bind for group in (a, n, *others) for p in group}
        return used | {p for group, _ in self.layout for p in group}


@dataclass
class SteeringSettings:
    objectives: tuple[str, ...] = ("excite",)
    scale: float = 20.0  # Attend-and-Excite's scale_factor: the size of each nudge
    steps: int = 25  # the first `steps` denoising steps are steered (A&E's max_iter_to_alter)
    resolution: int = 16  # maps of the cross-attention layers at this grid side (A&E's attn_res)
    layers: tuple[str, ...] | None = None  # or exactly these layers (names as in the trace)
    thresholds: dict = field(default_factory=lambda: dict(EXCITE_THRESHOLDS))  # refinement, for excite
    max_refinement_steps: int = 20
    text_positions: slice = field(default_factory=lambda: slice(1, -1))  # A&E's softmax: not BOS, not the last

    def check(self) -> None:
        unknown = [o for o in self.objectives if o not in OBJECTIVES]
        if unknown or not self.objectives:
            raise SdkitError(
                f"unknown steering objective {unknown[0] if unknown else '(none)'!r}; choose from "
                f"{', '.join(OBJECTIVES)}"
            )
        if not math.isfinite(self.scale) or self.scale < 0:
            raise SdkitError(f"the steering scale must be a finite number >= 0, not {self.scale}")
        if self.steps < 0 or self.resolution <= 0 or self.max_refinement_steps < 0:
            raise SdkitError("steering steps, resolution and refinement steps must be positive")

    def step_size(self, index: int, total: int) -> float:
        """A&E's schedule: scale * sqrt(1 -> 0.5 linearly over the denoising steps)."""
        fraction = 1.0 - 0.5 * index / max(total - 1, 1)
        return self.scale * math.sqrt(fraction)


def steered_layers(trace, settings: SteeringSettings, latent_size: tuple[int, int]) -> list[str]:
    """The cross-attention layers whose maps are steered; refuses a choice that names none."""
    from .geometry import halved

    names = list(trace.layers)
    if settings.layers is not None:
        missing = [n for n in settings.layers if n not in names]
        if missing:
            raise SdkitError(f"no cross-attention layer {missing[0]!r}; the U-Net has {', '.join(names)}")
        return list(settings.layers)
    sides = {}
    for name in names:
        depth = _depth(name, trace.unet)
        sides[name] = halved(*latent_size, depth)[0]
    chosen = [n for n in names if sides[n] == settings.resolution]
    if not chosen:
        raise SdkitError(
            f"no cross-attention layer works at {settings.resolution}x{settings.resolution}; this U-Net's "
            f"are at {', '.join(str(s) for s in sorted(set(sides.values()), reverse=True))}"
        )
    return chosen


def _depth(layer: str, unet) -> int:
    from .geometry import level_depth

    levels = len(unet.config.block_out_channels)
    if layer.startswith("mid_block"):
        return levels - 1
    kind, index = layer.split(".")[:2]
    return level_depth(f"{'down' if kind == 'down_blocks' else 'up'}.{index}", levels)


def aggregate_maps(trace, layers: list[str], grid: tuple[int, int]) -> torch.Tensor:
    """(batch, H, W, tokens): the mean over the chosen layers and their heads, as A&E aggregates."""
    parts = []
    for name in layers:
        probs = trace.graph_probs.get(name)
        if probs is None:
            raise SdkitError(f"{name}: no attention was captured in the last forward pass")
        heads = trace.layers[name].heads or 1
        batch = probs.shape[0] // heads
        parts.append(probs.reshape(batch, heads, *grid, probs.shape[-1]))
    return torch.cat(parts, dim=1).mean(1)


def _smoothing_kernel() -> torch.Tensor:
    """A&E's 3x3 Gaussian (sigma 0.5, written with its (2 sigma)^2 in the exponent), normalised."""
    coords = torch.arange(3, dtype=torch.float32) - 1
    one = torch.exp(-((coords / (2 * 0.5)) ** 2))
    kernel = one[:, None] * one[None, :]
    return (kernel / kernel.sum())[None, None]


def excite_loss(maps: torch.Tensor, groups: list[list[int]], text: slice) -> torch.Tensor:
    """Attend-and-Excite on one image's maps (H, W, tokens): max over groups of (1 - smoothed peak),
    with A&E's sharpening (softmax of 100 x the weights over the text tokens). Pieces of one word
    count as the first of them, as A&E takes one index per word."""
    text_maps = F.softmax(maps[:, :, text] * 100, dim=-1)
    offset = text.start or 0
    losses = []
    for group in groups:
        image = text_maps[:, :, group[0] - offset]
        padded = F.pad(image[None, None], (1, 1, 1, 1), mode="reflect")
        peak = F.conv2d(padded, _smoothing_kernel().to(padded)).max()
        losses.append(torch.clamp(1.0 - peak, min=0))
    return torch.stack(losses).max()


def _distribution(maps: torch.Tensor, group: list[int]) -> torch.Tensor:
    image = maps[:, :, group].sum(-1).flatten()
    return image / image.sum().clamp_min(1e-12)


def symmetric_kl(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    p, q = p.clamp_min(1e-12), q.clamp_min(1e-12)
    return (p * (p / q).log()).sum() + (q * (q / p).log()).sum()


def bind_loss(maps: torch.Tensor, pairs) -> torch.Tensor:
    """Each attribute's map near its noun's, far from the other nouns' (symmetric KL)."""
    total = maps.new_zeros(())
    for attribute, noun, others in pairs:
        a = _distribution(maps, attribute)
        total = total + symmetric_kl(a, _distribution(maps, noun))
        for other in others:
            total = total - symmetric_kl(a, _distribution(maps, other)) / max(len(others), 1)
    return total / max(len(pairs), 1)


def layout_loss(maps: torch.Tensor, regions) -> torch.Tensor:
    """For each (tokens, region): (1 - the share of the tokens' attention inside the region)^2."""
    total = maps.new_zeros(())
    for group, region in regions:
        inside = F.interpolate(region[None, None].to(maps), size=maps.shape[:2], mode="bilinear", align_corners=False)[
            0, 0
        ]
        image = maps[:, :, group].sum(-1)
        total = total + (1 - (image * inside).sum() / image.sum().clamp_min(1e-12)) ** 2
    return total / max(len(regions), 1)


def steering_loss(maps: torch.Tensor, guide: Guide, settings: SteeringSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """(the summed objectives, the excite loss alone or 0) on one image's maps (H, W, tokens)."""
    total = maps.new_zeros(())
    excite = maps.new_zeros(())
    if "excite" in settings.objectives and guide.excite:
        excite = excite_loss(maps, guide.excite, guide.text or settings.text_positions)
        total = total + excite
    if "bind" in settings.objectives and guide.bind:
        total = total + bind_loss(maps, guide.bind)
    if "layout" in settings.objectives and guide.layout:
        total = total + layout_loss(maps, guide.layout)
    return total, excite


def check_guides(guides: list[Guide], tokens: int) -> None:
    for i, guide in enumerate(guides):
        bad = [p for p in guide.positions() if not 0 <= p < tokens]
        if bad:
            raise SdkitError(f"prompt {i + 1}: token position {bad[0]} is outside its {tokens} tokens")


class Steerer:
    """Nudges latents before each denoising step; used by the mini SD's pipeline and steered_sd.

    A guided step: run the U-Net once more on the latents with gradients (conditional text only,
    as A&E does), read the chosen layers' maps, and move each image's latent by - step size x the
    gradient of its loss. For excite at A&E's threshold steps, repeat until its weakest token's peak
    passes the threshold (or max_refinement_steps). The trace is on the U-Net only during these
    extra passes: the denoising passes run on the U-Net's own processors."""

    def __init__(self, unet, settings: SteeringSettings, model_input=None):
        settings.check()
        self.unet, self.settings = unet, settings
        self.model_input = model_input or (lambda latents: latents)  # what the U-Net reads for the latents
        self.layers: list[str] | None = None
        self.losses: list[list[float]] = []  # per steered step and image: [step, image, loss before its nudge]

    def _losses(self, trace, latent, t, embed, guide):
        self.unet(self.model_input(latent), t, encoder_hidden_states=embed)
        size = tuple(latent.shape[-2:])
        if self.layers is None:
            self.layers = steered_layers(trace, self.settings, size)
        maps = aggregate_maps(trace, self.layers, self._grid(size))
        trace.graph_probs.clear()
        return steering_loss(maps[0].float(), guide, self.settings)

    def _grid(self, latent_size):
        from .geometry import halved

        return halved(*latent_size, _depth(self.layers[0], self.unet))

    def step(
        self, latents: torch.Tensor, t, embeds: torch.Tensor, guides: list[Guide], index: int, total_steps: int
    ) -> torch.Tensor:
        """The latents (batch, C, H, W) nudged for denoising step `index`; unchanged past `steps`."""
        from .trace import CrossAttentionTrace

        if index >= self.settings.steps or not guides:
            return latents
        size = self.settings.step_size(index, total_steps)
        nudged = []
        with torch.enable_grad(), CrossAttentionTrace(self.unet, keep_graph=True) as trace:
            for i, guide in enumerate(guides):  # one image at a time, as A&E (its refinement is per image)
                latent = latents[i : i + 1].detach().clone().requires_grad_(True)
                embed = embeds[i : i + 1]
                loss, excite = self._losses(trace, latent, t, embed, guide)
                threshold = self.settings.thresholds.get(index)
                if threshold is not None and "excite" in self.settings.objectives and excite > 1.0 - threshold:
                    latent, loss = self._refine(trace, latent, t, embed, guide, excite, 1.0 - threshold, size)
                self.losses.append([index, i, float(loss.detach())])
                nudged.append(self._nudge(latent, loss, size) if loss != 0 else latent)
        out = torch.cat([n.detach() for n in nudged])
        if not torch.isfinite(out).all():
            raise SdkitError(
                f"steering made the sample non-finite at step {index + 1} (scale {self.settings.scale:g}); "
                "use a smaller scale"
            )
        return out

    def _refine(self, trace, latent, t, embed, guide, excite, target: float, size: float):
        """A&E's iterative refinement, as its pipeline runs it: while the excite loss seen last is
        above target, recompute the loss and nudge; then one more pass for the loss to go on with."""
        for _ in range(self.settings.max_refinement_steps):
            if excite <= target:
                break
            latent = latent.detach().clone().requires_grad_(True)
            loss, excite = self._losses(trace, latent, t, embed, guide)
            if loss != 0:
                latent = self._nudge(latent, loss, size)
        latent = latent.detach().clone().requires_grad_(True)
        loss, _ = self._losses(trace, latent, t, embed, guide)
        return latent, loss

    def _nudge(self, latent, loss, size):
        (grad,) = torch.autograd.grad(loss, [latent])
        latent = latent - size * grad
        return latent.detach().clone().requires_grad_(True)


@torch.no_grad()
def steered_sd(
    pipe,
    prompt: str | list[str],
    guides: Guide | list[Guide],
    settings: SteeringSettings,
    num_inference_steps: int = 50,
    guidance_scale: float = 7.5,
    generator=None,
    latents=None,
    negative_prompt=None,
    output_type: str = "pil",
    height: int | None = None,
    width: int | None = None,
):
    """A stock diffusers StableDiffusionPipeline, sampled with cross-attention steering.

    The loop is the pipeline's own (its prompt encoding, latents, scheduler and decoding), with one
    addition: before each denoising step the latents are steered (see Steerer). With
    objectives=("excite",) it is diffusers' Attend-and-Excite pipeline, step for step. Height and
    width default to the U-Net's own size, as the pipeline's do; each must be a multiple of the
    VAE's factor. Guides' layout regions are resized to each map's grid, whatever its shape.
    """
    prompts = [prompt] if isinstance(prompt, str) else list(prompt)
    guides = [guides] * len(prompts) if isinstance(guides, Guide) else list(guides)
    if len(guides) != len(prompts):
        raise SdkitError(f"{len(prompts)} prompts need {len(guides)} guides")
    device = pipe._execution_device
    do_cfg = guidance_scale > 1.0
    prompt_embeds, negative_embeds = pipe.encode_prompt(prompts, device, 1, do_cfg, negative_prompt)
    check_guides(guides, prompt_embeds.shape[1])
    pipe.scheduler.set_timesteps(num_inference_steps, device=device)
    native = pipe.unet.config.sample_size * pipe.vae_scale_factor
    height, width = height or native, width or native
    for name, side in (("height", height), ("width", width)):
        if not isinstance(side, int) or side <= 0 or side % pipe.vae_scale_factor:
            raise SdkitError(f"{name} must be a positive multiple of {pipe.vae_scale_factor} pixels, not {side!r}")
    latents = pipe.prepare_latents(
        len(prompts), pipe.unet.config.in_channels, height, width, prompt_embeds.dtype, device, generator, latents
    )
    extra = pipe.prepare_extra_step_kwargs(generator, 0.0)
    context = torch.cat([negative_embeds, prompt_embeds]) if do_cfg else prompt_embeds
    timesteps = pipe.scheduler.timesteps
    steerer = Steerer(pipe.unet, settings)
    for i, t in enumerate(timesteps):
        latents = steerer.step(latents, t, prompt_embeds, guides, i, len(timesteps))
        model_input = pipe.scheduler.scale_model_input(torch.cat([latents] * 2) if do_cfg else latents, t)
        noise = pipe.unet(model_input, t, encoder_hidden_states=context).sample
        if do_cfg:
            uncond, cond = noise.chunk(2)
            noise = uncond + guidance_scale * (cond - uncond)
        latents = pipe.scheduler.step(noise, t, latents, **extra).prev_sample
    if output_type == "latent":
        return latents
    image = pipe.vae.decode(latents / pipe.vae.config.scaling_factor).sample
    return pipe.image_processor.postprocess(image, output_type=output_type)
