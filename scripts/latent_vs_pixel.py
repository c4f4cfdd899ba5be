"""The pixel mini SD and the latent one side by side, on trained models: judged images, training and
sampling cost, the cross-attention's score tables, the U-Net's FLOPs per step and its word maps
against the generator's masks per grid.

    python scripts/latent_vs_pixel.py --pixel weights/minisd --latent weights/minisd-latent \
        --pixel-eval weights/minisd/findings/eval.json --latent-eval weights/minisd-latent/findings/eval.json

Each eval JSON is what `sdkit minisd eval --json-out FILE` writes for that model (64 prompts per
set, 25 DDIM steps: the same prompts and seeds for both; the guidance each was judged at is
recorded, and the table says it: `--guidance 4` judges a latent model as the pixel one). Writes
weights/minisd/findings/latent_vs_pixel.json; `python scripts/maintain/tables.py --write` puts its
table in docs/latent.md.
"""

import argparse
import hashlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sdkit.common import write_json  # noqa: E402
from sdkit.compute import compute  # noqa: E402
from sdkit.localization import generator_set, localize  # noqa: E402
from sdkit.minisd.pipeline import LATENT_DOWNSCALE, MiniSDPipeline, MiniSDSpec  # noqa: E402
from sdkit.minisd.vae import total_training_seconds  # noqa: E402
from sdkit.scoretable import score_tables  # noqa: E402

SETS = ("singles", "pairs", "held_out_pairs")


def maps_by_grid(folder: Path, count: int) -> list[dict]:
    """Word maps against the generator's masks (AUC), per grid the cross-attention runs at: the mean
    over the localization's timesteps, beside the centre prior's (`sdkit condition --masks`)."""
    pipe = MiniSDPipeline.from_pretrained(folder)
    images, scenes, masks = generator_set(count, pipe.spec.image_size)
    report = localize(pipe, images, scenes, masks, model_name=str(folder))
    out = []
    for grid in sorted({r["resolution"] for r in report.rows if r["resolution"] != "all layers"}, reverse=True):
        rows = [r for r in report.rows if r["resolution"] == grid and r["word"]]
        out.append(
            {
                "grid": grid,
                **{
                    name.replace(" ", "_") + "_auc": sum(r[name]["auc"] for r in rows) / len(rows)
                    for name in ("word", "centre prior")
                },
            }
        )
    return out


def content_fingerprint(folder: Path, eval_path: Path) -> str:
    """What a row was measured on: the U-Net's and VAE's weights and the eval JSON, by their bytes."""
    digest = hashlib.sha256()
    for path in sorted(folder.glob("*/*.safetensors")) + [eval_path]:
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def row(folder: Path, eval_path: Path, maps_count: int) -> dict:
    spec = MiniSDSpec.read(folder)
    config = json.loads((folder / "unet" / "config.json").read_text())
    evaluation = json.loads(eval_path.read_text())
    training = spec.training
    settings = training["settings"]
    grid = config["sample_size"]
    flops = compute(str(folder / "unet"), height=spec.image_size, cfg=True, text_tokens=spec.max_length)
    out = {
        "model": str(folder),
        "space": spec.space,
        "image_size": spec.image_size,
        "grid": f"{grid}x{grid}x{config['in_channels']}",
        "judged": {
            name: {
                "all": evaluation["results"]["model"][name]["all"],
                "interval": evaluation["intervals"][name]["all"],
            }
            for name in SETS
        },
        "judged_count": evaluation["counts"]["pairs"],
        "guidance_scale": evaluation["guidance_scale"],
        "pairs_left_right_if_bound": evaluation["results"]["model"]["pairs"]["position_if_bound"],
        "pairs_colour": evaluation["results"]["model"]["pairs"]["colour"],
        "pairs_extra_objects": evaluation["results"]["model"]["pairs"]["extra"],
        "training_steps": settings["steps"],
        "training_batch": settings["batch_size"],
        "training_seconds": training["total_seconds"],
        "training_samples_per_second": training["samples_per_second"],
        "vae_training_seconds": total_training_seconds(training.get("vae")),
        "sampling_seconds_per_image": evaluation["seconds_per_image"]["model"],
        "cross_attention": [
            {"grid": level.grid[0], "layers": level.layers, "entries": level.entries_per_head}
            for level in score_tables(model=str(folder), text_tokens=spec.max_length).cross
            if not level.name.startswith("pixel")
        ],
        "maps": maps_by_grid(folder, maps_count),
        "unet_flops_per_step": flops.total,
    }
    assert spec.space == "pixels" or spec.image_size // LATENT_DOWNSCALE == grid
    return out


def main() -> None:
    from sdkit.cli import quiet_libraries

    quiet_libraries()  # the library's load bars and logs, as the sdkit command keeps them off stderr
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pixel", default="weights/minisd")
    parser.add_argument("--latent", default="weights/minisd-latent")
    parser.add_argument("--pixel-eval", required=True)
    parser.add_argument("--latent-eval", required=True)
    parser.add_argument(
        "--run",
        nargs=3,
        action="append",
        default=[],
        metavar=("NAME", "MODEL", "EVAL"),
        help="a latent training run for the ablation rows: its name, model folder and eval JSON",
    )
    parser.add_argument("--maps-count", type=int, default=64, help="generator images the maps are scored on")
    parser.add_argument("--out", default="weights/minisd/findings/latent_vs_pixel.json")
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="keep the rows --out already holds for the same weights and eval JSON, and its runs, each "
        "replaced by a --run of its name (to add a run without measuring the others again, or "
        "keeping their folders)",
    )
    args = parser.parse_args()
    held = json.loads(Path(args.out).read_text()) if args.reuse and Path(args.out).is_file() else {}
    measured = {r.get("fingerprint"): r for r in held.get("rows", []) + held.get("runs", [])}

    def measure(folder: str, evaluation: str) -> dict:
        # by content, not by path: a model shipped anew keeps its folder's and its eval's names
        fingerprint = content_fingerprint(Path(folder), Path(evaluation))
        kept = measured.get(fingerprint)
        if kept is not None and (kept["model"], kept["evaluation"]) == (folder, evaluation):
            return {k: v for k, v in kept.items() if k != "name"}
        measured_now = row(Path(folder), Path(evaluation), args.maps_count)
        return {**measured_now, "evaluation": evaluation, "fingerprint": fingerprint}

    rows = [measure(args.pixel, args.pixel_eval), measure(args.latent, args.latent_eval)]
    runs = {run["name"]: run for run in held.get("runs", [])}  # empty without --reuse
    for name, model, evaluation in args.run:
        runs[name] = {"name": name, **measure(model, evaluation)}
    runs = list(runs.values())  # held runs in their order, new names after them
    note = "U-Net FLOPs of one sampling step with guidance (two passes)"
    write_json(args.out, {"rows": rows, "runs": runs, "note": note})
    print(json.dumps({"rows": rows, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
