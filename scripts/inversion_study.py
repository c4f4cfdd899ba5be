"""Editing real images, judged: the generator's own renders (images no model drew, whose content the
answer key knows) inverted into the latent mini SD, a stock StableDiffusionPipeline, by DDIM
inversion alone and by null-text inversion, then redrawn and colour-swapped with Prompt-to-Prompt;
the null-text inversion's tuned states read by the source branch only (sdkit's default) and by both
branches (the paper's).

    python scripts/inversion_study.py                 # writes weights/minisd/findings/inversion.json
    python scripts/inversion_study.py --count 4 --out out/inversion.json   # a quick look, elsewhere

Per image: the redrawn source judged against its caption and its mean absolute pixel error (beside
the VAE's own round trip, the floor any inversion in its latent space can reach), and each edit
judged edited and kept against the real image. Each (set, inversion) block is written as soon as it
is judged: a stopped run goes on from the blocks its JSON holds. The picture (--picture) draws the
first three pairs under each inversion, inverted again for it, and beside it real-pair.png is the
third pair's render (the docs edit it with `sdkit minisd edit --image`).
"""

import argparse
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# name -> (inner steps tuning the empty prompt's states, the branches that read them)
INVERSIONS = {
    "DDIM inversion": (0, "source"),
    "null-text inversion": (10, "source"),
    "null-text inversion, both branches (the paper's)": (10, "both"),
}
PICTURED = 3  # pairs in the picture
# (label, cross_replace, share_latents): the edited prompt from the inverted start with nothing
# injected, P2P's default and the pixel mini SD's chosen setting (editing.json)
SETTINGS = (
    ("regenerated", 0.0, 0.0),
    ("P2P, cross_replace 0.8", 0.8, 0.0),
    ("P2P, cross_replace 1, shared 0.4", 1.0, 0.4),
)
SETS = {"colour_single": "singles", "colour_pair": "pairs"}


def main() -> int:
    from sdkit.cli import quiet_libraries

    quiet_libraries()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "weights" / "minisd-latent"))
    parser.add_argument("--count", type=int, default=32, help="images per set")
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--guidance", type=float, default=4.0, help="as the latent mini SD is judged")
    parser.add_argument("--out", default=str(ROOT / "weights" / "minisd" / "findings" / "inversion.json"))
    parser.add_argument("--picture", default=None, help="a PNG of the first four pairs (default: none)")
    args = parser.parse_args()

    import numpy as np
    import torch
    from diffusers import StableDiffusionPipeline
    from PIL import Image
    from tqdm.auto import tqdm

    from sdkit.common import write_json
    from sdkit.editing import EditSettings, edit_sd, invert_sd
    from sdkit.minisd import EVAL_SET_SEED
    from sdkit.minisd.data import render
    from sdkit.minisd.edit import edit_set, judge_edit, rates
    from sdkit.minisd.judge import judge

    pipe = StableDiffusionPipeline.from_pretrained(args.model, safety_checker=None)
    pipe.set_progress_bar_config(disable=True)
    side = pipe.unet.config.sample_size * pipe.vae_scale_factor
    out = Path(args.out)
    data = json.loads(out.read_text()) if out.is_file() else {}
    run = {"model": args.model, "count": args.count, "steps": args.steps, "guidance_scale": args.guidance}
    if {k: data.get(k) for k in run} != run:
        data = {**run, "blocks": []}  # blocks of another run's settings are never mixed in
    inversions = {}  # (set, image, inner steps) -> (inversion, seconds): both branch choices read one

    def inverted(set_name, i, scene, image, inner_steps):
        key = (set_name, i, inner_steps)
        if key not in inversions:
            start = time.perf_counter()
            inversion = invert_sd(
                pipe, image[None], scene.caption, args.steps, args.guidance, inner_steps, progress=False
            )
            inversions[key] = inversion, time.perf_counter() - start
        return inversions[key]

    def edit(inversion, branches, scene, target, setting):
        _, cross_replace, share = setting
        settings = EditSettings(cross_replace=cross_replace, share_latents=share)
        return edit_sd(
            pipe,
            scene.caption,
            target.caption,
            settings,
            args.steps,
            args.guidance,
            output_type="np",
            inversion=inversion,
            tuned_states_for=branches,
        )

    for kind, set_name in SETS.items():
        pairs = edit_set(kind, args.count, seed=EVAL_SET_SEED)
        # the jitter the training images have, drawn per image: these are renders, not samples
        images = [render(scene, side, rng=random.Random(i)).image for i, (scene, _) in enumerate(pairs)]
        with torch.no_grad():
            pixels = pipe.image_processor.preprocess(np.stack(images))
            decoded = pipe.vae.decode(pipe.vae.encode(pixels).latent_dist.mean).sample
        vae_error = np.abs(pipe.image_processor.postprocess(decoded, "np") - np.stack(images)).mean((1, 2, 3))
        real_right = sum(bool(judge(image, scene).all) for image, (scene, _) in zip(images, pairs)) / len(pairs)
        for name, (inner_steps, branches) in INVERSIONS.items():
            if any(b["set"] == set_name and b["inversion"] == name for b in data["blocks"]):
                continue
            judged = {label: [] for label, _, _ in SETTINGS}
            redrawn_right, redrawn_error, seconds = [], [], 0.0
            for i, ((scene, target), image) in enumerate(
                tqdm(list(zip(pairs, images)), desc=f"{set_name}, {name}", leave=False)
            ):
                inversion, inversion_seconds = inverted(set_name, i, scene, image, inner_steps)
                seconds += inversion_seconds
                for setting in SETTINGS:
                    redrawn, edited = edit(inversion, branches, scene, target, setting)
                    judged[setting[0]].append(judge_edit(kind, image, edited, scene, target))
                redrawn_right.append(bool(judge(redrawn, scene).all))
                redrawn_error.append(float(np.abs(redrawn - image).mean()))
            block = {
                "set": set_name,
                "edit": kind,
                "inversion": name,
                "inner_steps": inner_steps,
                "tuned_states_for": branches,
                "redrawn_right": sum(redrawn_right) / len(redrawn_right),
                "real_right": real_right,
                "redrawn_error": float(np.mean(redrawn_error)),
                "vae_error": float(vae_error.mean()),
                "inversion_seconds": seconds / len(pairs),
                "edits": [
                    {"setting": label, "cross_replace": c, "share_latents": s, **rates(judged[label])}
                    for label, c, s in SETTINGS
                ],
            }
            data["blocks"].append(block)
            data["blocks"].sort(
                key=lambda b: (list(SETS.values()).index(b["set"]), list(INVERSIONS).index(b["inversion"]))
            )
            write_json(out, data)
            print(
                f"{set_name:>8} {name:>20}: redrawn right {block['redrawn_right']:.3f} error "
                f"{block['redrawn_error']:.4f} (VAE {block['vae_error']:.4f}), {block['inversion_seconds']:.1f} s; "
                + ", ".join(f"{e['setting']} both {e['both']:.3f}" for e in block["edits"]),
                flush=True,
            )
    if args.picture:
        pairs = edit_set("colour_pair", args.count, seed=EVAL_SET_SEED)  # as judged: the inversions are reused
        pictured = []
        for i, (scene, target) in enumerate(pairs[:PICTURED]):
            image = render(scene, side, rng=random.Random(i)).image
            for name, (inner_steps, branches) in INVERSIONS.items():
                inversion, _ = inverted("pairs", i, scene, image, inner_steps)
                redrawn, edited = edit(inversion, branches, scene, target, SETTINGS[-1])
                pictured.append((name, SETTINGS[-1][0], image, redrawn, edited, target.caption))
        draw(pictured, args.picture)
        # the last pictured pair's render, beside the picture: the docs' image for `sdkit minisd edit --image`
        Image.fromarray((image * 255).round().astype(np.uint8)).save(Path(args.picture).with_name("real-pair.png"))
    return 0


def draw(pictured, path) -> None:
    """Rows: a real pair image, its redrawing and its edits, per inversion and setting."""
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from sdkit.common import save_figure

    fig, axes = plt.subplots(len(pictured), 3, figsize=(6, 2 * len(pictured)), dpi=100, squeeze=False)
    for row, (name, label, image, redrawn, edited, caption) in enumerate(pictured):
        for ax, picture, title in zip(
            axes[row], (image, redrawn, edited), ("real (rendered)", f"redrawn, {name}", f"{label}: {caption}")
        ):
            ax.imshow(picture, interpolation="nearest")
            ax.set_title(textwrap.fill(title, 36), fontsize=6)
            ax.axis("off")
    save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())
