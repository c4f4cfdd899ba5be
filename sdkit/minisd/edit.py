"""Prompt-to-Prompt on the mini SD, judged on its answer key.

Edit sets come from the evaluation captions (sdkit.minisd.evaluate.prompt_set), with the same seeds:
a colour swap on single objects, a colour swap of one object in pairs, a shape swap on single
objects, and a relation swap ("left of" <-> "right of") in pairs. The edited caption is the source
scene with one attribute changed, written with the same template, so the two prompts' tokens align.
Each edited image is judged twice: *edited*, the changed attribute reads as the new one (the judge
on the edited scene); *kept*, every other attribute of what the judge finds (each object's place,
shape and the colours not edited, and the number of objects) equals what it finds in the source
image of the same call.
"""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np

from ..common import SdkitError
from ..editing import EditSettings, PromptEdit
from . import EVAL_SET_SEED
from .data import COLOURS, SHAPES, Scene
from .evaluate import prompt_set
from .judge import find_objects, judge
from .pipeline import MiniSDPipeline, check_images_fit

EDITS = ("colour_single", "colour_pair", "shape_single", "relation")
EDIT_NAMES = {
    "colour_single": "colour swap, single objects",
    "colour_pair": "colour swap of one object, pairs",
    "shape_single": "shape swap, single objects",
    "relation": "relation swap (left of <-> right of)",
}


def edited_scene(scene: Scene, kind: str) -> Scene:
    """The scene with one attribute changed (the next colour or shape in order; the other relation),
    written with the same template."""
    first = scene.objects[0]
    if kind in ("colour_single", "colour_pair"):
        colours = list(COLOURS)
        others = {o.colour for o in scene.objects}
        colour = next(c for c in colours[colours.index(first.colour) + 1 :] + colours if c not in others)
        return replace(scene, objects=(replace(first, colour=colour), *scene.objects[1:]))
    if kind == "shape_single":
        return replace(scene, objects=(replace(first, shape=SHAPES[(SHAPES.index(first.shape) + 1) % len(SHAPES)]),))
    if kind == "relation":
        a, b = scene.objects
        relation = "right of" if scene.relation == "left of" else "left of"
        # the objects trade columns: the caption's first object is now on the other side
        return replace(scene, relation=relation, objects=(replace(a, column=b.column), replace(b, column=a.column)))
    raise SdkitError(f"unknown edit {kind!r}; choose from {', '.join(EDITS)}")


def edit_set(kind: str, count: int, seed: int = EVAL_SET_SEED) -> list[tuple[Scene, Scene]]:
    """(source scene, edited scene) pairs of an edit set: the evaluation's singles or pairs."""
    scenes = prompt_set("pairs" if kind in ("colour_pair", "relation") else "singles", count, seed=seed)
    return [(scene, edited_scene(scene, kind)) for scene in scenes]


def edit_images(
    pipe: MiniSDPipeline,
    sources: list[str],
    edits: list[str],
    settings: EditSettings,
    seeds: list[int],
    steps: int = 25,
    guidance_scale: float | None = None,
    pairs_per_batch: int = 16,
    progress=None,
) -> tuple[np.ndarray, np.ndarray]:
    """(source images, edited images), each pair sampled in one batch from its seed's noise, the
    edited branch under Prompt-to-Prompt (guidance_scale: the model's own by default)."""
    if pipe.spec.conditioning != "tokens":
        raise SdkitError("editing reads the cross-attention over a prompt's tokens; this model reads one pooled state")
    if not len(sources) == len(edits) == len(seeds) or not sources:
        raise SdkitError(f"{len(sources)} source prompts need as many edited prompts and seeds")
    check_images_fit(2 * len(sources), pipe.spec.image_size, "editing")
    from ..encoders import token_roles

    encoder = pipe.encoder
    out_sources, out_edits = [], []
    for start in range(0, len(sources), pairs_per_batch):
        part = slice(start, start + pairs_per_batch)
        src, dst, part_seeds = sources[part], edits[part], seeds[part]
        src_ids = encoder.tokenize(src)["input_ids"].tolist()
        dst_ids = encoder.tokenize(dst)["input_ids"].tolist()
        reweights = []
        for prompt in dst:
            words = token_roles(encoder.tokenizer, prompt, encoder.max_length).words
            found = {w: [p for name, ps in words if name == w for p in ps] for w in settings.reweight}
            missing = [w for w, ps in found.items() if not ps]
            if missing:
                raise SdkitError(
                    f"{missing[0]!r} is not a word of {prompt!r}; its words: {', '.join(w for w, _ in words)}"
                )
            reweights.append({w: (found[w], factor) for w, factor in settings.reweight.items()})
        prompts = [p for pair in zip(src, dst) for p in pair]
        with PromptEdit(pipe.unet, src_ids, dst_ids, settings, steps, reweights):
            images = pipe(
                prompts,
                steps,
                guidance_scale,
                seeds=[s for s in part_seeds for _ in (0, 1)],
                batch_size=len(prompts),
                progress=progress,
            ).images
        out_sources.append(images[0::2])
        out_edits.append(images[1::2])
    return np.concatenate(out_sources), np.concatenate(out_edits)


def _objects(image: np.ndarray) -> list[tuple]:
    """What the judge finds, left to right: (colour, shape, row, column) of each object."""
    found = sorted(find_objects(image), key=lambda o: (o.column, o.row))
    return [(o.colour, o.shape, o.row, o.column) for o in found]


def judge_edit(kind: str, source_image, edited_image, source: Scene, edited: Scene) -> dict[str, bool]:
    """edited: the changed attribute reads as the new one (the judge on the edited scene); kept:
    everything else the judge finds in the edited image is what it finds in the source image (the
    number of objects; the edited object's other attribute and place; every other object whole)."""
    verdict = judge(edited_image, edited)
    changed = {"colour_single": "colour", "colour_pair": "colour", "shape_single": "shape", "relation": "position"}[
        kind
    ]
    before, after = _objects(source_image), _objects(edited_image)
    if len(before) != len(after) or not before:
        kept = False
    elif kind == "relation":  # the objects trade places: their colours and shapes stay
        kept = sorted(o[:2] for o in before) == sorted(o[:2] for o in after)
    else:
        # Every object keeps its place, so the two lists (left to right) pair up; at most one object
        # changes, only in the edited attribute, and it is the edited word's: in the source it has
        # the caption's first object's colour (or shape). Found by what it was, not by its index: a
        # source drawn with an extra object leaves the caption's object anywhere in the list.
        edited_attribute = 0 if changed == "colour" else 1  # in (colour, shape, row, column)
        was = getattr(source.objects[0], changed)
        places_kept = all(b[2:] == a[2:] for b, a in zip(before, after))
        differing = [(b, a) for b, a in zip(before, after) if b != a]
        if len(differing) == 1:
            ((b, a),) = differing
            kept = places_kept and b[edited_attribute] == was and b[1 - edited_attribute] == a[1 - edited_attribute]
        else:
            kept = places_kept and not differing
    is_edited = bool(getattr(verdict, changed))
    # an edit of a source the model drew wrong (an extra object, a wrong shape) is measured against
    # that source; whether the source was right says which failures are the edit's own
    source_right = bool(judge(source_image, source).all)
    return {"edited": is_edited, "kept": kept, "both": is_edited and kept, "source_right": source_right}


def rates(judged: list[dict[str, bool]], samples: int = 2000, seed: int = 0) -> dict:
    """Edited, kept and both with 95 % bootstrap intervals; the share of sources judged right, and
    both among the edits of those sources."""
    rng = np.random.default_rng(seed)
    out = {}
    for prefix, chosen in (("", judged), ("right_source_", [j for j in judged if j["source_right"]])):
        if not chosen:
            out.update({f"{prefix}{name}": None for name in ("edited", "kept", "both")})
            continue
        table = np.array([[j["edited"], j["kept"], j["both"]] for j in chosen], dtype=float)
        means = table[rng.integers(0, len(table), (samples, len(table)))].mean(1)
        for k, name in enumerate(("edited", "kept", "both")):
            out[f"{prefix}{name}"] = float(table[:, k].mean())
            low, high = np.percentile(means[:, k], 2.5), np.percentile(means[:, k], 97.5)
            out[f"{prefix}{name}_interval"] = [float(low), float(high)]
    out["source_right"] = sum(j["source_right"] for j in judged) / len(judged)
    return out


def study_row(
    pipe,
    kind: str,
    settings: EditSettings,
    count: int,
    steps: int,
    guidance_scale: float,
    seed: int,
    label: str,
    progress=None,
) -> dict:
    """One row: an edit set under one setting (cross_replace 0 with no reweight is plain same-seed
    regeneration of the edited prompt)."""
    pairs = edit_set(kind, count, seed=seed)
    sources = [s.caption for s, _ in pairs]
    edits = [e.caption for _, e in pairs]
    unchanged = next((a for a, b in zip(sources, edits) if a == b), None)
    if unchanged is not None:
        raise SdkitError(f"the edit of {unchanged!r} changed nothing")
    start = time.perf_counter()
    source_images, edited_images = edit_images(
        pipe, sources, edits, settings, list(range(count)), steps, guidance_scale, progress=progress
    )
    judged = [judge_edit(kind, a, b, s, e) for (s, e), a, b in zip(pairs, source_images, edited_images)]
    return {
        "edit": kind,
        "setting": label,
        "cross_replace": settings.cross_replace,
        "self_replace": settings.self_replace,
        "reweight": settings.reweight,
        "local_blend": settings.local_blend,
        "source_states": settings.source_states,
        "unconditional": settings.unconditional,
        "share_latents": settings.share_latents,
        "seed": seed,
        "seconds": time.perf_counter() - start,
        **rates(judged),
    }


def draw_edits(columns: list[tuple[list, str]], rows: list[str], path, title: str):
    """A PNG: a row per seed (or image), with a column per (images, label): the source, the edited
    prompt regenerated from the same start, and the Prompt-to-Prompt edit, side by side."""
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..common import save_figure

    fig, axes = plt.subplots(
        len(rows),
        len(columns),
        figsize=(2.1 * len(columns), 2.1 * len(rows) + 0.6),
        dpi=110,
        squeeze=False,
        layout="constrained",
    )
    for row, name in enumerate(rows):
        for column, (images, label) in enumerate(columns):
            ax = axes[row, column]
            ax.imshow(images[row], interpolation="nearest")
            ax.set_title(textwrap.fill(f"{label}\n{name}" if row == 0 else name, 34), fontsize=6.5)
            ax.axis("off")
    fig.suptitle(textwrap.fill(title, 30 * len(columns)), fontsize=8)
    save_figure(fig, path)
