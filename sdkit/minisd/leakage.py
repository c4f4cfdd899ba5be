"""Where does the U-Net lose binding and the relation? Attention leakage on pair images.

For each pair image (the generator's own, or the model's generations), noised to several
timesteps, each cross-attention layer's map of each colour word and shape word is split between
the two objects' masks:

    leakage = mass on the other object / (mass on its own object + mass on the other)

0 is a word that attends only to its own object, 0.5 one that cannot tell them apart, 1 one that
attends to the wrong object. The relation word ("left" / "right") is measured by the share of its
mass on the object its caption puts left. On generated images, objects are found by the judge and
named by their shape; the images are split by the judge's verdict (colours bound right against
swapped; relation right against wrong), and each layer and timestep is scored by how well its
leakage tells the two groups apart (AUC: 0.5 = not at all).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from ..common import format_table
from ..encoders import token_roles
from ..localization import _noised, object_words
from ..trace import CrossAttentionTrace
from .data import to_model
from .judge import find_objects, judge

TIMESTEPS = (100, 300, 500, 700, 900)
KINDS = ("colour", "shape", "relation")


@dataclass
class Leakage:
    model: str
    source: str  # "generator" or "generated"
    images: int  # pair images measured
    timesteps: list[int]
    rows: list[dict]  # per layer ("all layers" too) and timestep: mean leakage per word kind, relation share
    by_verdict: list[dict] = field(default_factory=list)  # generated: per layer and timestep, the two groups apart
    groups: dict = field(default_factory=dict)  # generated: how many images in each verdict group
    seconds: float = 0.0

    def to_json(self) -> dict:
        return asdict(self)


def generated_pairs(pipe, count: int, guidance_scale: float | None = None, steps: int = 25, progress=None):
    """The model's images for `count` pair prompts, each object's mask found by the judge by its shape
    (None where the two shapes are one, or a shape is missing), and the judge's verdicts."""
    from .evaluate import prompt_set

    scenes = prompt_set("pairs", count)
    out = pipe([s.caption for s in scenes], steps, guidance_scale, seeds=list(range(count)), progress=progress)
    masks, verdicts = [], []
    for image, scene in zip(out.images, scenes):
        verdicts.append(judge(image, scene))
        found = find_objects(image, max_objects=2)
        shapes = [o.shape for o in scene.objects]
        by_shape = {o.shape: o.mask for o in found}
        usable = len(set(shapes)) == 2 and all(s in by_shape for s in shapes)
        masks.append([by_shape[s] for s in shapes] if usable else None)
    return out.images, scenes, masks, verdicts


def _relation_positions(roles, relation: str) -> list[int]:
    word = relation.split()[0]  # "left of" -> "left"
    return next((positions for text, positions in roles.words if text == word), [])


@torch.no_grad()
def measure(
    pipe,
    images: np.ndarray,
    scenes,
    masks,
    timesteps=TIMESTEPS,
    verdicts=None,
    model_name: str = "model",
    source: str = "generator",
    seed: int = 0,
    batch: int = 32,
    progress=None,
) -> Leakage:
    """Leakage per layer and timestep on pair images (H, W, 3) in [0, 1]; masks[i]: the two objects'
    masks (or None to skip image i). With `verdicts`, the split by the judge's verdict."""
    start = time.perf_counter()
    side = images.shape[1]
    keep = [i for i, m in enumerate(masks) if m is not None and len(scenes[i].objects) == 2]
    # values[(layer, t, kind)][image] -> leakage (or, for the relation, the share on the left object)
    values: dict[tuple, dict[int, float]] = {}
    for first in range(0, len(keep), batch):
        chunk = keep[first : first + batch]
        captions = [scenes[i].caption for i in chunk]
        states = pipe.encode(captions)
        pixels = torch.from_numpy(np.stack([to_model(images[i]) for i in chunk]))
        roles = [token_roles(pipe.encoder.tokenizer, c, pipe.spec.max_length) for c in captions]
        for t in timesteps:
            with CrossAttentionTrace(pipe.unet, maps=True, by_timestep=True) as trace:
                pipe.unet(pipe.model_input(_noised(pipe, pixels, t, seed + t)), t, encoder_hidden_states=states)
            for j, i in enumerate(chunk):
                scene, (own_masks) = scenes[i], [m.astype(np.float64) for m in masks[i]]
                left = 0 if scene.relation == "left of" else 1
                words = object_words(roles[j], scene.objects)
                relation = _relation_positions(roles[j], scene.relation)
                for layer in [*trace.layers, "all layers"]:
                    maps = (
                        trace.token_maps(
                            item=j, layers=None if layer == "all layers" else [layer], timesteps=[t], size=(side, side)
                        )
                        .double()
                        .numpy()
                    )
                    for w in words:
                        word_map = maps[w["positions"]].sum(0)
                        own, other = (float((word_map * own_masks[k]).sum()) for k in (w["object"], 1 - w["object"]))
                        if own + other > 0:
                            values.setdefault((layer, t, w["kind"]), {}).setdefault(i, [])
                            values[layer, t, w["kind"]][i].append(other / (own + other))
                    if relation:
                        relation_map = maps[relation].sum(0)
                        on = [float((relation_map * own_masks[k]).sum()) for k in (left, 1 - left)]
                        if sum(on) > 0:
                            values.setdefault((layer, t, "relation"), {})[i] = [on[0] / sum(on)]
            if progress is not None:
                progress.update(len(chunk))
    per_image = {key: {i: float(np.mean(v)) for i, v in by.items()} for key, by in values.items()}
    layers = sorted({key[0] for key in per_image}, key=lambda n: (n == "all layers", n))
    rows = []
    for layer in layers:
        for t in timesteps:
            row = {"layer": layer, "timestep": t}
            for kind in KINDS:
                found = per_image.get((layer, t, kind), {})
                row[kind] = float(np.mean(list(found.values()))) if found else None
            rows.append(row)
    report = Leakage(model_name, source, len(keep), list(timesteps), rows, seconds=0.0)
    if verdicts is not None:
        _split_by_verdict(report, per_image, [verdicts[i] for i in keep], keep, layers, timesteps)
    report.seconds = time.perf_counter() - start
    return report


def auc(positive: list[float], negative: list[float]) -> float | None:
    """P(a positive scores above a negative), ties half: 0.5 = the score tells nothing."""
    if not positive or not negative:
        return None
    p, n = np.asarray(positive)[:, None], np.asarray(negative)[None, :]
    return float((p > n).mean() + 0.5 * (p == n).mean())


def _split_by_verdict(report: Leakage, per_image, verdicts, keep, layers, timesteps) -> None:
    """Bound right vs swapped colours (both shapes drawn); relation right vs wrong (colours bound)."""
    swapped = {i for i, v in zip(keep, verdicts) if v.shape and not v.colour}
    bound = {i for i, v in zip(keep, verdicts) if v.shape and v.colour}
    wrong = {i for i, v in zip(keep, verdicts) if v.bound and not v.position}
    right = {i for i, v in zip(keep, verdicts) if v.bound and v.position}
    report.groups = {
        "bound": len(bound),
        "swapped": len(swapped),
        "relation right": len(right),
        "relation wrong": len(wrong),
    }
    for layer in layers:
        for t in timesteps:
            row = {"layer": layer, "timestep": t}
            for kind in ("colour", "shape"):
                found = per_image.get((layer, t, kind), {})
                a, b = [found[i] for i in bound if i in found], [found[i] for i in swapped if i in found]
                row[f"{kind} leakage, bound"] = float(np.mean(a)) if a else None
                row[f"{kind} leakage, swapped"] = float(np.mean(b)) if b else None
                row[f"{kind} AUC"] = auc(b, a)  # leakage higher where the colours were swapped
            found = per_image.get((layer, t, "relation"), {})
            a, b = [found[i] for i in right if i in found], [found[i] for i in wrong if i in found]
            row["relation share, right"] = float(np.mean(a)) if a else None
            row["relation share, wrong"] = float(np.mean(b)) if b else None
            row["relation AUC"] = auc(a, b)
            report.by_verdict.append(row)


def format_leakage(report: Leakage, top: int = 5) -> str:
    def cell(v):
        return "-" if v is None else f"{v:.3f}"

    everything = [r for r in report.rows if r["layer"] == "all layers"]
    out = [
        format_table(
            ["t", "colour word", "shape word", "relation: share on the left object"],
            [[r["timestep"], cell(r["colour"]), cell(r["shape"]), cell(r["relation"])] for r in everything],
            title=f"{report.model}: attention leakage onto the other object, {report.source} pair images "
            f"(n = {report.images}; all layers; 0 own, 0.5 either, 1 the other)",
        )
    ]
    layers = [r for r in report.rows if r["layer"] != "all layers" and r["colour"] is not None]
    if layers:
        best = sorted(layers, key=lambda r: r["colour"])[:top]
        out.append(
            "\nLeast leakage of colour words: "
            + "; ".join(f"{r['layer'].split('.transformer')[0]} t={r['timestep']} {r['colour']:.3f}" for r in best[:3])
        )
    if report.by_verdict:
        scored = [r for r in report.by_verdict if r["layer"] != "all layers" and r["colour AUC"] is not None]
        rows = sorted(scored, key=lambda r: -abs(r["colour AUC"] - 0.5))[:top]
        out.append("")
        out.append(
            format_table(
                ["layer", "t", "colour leak. bound", "colour leak. swapped", "AUC", "relation AUC"],
                [
                    [
                        r["layer"].split(".transformer")[0],
                        r["timestep"],
                        cell(r["colour leakage, bound"]),
                        cell(r["colour leakage, swapped"]),
                        cell(r["colour AUC"]),
                        cell(r["relation AUC"]),
                    ]
                    for r in rows
                ],
                title="Where the verdicts differ (generated images; groups: "
                + ", ".join(f"{k} {v}" for k, v in report.groups.items())
                + ")",
            )
        )
    out.append(f"({report.seconds:.0f} s)")
    return "\n".join(out)
