"""Do cross-attention maps point at the objects? Each word's map scored against its object's mask.

The mini SD's answer key makes this a measurement: generator images come with per-object masks,
and the judge finds the objects in generated ones. For each image, noise it to a few timesteps,
run the U-Net on its caption under CrossAttentionTrace, and score the map of every colour word and
shape word (sub-word pieces merged) against the mask of the object it names:

- IoU after normalising the map to its maximum and thresholding at tau (DAAM's 0.4, and a sweep);
- AUC, threshold-free: the chance that a pixel of the object gets more attention than one off it.

Baselines in the same table: a uniform map, a centre prior (a Gaussian at the image centre), and
the map of the same kind of word naming the other object (pairs only). Per layer resolution and
per timestep, with the attention mass on BOS / words / EOS / padding.
"""

from __future__ import annotations

import math
import random
import textwrap
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from .common import format_table
from .encoders import ROLES, TokenRoles, token_roles
from .trace import CrossAttentionTrace

DAAM_TAU = 0.4
TAUS = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7)
TIMESTEPS = (100, 300, 500, 700, 900)
SOURCES = ("word", "other object's word", "centre prior", "uniform")


def iou(attention: np.ndarray, mask: np.ndarray, tau: float = DAAM_TAU) -> float:
    """IoU of the map, normalised to its maximum and thresholded at tau, with the mask."""
    peak = attention.max()
    chosen = attention >= tau * peak if peak > 0 else np.ones_like(mask)
    union = (chosen | mask).sum()
    return float((chosen & mask).sum() / union) if union else 0.0


def auc(attention: np.ndarray, mask: np.ndarray) -> float:
    """P(attention at a random object pixel > at a random background pixel), ties counting half
    (the Mann-Whitney U statistic over the two sets of pixels)."""
    inside, outside = attention[mask].ravel(), attention[~mask].ravel()
    if not len(inside) or not len(outside):
        return math.nan
    _, inverse, counts = np.unique(np.concatenate([inside, outside]), return_inverse=True, return_counts=True)
    average_rank = np.cumsum(counts) - counts + (counts + 1) / 2  # tied values share their mean rank
    u = average_rank[inverse][: len(inside)].sum() - len(inside) * (len(inside) + 1) / 2
    return float(u / (len(inside) * len(outside)))


def _score(attention: np.ndarray, mask: np.ndarray, taus) -> tuple[list[float], float]:
    return [iou(attention, mask, tau) for tau in taus], auc(attention, mask)


def centre_prior(side: int) -> np.ndarray:
    """A Gaussian bump at the image centre (sigma a quarter of the side)."""
    coords = np.arange(side) + 0.5 - side / 2
    return np.exp(-(coords[:, None] ** 2 + coords[None, :] ** 2) / (2 * (side / 4) ** 2))


def object_words(roles: TokenRoles, objects) -> list[dict]:
    """The colour and shape words of a caption (its token roles), each with its token positions
    and the index of the object it names (captions name the first object's words first)."""
    seen = {"colour": 0, "shape": 0}
    found = []
    for word, positions in roles.words:
        for kind, attribute in (("colour", "colour"), ("shape", "shape")):
            owners = [i for i, o in enumerate(objects) if getattr(o, attribute) == word]
            if not owners:
                continue
            # The k-th colour word names the k-th object (both objects may share a colour).
            index = owners[0] if len(objects) == 1 or len(owners) == 1 else min(seen[kind], len(objects) - 1)
            seen[kind] += 1
            found.append({"word": word, "kind": kind, "positions": positions, "object": index})
    return found


@dataclass
class Localization:
    model: str
    images: str  # "generator" or "generated"
    count: int
    timesteps: list[int]
    taus: list[float]
    rows: list[dict]  # per resolution and timestep: IoU at DAAM's tau, the sweep and AUC, per source
    by_layer: list[dict]  # per layer (all timesteps)
    mass_by_role: dict[str, float]
    best: dict
    seconds: float = 0.0
    note: str = ""
    examples: list = field(default_factory=list, repr=False)  # (image, word, map, mask) for the picture

    def to_json(self) -> dict:
        out = asdict(self)
        del out["examples"]
        return out


def _noised(pipe, pixels: torch.Tensor, t: int, seed: int) -> torch.Tensor:
    """The images, as the U-Net sees them (pixels, or a latent model's latents), noised to timestep t
    under the model's own schedule."""
    from diffusers import DDPMScheduler

    clean = pipe.encode_images(pixels)
    scheduler = DDPMScheduler.from_config(pipe.scheduler_config)
    noise = torch.randn(clean.shape, generator=torch.Generator().manual_seed(seed))
    return scheduler.add_noise(clean, noise, torch.full((len(clean),), t))


@torch.no_grad()
def localize(
    pipe,
    images: np.ndarray,
    scenes,
    masks: list[list[np.ndarray]],
    timesteps=TIMESTEPS,
    taus=TAUS,
    model_name: str = "model",
    source: str = "generator",
    seed: int = 0,
    batch: int = 32,
    progress=None,
) -> Localization:
    """Score each colour and shape word's attention map against its object's mask.

    images: (n, H, W, 3) in [0, 1]; `masks[i][k]`: the mask of scene i's object k (None if unknown).
    """
    from .minisd.data import to_model

    start = time.perf_counter()
    side = images.shape[1]
    tokenizer, max_length = pipe.encoder.tokenizer, pipe.spec.max_length
    prior, uniform = centre_prior(side), np.ones((side, side))
    # scores[(layer, t, source)] -> list of (iou per tau, auc)
    scores: dict[tuple, list] = {}
    role_mass = dict.fromkeys(ROLES, 0.0)
    role_count = 0
    grids: dict[str, int] = {}
    examples = []
    for first in range(0, len(images), batch):
        chunk = slice(first, min(first + batch, len(images)))
        captions = [s.caption for s in scenes[chunk]]
        states = pipe.encode(captions)
        pixels = torch.from_numpy(np.stack([to_model(image) for image in images[chunk]]))
        caption_roles = [token_roles(tokenizer, c, max_length) for c in captions]
        words = [object_words(r, s.objects) for r, s in zip(caption_roles, scenes[chunk])]
        roles = [r.roles for r in caption_roles]
        # Per scored word: the baselines, which are the same at every layer and timestep, scored once.
        baselines = {}
        for i in range(len(captions)):
            for k, w in enumerate(words[i]):
                mask = masks[first + i][w["object"]]
                if mask is not None and mask.any():
                    baselines[i, k] = {
                        "centre prior": _score(prior, mask, taus),
                        "uniform": _score(uniform, mask, taus),
                    }
        for t in timesteps:
            with CrossAttentionTrace(pipe.unet, maps=True, by_timestep=True) as trace:
                pipe.unet(pipe.model_input(_noised(pipe, pixels, t, seed + t)), t, encoder_hidden_states=states)
            for layer, sums in trace.layers.items():
                grids[layer] = sums.grid[0] if sums.grid else 0
            for i in range(len(captions)):
                summary = trace.summary(item=i)
                for stats in summary.values():
                    for position, mass in enumerate(stats["token_mass"]):
                        role_mass[roles[i][position]] += mass
                    role_count += 1
                for layer in [*trace.layers, "all layers"]:
                    chosen = None if layer == "all layers" else [layer]
                    maps = trace.token_maps(item=i, layers=chosen, timesteps=[t], size=(side, side)).numpy()
                    for k, w in enumerate(words[i]):
                        if (i, k) not in baselines:
                            continue
                        mask = masks[first + i][w["object"]]
                        word_map = maps[w["positions"]].sum(0)
                        candidates = {"word": word_map}
                        other = [o for o in words[i] if o["kind"] == w["kind"] and o["object"] != w["object"]]
                        if other:
                            candidates["other object's word"] = maps[other[0]["positions"]].sum(0)
                        scored = {name: _score(attention, mask, taus) for name, attention in candidates.items()}
                        for name, score in {**scored, **baselines[i, k]}.items():
                            scores.setdefault((layer, t, name), []).append(score)
                        if layer == "all layers" and t == timesteps[len(timesteps) // 2] and len(examples) < 12:
                            examples.append((images[first + i], f"{w['word']} ({captions[i]})", word_map, mask))
            if progress is not None:
                progress.update(len(captions))
    tau_index = list(taus).index(DAAM_TAU) if DAAM_TAU in taus else 0

    def summarise(entries):
        ious = np.array([e[0] for e in entries])
        aucs = np.array([e[1] for e in entries], dtype=float)
        return {
            "n": len(entries),
            "iou": float(ious[:, tau_index].mean()),
            "iou_sweep": ious.mean(0).tolist(),
            "auc": float(np.nanmean(aucs)),
        }

    resolutions = sorted({g for g in grids.values() if g}, reverse=True)
    rows = []
    for resolution in [*resolutions, "all layers"]:
        layers = ["all layers"] if resolution == "all layers" else [l for l, g in grids.items() if g == resolution]  # noqa: E741
        for t in timesteps:
            row = {"resolution": resolution, "timestep": t}
            for name in SOURCES:
                entries = [e for layer in layers for e in scores.get((layer, t, name), [])]
                row[name] = summarise(entries) if entries else None
            rows.append(row)
    by_layer = []
    for layer, grid in grids.items():
        row = {"layer": layer, "grid": grid}
        for name in ("word", "centre prior"):
            entries = [e for t in timesteps for e in scores.get((layer, t, name), [])]
            row[name] = summarise(entries) if entries else None
        by_layer.append(row)
    scored = [r for r in rows if r["word"] and r["resolution"] != "all layers"]
    best = max(scored, key=lambda r: r["word"]["auc"]) if scored else {}
    best = {
        "resolution": best.get("resolution"),
        "timestep": best.get("timestep"),
        "auc": best["word"]["auc"] if best else None,
        "iou": best["word"]["iou"] if best else None,
    }
    mass = {role: role_mass[role] / max(role_count, 1) for role in ROLES}
    return Localization(
        model_name,
        source,
        len(images),
        list(timesteps),
        list(taus),
        rows,
        by_layer,
        mass,
        best,
        time.perf_counter() - start,
        examples=examples,
    )


def generator_set(count: int, side: int, seed: int = 4321):
    """Generator images (half single objects, half pairs) with their scenes and masks."""
    from .minisd.data import random_scene, render
    from .minisd.pipeline import check_images_fit

    check_images_fit(count, side, "drawing")
    rng = random.Random(f"localize:{seed}")
    scenes = [random_scene(rng, pair_fraction=0.0 if i % 2 == 0 else 1.0) for i in range(count)]
    samples = [render(s, side, random.Random(f"{seed}:{i}")) for i, s in enumerate(scenes)]
    return np.stack([s.image for s in samples]), scenes, [list(s.masks) for s in samples]


def generated_set(
    pipe, count: int, guidance_scale: float | None = None, steps: int = 25, seed: int = 4321, progress=None
):
    """Generated images for generator captions, with masks from the judge (None where it did not find
    the object the caption names, by colour and shape)."""
    from .minisd.judge import find_objects

    _, scenes, _ = generator_set(count, pipe.spec.image_size, seed)
    out = pipe([s.caption for s in scenes], steps, guidance_scale, seeds=list(range(count)), progress=progress)
    masks = []
    for image, scene in zip(out.images, scenes):
        found = find_objects(image, max_objects=4)
        masks.append(
            [next((f.mask for f in found if (f.colour, f.shape) == (o.colour, o.shape)), None) for o in scene.objects]
        )
    return out.images, scenes, masks


def format_localization(r: Localization) -> str:
    def cell(entry, key):
        return "-" if not entry else f"{entry[key]:.3f}"

    rows = [
        [
            r0["resolution"] if isinstance(r0["resolution"], str) else f"{r0['resolution']}x{r0['resolution']}",
            r0["timestep"],
            (r0["word"] or {}).get("n", 0),
            *(cell(r0[s], "iou") for s in SOURCES),
            *(cell(r0[s], "auc") for s in SOURCES[:3]),
        ]
        for r0 in r.rows
    ]
    headers = [
        "layers",
        "t",
        "n",
        "IoU word",
        "IoU other",
        "IoU centre",
        "IoU unif.",
        "AUC word",
        "AUC other",
        "AUC centre",
    ]
    title = (
        f"{r.model}, {r.count} {r.images} images:\ncolour and shape word maps against their object's mask "
        f"(IoU at tau = {DAAM_TAU}; AUC 0.5 = chance;\nn = word maps scored: colour and shape words of "
        f"objects the judge found)"
    )
    out = [format_table(headers, rows, title=title)]
    if r.note:
        out.append(r.note)
    whole = [x for x in r.rows if x["resolution"] == "all layers" and x["word"]]
    if whole:
        word = np.mean([x["word"]["auc"] for x in whole])
        baselines = {s: np.mean([x[s]["auc"] for x in whole if x[s]]) for s in SOURCES[1:3] if any(x[s] for x in whole)}
        iou_word = np.mean([x["word"]["iou"] for x in whole])
        iou_base = {s: np.mean([x[s]["iou"] for x in whole if x[s]]) for s in SOURCES[1:] if any(x[s] for x in whole)}
        out.append(
            f"\nAll layers, mean over timesteps: word maps AUC {word:.3f} against "
            + ", ".join(f"{s} {v:.3f}" for s, v in baselines.items())
            + ";"
        )
        out.append(f"  IoU {iou_word:.3f} against " + ", ".join(f"{s} {v:.3f}" for s, v in iou_base.items()) + ".")
    if r.best.get("resolution"):
        out.append(
            f"Attention localises best at {r.best['resolution']}x{r.best['resolution']}, timestep "
            f"{r.best['timestep']} (AUC {r.best['auc']:.3f}, IoU {r.best['iou']:.3f})."
        )
    layers = [x for x in r.by_layer if x["word"]]
    if layers:
        top = max(layers, key=lambda x: x["word"]["auc"])
        # two lines: a layer's full name (SD's are 51 characters) and its numbers overran 120 columns
        out.append(f"Best single layer: {top['layer']} at {top['grid']}x{top['grid']},")
        out.append(f"  AUC {top['word']['auc']:.3f}, IoU {top['word']['iou']:.3f} (over timesteps).")
        if whole and word > top["word"]["auc"]:
            out.append("The mean over all layers localises better than any one layer.")
    out.append(
        "Attention mass (mean over cells, heads, layers, timesteps): "
        + ", ".join(f"{role} {100 * m:.1f} %" for role, m in r.mass_by_role.items())
    )
    sweep = next((x["word"]["iou_sweep"] for x in whole), None)
    if sweep:
        out.append(
            "IoU of word maps (all layers) by tau: " + ", ".join(f"{t:g}: {v:.3f}" for t, v in zip(r.taus, sweep))
        )
    out.append(f"({r.seconds:.0f} s)")
    return "\n".join(out)


def draw_examples(r: Localization, path) -> bool:
    """A PNG: example images, each word's map over it (colour bar) and the object's mask outline.

    False (and nothing written) when there is no example: no named object was found."""
    if not r.examples:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .common import save_figure

    shown = r.examples[:8]
    fig, axes = plt.subplots(2, len(shown), figsize=(2.5 * len(shown), 5.2), dpi=110, squeeze=False)
    for c, (image, label, word_map, mask) in enumerate(shown):
        axes[0, c].imshow(image, interpolation="nearest")
        axes[0, c].contour(mask, levels=[0.5], colors="white", linewidths=0.8)
        word, caption = label.split(" (", 1)
        axes[0, c].set_title(f"{word}\n{textwrap.fill(caption.rstrip(')'), 30)}", fontsize=6.5)
        heat = axes[1, c].imshow(word_map, cmap="inferno", interpolation="bilinear")
        axes[1, c].contour(mask, levels=[0.5], colors="cyan", linewidths=0.8)
        fig.colorbar(heat, ax=axes[1, c], fraction=0.046, pad=0.02).ax.tick_params(labelsize=5)
        for ax in axes[:, c]:
            ax.axis("off")
    fig.suptitle(
        f"{r.model}: word attention maps (all layers) on {r.images} images; outline = the named object's mask",
        fontsize=8,
    )
    save_figure(fig, path)
    return True
