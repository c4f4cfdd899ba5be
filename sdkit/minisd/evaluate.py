"""Judge a mini SD: generate images for fixed prompt sets and read them back with the judge.

Sets: single objects and pairs seen in training (new samples of seen combinations), and the
held-out combinations training never saw. Beside the model, two floors on the same prompts and
seeds: the same model given the empty prompt (what it draws without reading the text) and an
untrained U-Net of the same shape (chance). And the judge itself, on the generator's own images of
the same scenes, sharp and blurred (a Gaussian of 0.8 pixels at side 32, plus noise: softer than
the model draws): its accuracy bounds what any model can score, and the blurred row shows that soft
edges are not what the judge marks down.
"""

from __future__ import annotations

import itertools
import random
import textwrap
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from ..common import SdkitError, format_table, save_figure
from . import EVAL_SET_SEED
from .data import (
    HELD_OUT_PAIRS,
    HELD_OUT_SINGLES,
    PAIR_TEMPLATES,
    RELATIONS,
    SINGLE_TEMPLATES,
    Scene,
    from_model,
    pair_scene,
    random_scene,
    render,
    single_scene,
    to_model,
)
from .judge import HEADERS, accuracy, accuracy_cells, accuracy_intervals, judge
from .pipeline import MiniSDPipeline, check_images_fit

SETS = ("singles", "pairs", "held_out_singles", "held_out_pairs")
BLUR_PIXELS, BLUR_NOISE = 0.8, 0.05  # at side 32; the blur scales with the side


def blurred(image: np.ndarray, sigma: float, noise: float, seed: int) -> np.ndarray:
    """(H, W, 3) in [0, 1], blurred by a Gaussian of `sigma` pixels (edges repeated) plus Gaussian
    noise of standard deviation `noise`, clipped to [0, 1]."""
    radius = max(1, int(3 * sigma + 0.5))
    offsets = np.arange(-radius, radius + 1)
    kernel = np.exp(-(offsets**2) / (2 * sigma**2))
    kernel /= kernel.sum()
    out = np.pad(image.astype(np.float64), ((radius, radius), (radius, radius), (0, 0)), mode="edge")
    out = sum(w * out[radius + o : radius + o + image.shape[0]] for o, w in zip(offsets, kernel))
    out = sum(w * out[:, radius + o : radius + o + image.shape[1]] for o, w in zip(offsets, kernel))
    out = out + np.random.default_rng(seed).normal(0, noise, out.shape)
    return np.clip(out, 0, 1).astype(np.float32)


def prompt_set(name: str, count: int, seed: int = EVAL_SET_SEED) -> list[Scene]:
    """`count` scenes of a set, the same on every run (a seed of its own, apart from training's)."""
    rng = random.Random(f"{name}:{seed}")
    if name == "singles":
        return [random_scene(rng, pair_fraction=0.0) for _ in range(count)]
    if name == "pairs":
        return [random_scene(rng, pair_fraction=1.0) for _ in range(count)]
    if name == "held_out_singles":
        return [
            single_scene(*HELD_OUT_SINGLES[i % len(HELD_OUT_SINGLES)], template=rng.randrange(len(SINGLE_TEMPLATES)))
            for i in range(count)
        ]
    if name == "held_out_pairs":
        scenes = []
        for i in range(count):
            first, second = HELD_OUT_PAIRS[i % len(HELD_OUT_PAIRS)]
            if rng.random() < 0.5:
                first, second = second, first
            scenes.append(
                pair_scene(
                    first,
                    rng.choice(RELATIONS),
                    second,
                    rng.randrange(3),
                    tuple(sorted(rng.sample(range(3), 2))),
                    rng.randrange(len(PAIR_TEMPLATES)),
                )
            )
        return scenes
    raise SdkitError(f"unknown prompt set {name!r}; choose from {', '.join(SETS)}")


@dataclass
class Evaluation:
    model: str
    guidance_scale: float
    steps: int
    sampler: str
    counts: dict[str, int]
    results: dict[str, dict[str, dict[str, float]]]  # condition -> set -> attribute -> accuracy
    seconds: float
    verdicts: dict[str, list[dict]] = field(default_factory=dict)  # per set, the model's verdict per image
    intervals: dict[str, dict[str, list[float]]] = field(default_factory=dict)  # per set: the model's 95 % intervals
    images: dict[str, np.ndarray] = field(default_factory=dict, repr=False)  # per set, the model's images
    scenes: dict[str, list[Scene]] = field(default_factory=dict, repr=False)
    steering: dict | None = None  # the settings the model's images were steered with (None: unsteered)
    seconds_per_image: dict[str, float] = field(default_factory=dict)  # "model" (and "unsteered" beside a steered one)
    # per set, beside a steered run: images that steering made all right ("fixed") or all wrong ("broken"),
    # prompt by prompt and seed by seed; the paired count says more than the two accuracies' intervals
    changed: dict[str, dict[str, int]] = field(default_factory=dict)
    set_seed: int = EVAL_SET_SEED  # the draw of the sets' captions (prompt_set's seed)

    def to_json(self) -> dict:
        out = asdict(self)
        del out["images"], out["scenes"]
        out["captions"] = {name: [s.caption for s in scenes] for name, scenes in self.scenes.items()}
        return out


def judge_images(images: np.ndarray, scenes: list[Scene]) -> tuple[dict[str, float], list]:
    verdicts = [judge(image, scene) for image, scene in zip(images, scenes)]
    return accuracy(verdicts), verdicts


def evaluate(
    pipe: MiniSDPipeline,
    sets=SETS,
    count: int = 64,
    guidance_scale: float | None = None,
    steps: int = 25,
    sampler: str = "ddim",
    floors: bool = True,
    model_name: str = "model",
    progress=None,
    steering=None,
    set_seed: int = EVAL_SET_SEED,
) -> Evaluation:
    """Generate `count` images per set (image i from seed i) and judge them, with the floors, at
    `guidance_scale` (the model's own by default: MiniSDPipeline.guidance).

    `set_seed` draws the sets' captions: another one gives other captions (settings can be chosen
    on one draw and reported on the default one).

    With `steering` (sdkit.steering.SteeringSettings), the model's images are steered by guides from
    their captions, and the same prompts and seeds are also sampled unsteered, beside them
    ("unsteered"), with the time per image of each."""
    from dataclasses import asdict as settings_dict

    from ..presets import build_unet

    check_images_fit(count * (1 + 2 * floors + (steering is not None)), pipe.spec.image_size, "judging")
    guidance_scale = pipe.guidance(guidance_scale)
    start = time.perf_counter()
    scenes = {name: prompt_set(name, count, seed=set_seed) for name in sets}
    results: dict[str, dict] = {"model": {}, "judge on generator images": {}, "judge, blurred generator images": {}}
    ev = Evaluation(
        model_name,
        guidance_scale,
        steps,
        sampler,
        {n: len(s) for n, s in scenes.items()},
        results,
        0.0,
        scenes=scenes,
        set_seed=set_seed,
    )
    timed = {"model": 0.0}
    if steering is not None:
        from .steer import caption_guides

        results["unsteered"], timed["unsteered"] = {}, 0.0
        ev.steering = {k: v for k, v in settings_dict(steering).items() if k != "text_positions"}
    untrained = None
    if floors:
        results["empty prompt"], results["untrained"] = {}, {}
        untrained = MiniSDPipeline(
            build_unet(dict(pipe.unet.config), weights="random", seed=0),
            pipe.scheduler_config,
            pipe.spec,
            pipe.encoder,
            pipe.vae,
        )
    if pipe.vae is not None:  # the most a latent model's images can show: the generator's, through the VAE
        results["judge, VAE round trips"] = {}
    for name, set_scenes in scenes.items():
        captions = [s.caption for s in set_scenes]
        seeds = list(range(len(set_scenes)))
        truth = np.stack([render(s, pipe.spec.image_size, random.Random(i)).image for i, s in enumerate(set_scenes)])
        results["judge on generator images"][name] = judge_images(truth, set_scenes)[0]
        sigma = BLUR_PIXELS * pipe.spec.image_size / 32
        soft = np.stack([blurred(image, sigma, BLUR_NOISE, seed=i) for i, image in enumerate(truth)])
        results["judge, blurred generator images"][name] = judge_images(soft, set_scenes)[0]
        if pipe.vae is not None:
            from .vae import round_trip

            trips = round_trip(pipe.vae, torch.from_numpy(np.stack([to_model(image) for image in truth])))
            results["judge, VAE round trips"][name] = judge_images(
                np.stack([from_model(t) for t in trips]), set_scenes
            )[0]
        states = pipe.encode(captions)
        began = time.perf_counter()
        guides = None if steering is None else caption_guides(pipe.encoder, captions, pipe.spec.image_size)
        out = pipe(
            captions,
            steps,
            guidance_scale,
            seeds=seeds,
            sampler=sampler,
            prompt_embeds=states,
            progress=progress,
            steering=steering,
            guides=guides,
        )
        timed["model"] += time.perf_counter() - began
        results["model"][name], verdicts = judge_images(out.images, set_scenes)
        ev.intervals[name] = accuracy_intervals(verdicts)
        ev.images[name], ev.verdicts[name] = out.images, [v.to_json() for v in verdicts]
        if steering is not None:
            began = time.perf_counter()
            plain = pipe(
                captions, steps, guidance_scale, seeds=seeds, sampler=sampler, prompt_embeds=states, progress=progress
            )
            timed["unsteered"] += time.perf_counter() - began
            results["unsteered"][name], plain_verdicts = judge_images(plain.images, set_scenes)
            ev.changed[name] = changed_by_steering(plain_verdicts, verdicts)
        if floors:
            empty = pipe.encode([""]).expand(len(captions), -1, -1)
            blind = pipe(
                captions, steps, guidance_scale, seeds=seeds, sampler=sampler, prompt_embeds=empty, progress=progress
            )
            results["empty prompt"][name] = judge_images(blind.images, set_scenes)[0]
            chance = untrained(
                captions, steps, guidance_scale, seeds=seeds, sampler=sampler, prompt_embeds=states, progress=progress
            )
            results["untrained"][name] = judge_images(chance.images, set_scenes)[0]
    ev.seconds = time.perf_counter() - start
    images = max(sum(ev.counts.values()), 1)
    ev.seconds_per_image = {k: v / images for k, v in timed.items()}
    return ev


def changed_by_steering(unsteered: list, steered: list) -> dict[str, int]:
    """Of images from the same prompt and seed, how many steering made all right ("fixed") and all
    wrong ("broken")."""
    pairs = [(before.all, after.all) for before, after in zip(unsteered, steered, strict=True)]
    return {"fixed": pairs.count((False, True)), "broken": pairs.count((True, False))}


def format_evaluation(ev: Evaluation) -> str:
    rows = []
    for name in ev.counts:
        for condition, by_set in ev.results.items():
            acc = by_set[name]
            label = "model, steered" if condition == "model" and ev.steering else condition
            rows.append([name if condition == "model" else "", label, ev.counts[name], *accuracy_cells(acc)])
    title = (
        f"{ev.model}: judged accuracy, {ev.sampler} {ev.steps} steps, guidance {ev.guidance_scale:g} "
        "(position: the cell for one object, left/right for a pair)"
    )
    if ev.set_seed != EVAL_SET_SEED:
        title += f"\ncaptions drawn with set seed {ev.set_seed}, not the default draw ({EVAL_SET_SEED})"
    if ev.steering:
        s = ev.steering
        title += (
            f"\nsteered: {'+'.join(s['objectives'])}, scale {s['scale']:g}, the first {s['steps']} steps, maps at "
            f"{s['resolution']}x{s['resolution']}; beside it the same prompts and seeds unsteered"
        )
    out = [format_table(["set", "images from", "n", *HEADERS], rows, title=title)]
    out.append(f"\n{sum(ev.counts.values())} prompts per condition in {ev.seconds:.0f} s")
    if "unsteered" in ev.seconds_per_image:
        per = ev.seconds_per_image
        out.append(
            f"time per image: steered {per['model']:.2f} s, unsteered {per['unsteered']:.2f} s "
            f"({per['model'] / max(per['unsteered'], 1e-9):.2f}x)"
        )
    for name, changed in ev.changed.items():
        out.append(f"{name}, same prompts and seeds: steering fixed {changed['fixed']} and broke {changed['broken']}")
    return "\n".join(out)


def draw_panel(ev: Evaluation, path, per_set: int = 8) -> None:
    """A PNG: per set, the first images with their captions and the judge's verdicts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in ev.images if len(ev.images[n])]
    cols = min(per_set, max(len(ev.images[n]) for n in names))
    fig, axes = plt.subplots(len(names), cols, figsize=(1.9 * cols, 2.35 * len(names)), dpi=110, squeeze=False)
    for r, name in enumerate(names):
        for c in range(cols):
            ax = axes[r, c]
            ax.axis("off")
            if c >= len(ev.images[name]):
                continue
            verdict = ev.verdicts[name][c]
            ax.imshow(ev.images[name][c], interpolation="nearest")
            marks = " ".join(f"{a[0]}{'+' if verdict[a] else '-'}" for a in ("colour", "position", "shape"))
            marks += f" {len(verdict['found'])} found" if verdict["extra"] else ""
            ax.set_title(
                textwrap.fill(ev.scenes[name][c].caption, 24) + f"\n{marks}",
                fontsize=6.5,
                color="darkgreen" if verdict["all"] else "firebrick",
            )
        axes[r, 0].text(
            -0.15, 0.5, name, transform=axes[r, 0].transAxes, rotation=90, va="center", ha="right", fontsize=8
        )
    fig.suptitle(
        f"{ev.model}: green = all correct (c colour, p position, s shape; 'found' when more objects than "
        f"named); guidance {ev.guidance_scale:g}",
        fontsize=9,
    )
    save_figure(fig, path)


def grid_places(captions: list[str], most: int = 8) -> tuple[int, int, list[tuple[int, int]]]:
    """(rows, columns, (row, column) of each image): each run of one caption starts a row (when
    every caption comes once, they simply fill rows)."""
    runs = [len(list(group)) for _, group in itertools.groupby(captions)]
    if max(runs) == 1:
        runs = [len(captions)]
    cols = min(most, max(runs))
    places, row = [], 0
    for run in runs:
        places += [(row + i // cols, i % cols) for i in range(run)]
        row += -(-run // cols)
    return row, cols, places


# matplotlib draws at most 2^16 pixels a side; a grid row is 2.2 inches at 110 dpi, with room for the title
MAX_GRID_ROWS = 256


def check_grid(captions: list[str]) -> None:
    """Refuse, before sampling, a grid too tall to draw."""
    rows = grid_places(captions)[0]
    if rows > MAX_GRID_ROWS:
        raise SdkitError(
            f"a grid of {len(captions):,} images takes {rows:,} rows; a picture holds at most "
            f"{MAX_GRID_ROWS} (8 images to a row): ask for fewer seeds or prompts"
        )


def sample_grid(images: np.ndarray, captions: list[str], seeds: list[int], path, title: str = "") -> None:
    """A PNG grid of generated images, each with its caption and seed. Each run of images with the
    same caption starts its own row (at most 8 to a row), so a prompt's seeds read along a row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not len(images) == len(captions) == len(seeds) or not len(images):
        raise SdkitError(
            f"a grid needs one caption and one seed per image: {len(images)} images, {len(captions)} "
            f"captions, {len(seeds)} seeds"
        )
    check_grid(captions)
    rows, cols, places = grid_places(captions)
    # constrained: the title takes its own room above the captions instead of printing over them
    fig, axes = plt.subplots(rows, cols, figsize=(1.9 * cols, 2.2 * rows), dpi=110, squeeze=False, layout="constrained")
    for ax in axes.flat:
        ax.axis("off")
    for (r, c), image, caption, seed in zip(places, images, captions, seeds):
        axes[r, c].imshow(image, interpolation="nearest")
        axes[r, c].set_title(f"{textwrap.fill(caption, 24)}\nseed {seed}", fontsize=6.5)
    if title:
        fig.suptitle(textwrap.fill(title, 18 * cols), fontsize=9)
    save_figure(fig, path)


def write_overlays(
    trace, images: np.ndarray, captions: list[str], seeds: list[int], encoder, folder, scale: int = 8
) -> list[str]:
    """One PNG per image in `folder` (a maps folder, written whole): the image, then each word of its
    caption with the word's cross-attention map (its pieces summed, all layers and steps) over it.
    `trace` traced the sampling of exactly these images, in this order."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from PIL import Image

    from ..common import MAPS_FOLDER, atomic_folder, write_json
    from ..encoders import token_roles
    from ..trace import overlay

    if trace.items != len(images):
        raise SdkitError(f"the trace holds {trace.items} images, not the {len(images)} to draw over")
    side = images.shape[1] * scale
    names = []
    with atomic_folder(folder, MAPS_FOLDER) as tmp:
        for i, (image, caption, seed) in enumerate(zip(images, captions, seeds)):
            words = token_roles(encoder.tokenizer, caption, encoder.max_length).words
            maps = trace.token_maps(item=i, size=(side, side))
            big = Image.fromarray((np.clip(image, 0, 1) * 255).round().astype(np.uint8)).resize(
                (side, side), Image.NEAREST
            )
            fig, axes = plt.subplots(
                1, 1 + len(words), figsize=(1.6 * (1 + len(words)), 2.0), dpi=110, squeeze=False, layout="constrained"
            )
            axes[0, 0].imshow(big)
            axes[0, 0].set_title(f"seed {seed}", fontsize=7)
            for ax, (word, positions) in zip(axes[0, 1:], words):
                ax.imshow(overlay(big, maps[positions].sum(0)))
                ax.set_title(word, fontsize=7)
            for ax in axes.flat:
                ax.axis("off")
            fig.suptitle(textwrap.fill(caption, 20 * (1 + len(words))), fontsize=8)
            names.append(save_figure(fig, tmp / f"{i:03d}_seed{seed}.png").name)
        write_json(tmp / "maps.json", {"captions": captions, "seeds": seeds, "files": names})
    return names
