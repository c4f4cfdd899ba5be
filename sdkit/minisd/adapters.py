"""The adapter end to end: a frozen mini SD driven by another text encoder through an adapter.

The mini SD reads all-MiniLM-L6-v2 (384 wide); all-mpnet-base-v2 (768 wide) plays the new
encoder, as OpenCLIP-H (1024) does for SD 1.x (768). Each adapter maps mpnet's token states to
where MiniLM would have put them; here the frozen model draws from the adapted states and the
judge scores the images, against the same prompts and seeds read by the native encoder.
"""

from __future__ import annotations

import random
import time

from ..common import format_table
from ..encoders import TextEncoder
from .data import random_scene
from .evaluate import prompt_set
from .judge import HEADERS, accuracy, accuracy_cells, judge
from .pipeline import MiniSDPipeline, check_images_fit

SETS = ("singles", "pairs", "held_out_singles")


def training_captions(count: int, seed: int = 0) -> list[str]:
    """Captions the mini SD was trained on (never the held-out ones), about 1 % empty like the
    adapter's generic prompts, so the unconditional embedding is learned too."""
    rng = random.Random(f"adapter-captions:{seed}")
    return ["" if rng.random() < 0.01 else random_scene(rng).caption for _ in range(count)]


def judge_adapters(
    pipe: MiniSDPipeline,
    new: TextEncoder,
    adapters: dict,
    sets=SETS,
    count: int = 64,
    guidance_scale: float | None = None,
    steps: int = 25,
    progress=None,
) -> dict:
    """Judged accuracy per method and set: the native encoder, then each adapter on the new one
    (guidance_scale: the model's own by default)."""
    from ..adapter import adapted_embeddings

    if new.max_length != pipe.spec.max_length:
        raise ValueError(f"the new encoder reads {new.max_length} tokens, the mini SD {pipe.spec.max_length}")
    check_images_fit(count, pipe.spec.image_size, "judging")
    guidance_scale = pipe.guidance(guidance_scale)
    start = time.perf_counter()
    results: dict[str, dict] = {"native": {}}
    for set_name in sets:
        scenes = prompt_set(set_name, count)
        captions, seeds = [s.caption for s in scenes], list(range(len(scenes)))
        out = pipe(captions, steps, guidance_scale, seeds=seeds, progress=progress)
        results["native"][set_name] = accuracy([judge(im, s) for im, s in zip(out.images, scenes)])
        for name, adapter in adapters.items():
            embeds = adapted_embeddings(adapter, new, captions)
            negative = adapted_embeddings(adapter, new, [""])
            out = pipe(
                captions,
                steps,
                guidance_scale,
                seeds=seeds,
                prompt_embeds=embeds,
                negative_prompt_embeds=negative,
                progress=progress,
            )
            results.setdefault(name, {})[set_name] = accuracy([judge(im, s) for im, s in zip(out.images, scenes)])
    return {
        "sets": list(sets),
        "count": count,
        "guidance_scale": guidance_scale,
        "steps": steps,
        "results": results,
        "seconds": time.perf_counter() - start,
    }


def format_judged(j: dict, model: str) -> str:
    rows = []
    native = j["results"]["native"]
    for name, by_set in j["results"].items():
        for set_name in j["sets"]:
            acc = by_set[set_name]
            relative = acc["all"] / native[set_name]["all"] if native[set_name]["all"] else float("nan")
            rows.append(
                [
                    name if set_name == j["sets"][0] else "",
                    set_name,
                    *accuracy_cells(acc),
                    "-" if name == "native" else f"{100 * relative:.0f} %",
                ]
            )
    title = (
        f"{model} driven through each adapter: judged accuracy ({j['count']} prompts per set, guidance "
        f"{j['guidance_scale']:g}); 'of native' = all-attributes accuracy relative to the model's own encoder"
    )
    return format_table(["method", "prompts", *HEADERS, "of native"], rows, title=title)
