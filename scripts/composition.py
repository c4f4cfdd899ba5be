"""Where the mini SD loses composition, and what steering wins back: the docs' Composition page.

    python scripts/composition.py [--model weights/minisd] [--count 64] [--skip probe,leakage,order,noise,steering,picture]

Writes to MODEL/findings/ and prints each table:
  probe.json                   linear probes of the token states (all-MiniLM-L6-v2 and all-mpnet-base-v2,
                               last and penultimate layers): is binding and left/right in the text the
                               U-Net reads? And the layout
                               probe: one cross-attention from two place queries reading both sides
  leakage.json, leakage.png    attention leakage per layer and timestep, generator pair images and the
                               model's own, split by the judge's verdict
  order.json                   what the relation word does to the image each sampling step predicts:
                               each pair sampled with "left of" and with "right of" from one seed
  caption_vs_noise.json        whose order the predicted image takes, the caption's or the noised
                               image's: each pair noised as drawn and with its objects exchanged
  steering.json                each steering objective alone and combined, on the same prompts and
                               seeds as unsteered sampling (singles and pairs), with 95 % intervals;
                               the best of them also on the held-out pairs
  composition.png              the same seeds unsteered and steered, with both objects' shape-word maps
Needs the real encoders (python scripts/get_real_encoders.py). The steering part alone took 38
minutes on 2 CPU cores; a stopped run started again goes on from its next steering row.
"""

import argparse
import hashlib
import json
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import torch

from sdkit.common import save_figure, write_json
from sdkit.encoders import load_text_encoder
from sdkit.minisd.evaluate import evaluate, format_evaluation, prompt_set
from sdkit.minisd.pipeline import MiniSDPipeline
from sdkit.steering import SteeringSettings

# Each objective alone, then the combinations worth trying; the best on pairs is the docs' (docs/commands/steering.md).
STEERING_ROWS = (
    ("excite",),
    ("bind",),
    ("layout",),
    ("layout", "bind"),
    ("excite", "layout"),
    ("excite", "bind", "layout"),
)
MAP_TIMESTEP = 300  # the maps drawn in composition.png: the final image noised to here


def probe(encoders: Path, out: Path) -> None:
    from sdkit.minisd.probe import format_probe, run_probe

    reports = [
        run_probe(load_text_encoder(str(encoders / name), layer=layer))
        for name in ("all-MiniLM-L6-v2", "all-mpnet-base-v2")
        for layer in ("last", "penultimate")
    ]
    print(format_probe(reports), flush=True)
    write_json(out / "probe.json", {"reports": [r.to_json() for r in reports]})


def leakage(pipe, model: str, count: int, out: Path) -> None:
    from sdkit.localization import generator_set
    from sdkit.minisd.leakage import format_leakage, generated_pairs, measure

    images, scenes, masks = generator_set(2 * count, pipe.spec.image_size)  # half of them pairs
    on_generator = measure(pipe, images, scenes, masks, model_name=model, source="generator")
    images, scenes, masks, verdicts = generated_pairs(pipe, count)
    on_generated = measure(pipe, images, scenes, masks, verdicts=verdicts, model_name=model, source="generated")
    for report in (on_generator, on_generated):
        print(format_leakage(report), flush=True)
    write_json(out / "leakage.json", {"generator": on_generator.to_json(), "generated": on_generated.to_json()})
    draw_leakage(on_generator, on_generated, out / "leakage.png")


def order(pipe, model: str, count: int, out: Path) -> None:
    from sdkit.minisd.trajectory import format_relation_steps, relation_by_step

    result = relation_by_step(pipe, count, model_name=model)
    print(format_relation_steps([result]), flush=True)
    write_json(out / "order.json", result.to_json())


def caption_vs_noise(pipe, model: str, count: int, out: Path) -> None:
    from sdkit.minisd.trajectory import caption_against_noise, format_caption_against_noise

    result = caption_against_noise(pipe, count, model_name=model)
    print(format_caption_against_noise(result), flush=True)
    write_json(out / "caption_vs_noise.json", result.to_json())


def draw_leakage(on_generator, on_generated, path) -> None:
    """Heat maps, layer x timestep: colour-word leakage on generator and generated pairs, and how well
    colour leakage and the relation word's share tell right verdicts from wrong (AUC)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = [r["layer"] for r in on_generator.rows if r["timestep"] == on_generator.timesteps[0]]
    timesteps = on_generator.timesteps

    def grid(rows, key):
        by = {(r["layer"], r["timestep"]): r[key] for r in rows}
        return np.array(
            [[np.nan if by.get((layer, t)) is None else by[(layer, t)] for t in timesteps] for layer in layers]
        )

    panels = [
        (grid(on_generator.rows, "colour"), "colour-word leakage\ngenerator pairs", (0, 1)),
        (grid(on_generated.rows, "colour"), "colour-word leakage\nmodel's pairs", (0, 1)),
        (grid(on_generated.by_verdict, "colour AUC"), "colour leakage AUC\nswapped vs bound", (0.3, 0.7)),
        (grid(on_generated.by_verdict, "relation AUC"), "relation-word share AUC\nright vs wrong", (0.3, 0.7)),
    ]
    fig, axes = plt.subplots(
        1, len(panels), figsize=(3.3 * len(panels) + 2.5, 0.42 * len(layers) + 1.6), dpi=110, sharey=True
    )
    for ax, (values, title, limits) in zip(axes, panels):
        image = ax.imshow(values, cmap="coolwarm", vmin=limits[0], vmax=limits[1], aspect="auto")
        for (r, c), v in np.ndenumerate(values):
            if not np.isnan(v):
                ax.text(c, r, f"{v:.2f}", ha="center", va="center", fontsize=6.5)
        ax.set_xticks(range(len(timesteps)), [str(t) for t in timesteps], fontsize=7)
        ax.set_xlabel("timestep", fontsize=7)
        ax.set_title(title, fontsize=8)
        fig.colorbar(image, ax=ax, fraction=0.05)
    axes[0].set_yticks(range(len(layers)), [layer.split(".transformer")[0] for layer in layers], fontsize=7)
    groups = ", ".join(f"{k} {v}" for k, v in on_generated.groups.items())
    fig.suptitle(
        f"{on_generator.model}: where colour words leak onto the other object (0 own, 0.5 either, 1 the "
        f"other) and which layers tell the judge's verdicts apart (AUC 0.5: not at all; images: {groups})",
        fontsize=8,
    )
    save_figure(fig, path)


def steering(pipe, model: str, count: int, scale: float, steps: int, out: Path) -> dict:
    # A row takes up to 8 minutes on 2 CPU cores: each finished row is kept in a partial file, so a
    # stopped run started again on the same weights and settings goes on from the next row.
    weights = Path(model) / "unet" / "diffusion_pytorch_model.safetensors"
    header = {
        "model": model,
        "weights_sha256": hashlib.sha256(weights.read_bytes()).hexdigest(),
        "count": count,
        "scale": scale,
        "steps": steps,
    }
    partial = out / "steering.partial.json"
    done = json.loads(partial.read_text()) if partial.is_file() else {}
    done_rows = done.get("rows", []) if done.get("header") == header else []
    rows = []
    for objectives in STEERING_ROWS:
        kept = [r for r in done_rows if r["objectives"] == list(objectives)]
        if kept:
            print(f"{'+'.join(objectives)}: kept from {partial}", flush=True)
            rows.append(kept[0])
            continue
        settings = SteeringSettings(objectives=objectives, scale=scale, steps=steps)
        ev = evaluate(pipe, ("singles", "pairs"), count, floors=False, model_name=model, steering=settings)
        print(format_evaluation(ev), flush=True)
        row = {
            "objectives": list(objectives),
            "steered": ev.results["model"],
            "unsteered": ev.results["unsteered"],
            "intervals": ev.intervals,
            "seconds_per_image": ev.seconds_per_image,
            "changed": ev.changed,
            "verdicts": ev.verdicts,
        }
        rows.append(row)
        write_json(partial, {"header": header, "rows": rows})
    best = max(rows, key=lambda r: r["steered"]["pairs"]["all"])  # the first of equals, as listed
    # The rows' scale and steps were chosen on these pair prompts; pairs never seen in training, and not
    # in that choice, say whether the best steering's gain holds beyond them.
    settings = SteeringSettings(objectives=tuple(best["objectives"]), scale=scale, steps=steps)
    ev = evaluate(pipe, ("held_out_pairs",), count, floors=False, model_name=model, steering=settings)
    print(format_evaluation(ev), flush=True)
    held_out = {
        "steered": ev.results["model"]["held_out_pairs"],
        "unsteered": ev.results["unsteered"]["held_out_pairs"],
        "intervals": ev.intervals["held_out_pairs"],
        "changed": ev.changed["held_out_pairs"],
    }
    result = {
        "model": model,
        "count": count,
        "scale": scale,
        "steps": steps,
        "sampler": "ddim",
        "sampling_steps": 25,
        "guidance_scale": ev.guidance_scale,
        "rows": rows,
        "best": best["objectives"],
        "best_on_held_out_pairs": held_out,
    }
    print(f"best on pairs: {'+'.join(result['best'])} (the docs' table: python scripts/maintain/tables.py steering)")
    write_json(out / "steering.json", result)
    partial.unlink()
    return result


def word_maps(pipe, image: np.ndarray, scene) -> list[np.ndarray]:
    """Each object's shape-word map on an image noised to MAP_TIMESTEP, all layers."""
    from sdkit.encoders import token_roles
    from sdkit.localization import _noised, object_words
    from sdkit.minisd.data import to_model
    from sdkit.trace import CrossAttentionTrace

    pixels = torch.from_numpy(to_model(image))[None]
    with torch.no_grad(), CrossAttentionTrace(pipe.unet, maps=True) as trace:
        pipe.unet(
            pipe.model_input(_noised(pipe, pixels, MAP_TIMESTEP, 0)),
            MAP_TIMESTEP,
            encoder_hidden_states=pipe.encode([scene.caption]),
        )
    maps = trace.token_maps(item=0, size=image.shape[:2])
    words = object_words(token_roles(pipe.encoder.tokenizer, scene.caption, pipe.spec.max_length), scene.objects)
    return [maps[w["positions"]].sum(0).numpy() for w in words if w["kind"] == "shape"]


def draw_composition(pipe, result: dict, path, shown: int = 4) -> None:
    """Unsteered against steered (the best objectives) on the same seeds, each with both shape-word maps:
    the first pairs the best steering turns from wrong to right, then others."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    best = next(r for r in result["rows"] if r["objectives"] == result["best"])
    steered_right = [v["all"] for v in best["verdicts"]["pairs"]]
    scenes = prompt_set("pairs", result["count"])
    order = sorted(range(result["count"]), key=lambda i: not steered_right[i])[:shown]
    captions, seeds = [scenes[i].caption for i in order], order
    settings = SteeringSettings(objectives=tuple(result["best"]), scale=result["scale"], steps=result["steps"])
    from sdkit.minisd.steer import caption_guides

    steps, guidance = result["sampling_steps"], result["guidance_scale"]
    plain = pipe(captions, steps, guidance, seeds=seeds).images
    steered = pipe(
        captions,
        steps,
        guidance,
        seeds=seeds,
        steering=settings,
        guides=caption_guides(pipe.encoder, captions, pipe.spec.image_size),
    ).images
    fig, axes = plt.subplots(len(order), 6, figsize=(9.5, 1.75 * len(order) + 0.6), dpi=110, squeeze=False)
    for r, i in enumerate(order):
        for c, (name, images) in enumerate((("unsteered", plain), ("+".join(result["best"]), steered))):
            maps = word_maps(pipe, images[r], scenes[i])
            names = [f"'{o.shape}' ({o.colour})" for o in scenes[i].objects]  # the word, and which object
            panels = [(images[r], name), *zip(maps, names)]
            for k, (picture, title) in enumerate(panels):
                ax = axes[r, 3 * c + k]
                ax.imshow(picture, interpolation="nearest", cmap=None if k == 0 else "magma")
                ax.set_title(title, fontsize=7)
                ax.axis("off")
        axes[r, 0].text(
            -0.1,
            0.5,
            textwrap.fill(scenes[i].caption, 20),
            transform=axes[r, 0].transAxes,
            ha="right",
            va="center",
            fontsize=6.5,
        )
    title = (
        f"{result['model']}: the same seeds unsteered and steered by {'+'.join(result['best'])}, with each "
        f"shape word's attention (all layers, the image noised to t={MAP_TIMESTEP})"
    )
    # wrapped to the figure's width (about 16 characters an inch at this size), not run off its edge
    fig.suptitle(textwrap.fill(title, int(16 * fig.get_figwidth())), fontsize=8)
    save_figure(fig, path)


def main() -> int:
    from sdkit.cli import quiet_libraries

    quiet_libraries()  # the library's load bars and logs, as the sdkit command keeps them off stderr
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="weights/minisd")
    parser.add_argument("--count", type=int, default=64, help="prompts per set")
    parser.add_argument("--scale", type=float, default=40.0, help="steering scale")
    parser.add_argument("--steering-steps", type=int, default=15, help="steer the first this many of 25 steps")
    parser.add_argument("--out", default=None, help="where to write (default: MODEL/findings)")
    parser.add_argument(
        "--skip", default="", help="comma-separated parts to skip: probe,leakage,order,noise,steering,picture"
    )
    parser.add_argument("--encoders", default="weights/encoders", help="where the real encoders are")
    args = parser.parse_args()
    out = Path(args.out or Path(args.model) / "findings")
    out.mkdir(parents=True, exist_ok=True)
    skip = set(args.skip.split(","))
    start = time.perf_counter()
    if "probe" not in skip:
        probe(Path(args.encoders), out)
    pipe = MiniSDPipeline.from_pretrained(args.model, encoders_dir=args.encoders)
    pipe.unet.eval()
    if "leakage" not in skip:
        leakage(pipe, args.model, args.count, out)
    if "order" not in skip:
        order(pipe, args.model, args.count, out)
    if "noise" not in skip:
        caption_vs_noise(pipe, args.model, args.count, out)
    if "steering" not in skip:
        result = steering(pipe, args.model, args.count, args.scale, args.steering_steps, out)
    if "picture" not in skip:
        result = json.loads((out / "steering.json").read_text())
        draw_composition(pipe, result, out / "composition.png")
    print(f"\nwrote {out} ({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
