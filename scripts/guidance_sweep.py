"""Classifier-free guidance against judged images: each model judged at each guidance scale, on one
draw of captions (64 prompts, DDIM 25 steps, image i from seed i, as `sdkit minisd eval`).

    python scripts/guidance_sweep.py --model "latent, seed 0=weights/minisd-latent" \
        --guidance 1.5,2,2.5,3,4 --set-seed 4321 --sets pairs

A scale chosen on one draw of captions (--set-seed) is reported on another (1234, eval's default),
so the choice is not fitted to the captions it is judged on. Rows are added to --out's JSON (a
row of the same model, scale, draw and set replaces the one it holds); `python
scripts/maintain/tables.py --write` puts its table in docs/latent.md.
"""

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sdkit.common import write_json  # noqa: E402
from sdkit.minisd import EVAL_SET_SEED  # noqa: E402
from sdkit.minisd.evaluate import evaluate  # noqa: E402
from sdkit.minisd.pipeline import MiniSDPipeline  # noqa: E402

OUT = ROOT / "weights" / "minisd" / "findings" / "guidance.json"


def main() -> None:
    from sdkit.cli import quiet_libraries

    quiet_libraries()  # the library's load bars and logs, as the sdkit command keeps them off stderr
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", action="append", required=True, metavar="NAME=FOLDER", help="repeatable")
    parser.add_argument("--guidance", required=True, help="comma-separated scales")
    parser.add_argument("--set-seed", type=int, default=EVAL_SET_SEED, help="draw of the captions (default: eval's)")
    parser.add_argument("--sets", default="pairs", help="comma-separated prompt sets")
    parser.add_argument("--count", type=int, default=64)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    scales = [float(s) for s in args.guidance.split(",") if s]
    sets = [s for s in args.sets.split(",") if s]
    held = json.loads(args.out.read_text())["rows"] if args.out.is_file() else []
    for spec in args.model:
        name, _, folder = spec.partition("=")
        pipe = MiniSDPipeline.from_pretrained(folder)
        for scale in scales:
            ev = evaluate(pipe, sets, args.count, scale, floors=False, model_name=name, set_seed=args.set_seed)
            for set_name in sets:
                judged = ev.results["model"][set_name]
                row = {
                    "model": name,
                    "folder": folder,
                    "guidance": scale,
                    "set_seed": args.set_seed,
                    "set": set_name,
                    "count": ev.counts[set_name],
                    **{key: judged[key] for key in ("all", "colour", "extra", "bound", "position_if_bound")},
                    "all_interval": ev.intervals[set_name]["all"],
                }
                key = ("model", "guidance", "set_seed", "set")
                held = [r for r in held if tuple(r[k] for k in key) != tuple(row[k] for k in key)] + [row]
                print(f"{name} guidance {scale:g} ({set_name}, set seed {args.set_seed}): all {judged['all']:.1%}")
            write_json(args.out, {"steps": 25, "sampler": "ddim", "rows": held})


if __name__ == "__main__":
    main()
