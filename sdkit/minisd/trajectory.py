"""When is a pair's order lost? What the relation word does to the predicted image, step by step.

At each sampling step the model's prediction implies a clean image (x0). For a pair "A left of B"
(two colours), the order of the two objects in it is read from the contrast between their colours:
each pixel's projection on A's colour minus B's (the grey background projects to 0), weighted by
the pixel's horizontal place; a negative moment puts A's colour left of B's. Each pair caption is
sampled twice from the same seed, once with "left of" and once with "right of", so what the
relation word does is seen apart from what the noise does. Per step, over the pairs:

    in order              the caption's order is the image's (both captions counted; 50 % = chance)
    the word orders       the swap moves A's colour left of B's, the order the captions ask for
    the word moves colour the swap moves the colour, whichever object's, left: the relation word
                          read as a place ("at the left") rather than as a relation between two

It needs no judge, so it reads the blurry mean images of the first steps too.

    steps = relation_by_step(MiniSDPipeline.from_pretrained("weights/minisd"), count=64)
    print(format_relation_steps([steps]))
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from ..common import format_table
from .data import RELATIONS, colour_rgb, pair_scene

MEASURES = ("in order", "the word orders", "the word moves colour")


@dataclass
class RelationSteps:
    model: str
    pairs: int  # pair prompts with two colours, each sampled under both relations from seed i
    guidance_scale: float
    timesteps: list[int]  # of each sampling step
    shares: dict[str, list[float]]  # per measure (MEASURES), per step
    intervals: dict[str, list[list[float]]]  # per measure, per step: 95 % bootstrap interval over the pairs
    seconds: float = 0.0

    def to_json(self) -> dict:
        return asdict(self)


def predicted_clean(scheduler, sample: torch.Tensor, prediction: torch.Tensor, timestep) -> torch.Tensor:
    """The clean image a prediction (epsilon or v, as the scheduler's config says) implies at `timestep`."""
    alpha_bar = scheduler.alphas_cumprod[int(timestep)].to(sample.dtype)
    alpha, sigma = alpha_bar.sqrt(), (1 - alpha_bar).sqrt()
    if scheduler.config.prediction_type == "v_prediction":
        return alpha * sample - sigma * prediction
    if scheduler.config.prediction_type != "epsilon":
        raise ValueError(f"predicted_clean reads epsilon or v predictions, not {scheduler.config.prediction_type}")
    return (sample - sigma * prediction) / alpha


def horizontal_moment(weights: torch.Tensor) -> torch.Tensor:
    """(n, H, W) -> (n,): the weights' first moment about the image's vertical centre line."""
    width = weights.shape[-1]
    return (weights * (torch.arange(width, dtype=torch.float32) - (width - 1) / 2)).sum(dim=(1, 2))


def order_moment(images: torch.Tensor, first: list[str], second: list[str]) -> torch.Tensor:
    """Per image (n, 3, H, W in [-1, 1]): the horizontal moment of the first colour's contrast
    against the second's; negative where the first colour lies left of the second."""
    # in [-1, 1] pixels: (2a - 1) - (2b - 1) = 2 (a - b)
    direction = 2 * torch.tensor([[a - b for a, b in zip(colour_rgb(x), colour_rgb(y))] for x, y in zip(first, second)])
    return horizontal_moment(torch.einsum("nchw,nc->nhw", images.float(), direction))


def two_colour_pairs(count: int) -> tuple[list, list[str], list[str]]:
    """The evaluation's first `count` pair prompts, less those whose two objects share a colour
    (their order cannot be read from colour): (scenes, first objects' colours, second's)."""
    from .evaluate import prompt_set

    scenes = [s for s in prompt_set("pairs", count) if s.objects[0].colour != s.objects[1].colour]
    return scenes, [s.objects[0].colour for s in scenes], [s.objects[1].colour for s in scenes]


def relation_by_step(
    pipe,
    count: int = 64,
    guidance_scale: float | None = None,
    steps: int = 25,
    model_name: str = "model",
    progress=None,
) -> RelationSteps:
    """The evaluation's first `count` pair prompts (those with two colours), each sampled with
    "left of" and with "right of" from seed i, read step by step (see the module's docstring)."""
    guidance_scale = pipe.guidance(guidance_scale)
    start = time.perf_counter()
    scenes, first, second = two_colour_pairs(count)
    scheduler = pipe.scheduler()
    timesteps: list[int] = []
    order = {r: torch.zeros(len(scenes), steps) for r in RELATIONS}  # contrast moment
    colour = {r: torch.zeros(len(scenes), steps) for r in RELATIONS}  # colour-mass moment
    for relation in RELATIONS:

        def record(index, timestep, begin, sample, prediction, relation=relation):
            if index == len(timesteps):
                timesteps.append(int(timestep))
            clean = predicted_clean(scheduler, sample.float().cpu(), prediction.float().cpu(), timestep)
            if pipe.vae is not None:  # a latent model's prediction is read on its decoded pixels
                clean = pipe.decode(clean)
            end = begin + len(sample)
            order[relation][begin:end, index] = order_moment(clean, first[begin:end], second[begin:end])
            colour[relation][begin:end, index] = horizontal_moment(clean.norm(dim=1))

        captions = [
            pair_scene(
                (s.objects[0].colour, s.objects[0].shape),
                relation,
                (s.objects[1].colour, s.objects[1].shape),
                template=s.template,
            ).caption
            for s in scenes
        ]
        pipe(
            captions,
            steps,
            guidance_scale,
            seeds=list(range(len(scenes))),
            progress=progress,
            callback_on_step_end=record,
        )
    left, right = order["left of"], order["right of"]
    per_pair = {
        "in order": ((left < 0).float() + (right > 0).float()) / 2,
        "the word orders": (left < right).float(),
        "the word moves colour": (colour["left of"] < colour["right of"]).float(),
    }
    shares, intervals = shares_with_intervals(per_pair)
    return RelationSteps(
        model_name, len(scenes), guidance_scale, timesteps, shares, intervals, time.perf_counter() - start
    )


def shares_with_intervals(per_pair: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """Per measure, a (pairs, columns) table of per-pair scores -> (the mean of each column, its 95 %
    bootstrap interval over the pairs)."""
    pairs = len(next(iter(per_pair.values())))
    draws = torch.from_numpy(np.random.default_rng(0).integers(0, pairs, (2000, pairs)))
    shares, intervals = {}, {}
    for name, table in per_pair.items():
        means = table[draws].mean(1)  # (draws, columns)
        shares[name] = table.mean(0).tolist()
        intervals[name] = torch.stack([means.quantile(0.025, dim=0), means.quantile(0.975, dim=0)], 1).tolist()
    return shares, intervals


SOURCES = ("noised from the pair", "noised from the exchanged pair")
CONFLICT_TIMESTEPS = (999, 900, 800, 700, 600, 500, 300)


@dataclass
class CaptionAgainstNoise:
    model: str
    pairs: int
    guidance_scale: float
    timesteps: list[int]
    shares: dict[str, list[float]]  # per source (SOURCES), per timestep: the prediction in the caption's order
    intervals: dict[str, list[list[float]]]  # per source, per timestep: 95 % bootstrap interval over the pairs
    seconds: float = 0.0

    def to_json(self) -> dict:
        return asdict(self)


@torch.no_grad()
def caption_against_noise(
    pipe,
    count: int = 64,
    timesteps=CONFLICT_TIMESTEPS,
    guidance_scale: float | None = None,
    seed: int = 0,
    model_name: str = "model",
) -> CaptionAgainstNoise:
    """Does the model take a pair's order from its caption or from the image under the noise?

    The evaluation's first `count` pair prompts with two colours, drawn by the generator (image i
    with the evaluation's jitter, random.Random(i)), and the same pairs with their two objects
    exchanged (each in the other's cell: the caption's order reversed). Each is noised to each
    timestep with the same noise (torch.Generator seeded by `seed`), and the model, given the
    caption and guidance as in sampling, predicts the clean image; the share of pairs whose
    prediction has the caption's order (order_moment) is measured per timestep and source.
    Every image a pair's caption describes has its order, so the best denoiser of the training
    images predicts it from either source at every timestep; a model that copies the order it
    sees under the noise follows the exchanged pair instead."""
    import random

    from diffusers import DDPMScheduler

    from .data import render, swapped_objects, to_model

    guidance_scale = pipe.guidance(guidance_scale)
    start = time.perf_counter()
    scenes, first, second = two_colour_pairs(count)
    asked = torch.tensor(
        [-1.0 if s.relation == "left of" else 1.0 for s in scenes]
    )  # the moment's sign the caption asks
    side = pipe.spec.image_size
    sources = {
        SOURCES[0]: [render(s, side, random.Random(i)).image for i, s in enumerate(scenes)],
        SOURCES[1]: [render(swapped_objects(s), side, random.Random(i)).image for i, s in enumerate(scenes)],
    }
    scheduler = DDPMScheduler.from_config(pipe.scheduler_config)
    param = next(pipe.unet.parameters())
    states = pipe.encode([s.caption for s in scenes]).to(param.device, param.dtype)
    empty = pipe.encode([""]).to(param.device, param.dtype)
    per_pair = {name: torch.zeros(len(scenes), len(timesteps)) for name in SOURCES}
    noise = None
    for name, images in sources.items():
        # a latent model is noised and predicts on its latents; the order is read on the decoded pixels
        clean = pipe.encode_images(torch.from_numpy(np.stack([to_model(image) for image in images])))
        if noise is None:
            noise = torch.randn(clean.shape, generator=torch.Generator().manual_seed(seed))
        for k, t in enumerate(timesteps):
            t_batch = torch.full((len(scenes),), int(t))
            noisy = scheduler.add_noise(clean, noise, t_batch).to(param.device, param.dtype)
            prediction = pipe.guided_prediction(pipe.model_input(noisy), int(t), states, empty, guidance_scale)
            implied = predicted_clean(scheduler, noisy.float().cpu(), prediction.float().cpu(), t)
            if pipe.vae is not None:
                implied = pipe.decode(implied)
            per_pair[name][:, k] = (order_moment(implied, first, second) * asked > 0).float()
    shares, intervals = shares_with_intervals(per_pair)
    return CaptionAgainstNoise(
        model_name,
        len(scenes),
        guidance_scale,
        [int(t) for t in timesteps],
        shares,
        intervals,
        time.perf_counter() - start,
    )


def format_caption_against_noise(result: CaptionAgainstNoise) -> str:
    rows = [[name, *(f"{100 * v:.0f} %" for v in result.shares[name])] for name in SOURCES]
    return format_table([f"{result.model}: the caption's order", *(f"t = {t}" for t in result.timesteps)], rows)


def format_relation_steps(results: list[RelationSteps], every: int = 4) -> str:
    """Per model and measure, the share at every `every`-th step and the last."""
    steps = sorted({*range(0, len(results[0].timesteps), every), len(results[0].timesteps) - 1})
    rows = [
        [r.model if i == 0 else "", name, *(f"{100 * r.shares[name][k]:.0f} %" for k in steps)]
        for r in results
        for i, name in enumerate(MEASURES)
    ]
    return format_table(["model", "pairs", *(f"t = {results[0].timesteps[k]}" for k in steps)], rows)
