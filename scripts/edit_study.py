"""Prompt-to-Prompt judged on the mini SD's answer key: edited, kept and both, per edit set, at
several cross_replace fractions (0 is plain same-seed regeneration of the edited prompt), with the
source's self-attention, local blending, the source's token states or its first steps' latents too,
and a reweighting dose-response on the colour word under the chosen injection (its latents not shared:
the prompt is reweighted against itself, so there is no layout to keep).

    python scripts/edit_study.py                 # writes weights/minisd/findings/editing.json
    python scripts/edit_study.py --count 8 --out out/editing.json   # a quick look, elsewhere

The fraction to recommend is chosen on captions of another seed (the tuning set) than the ones
reported (the evaluation's own captions). Each row is written as soon as it is judged: a stopped
run goes on from the rows its JSON holds.
"""

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FRACTIONS = (0.0, 0.4, 0.8, 1.0)  # 0: the edited prompt regenerated, no injection
SELF = ((0.8, 0.2), (0.8, 0.4))  # (cross_replace, self_replace): P2P with the source's self-attention too
BLEND = (0.4, 0.8, 1.0)  # cross_replace fractions of P2P with local blending on the words the edit changed
STATES = ((1.0, 0.0), (0.8, 0.2))  # (cross_replace, self_replace) with the source's states for unchanged words
# (cross_replace, share_latents): the source's first steps shared, then P2P (or, at 0, nothing injected)
SHARE = ((1.0, 0.1), (1.0, 0.2), (1.0, 0.3), (1.0, 0.4), (1.0, 0.5), (0.0, 0.2))
KEYS = ("cross_replace", "self_replace", "local_blend", "source_states", "share_latents")  # a row's setting
FACTORS = (0.0, 0.5, 1.0, 2.0, 3.0)
TUNING_SEED = 999  # the report's captions are the evaluation's own (sdkit.minisd.EVAL_SET_SEED)


def main() -> int:
    from sdkit.cli import quiet_libraries

    quiet_libraries()  # the library's load bars and logs, as the sdkit command keeps them off stderr
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "weights" / "minisd"))
    parser.add_argument("--count", type=int, default=32, help="prompts per edit set")
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--guidance", type=float, default=None, help="guidance scale (default: the model's own)")
    parser.add_argument("--out", default=None, help="the JSON (default: MODEL/findings/editing.json)")
    args = parser.parse_args()

    from sdkit.common import write_json
    from sdkit.editing import EditSettings
    from sdkit.minisd import EVAL_SET_SEED as REPORT_SEED
    from sdkit.minisd.edit import EDITS, edit_images, edit_set, study_row
    from sdkit.minisd.judge import judge
    from sdkit.minisd.pipeline import MiniSDPipeline

    out = Path(args.out or Path(args.model) / "findings" / "editing.json")
    pipe = MiniSDPipeline.from_pretrained(args.model, encoders_dir=ROOT / "weights" / "encoders")
    guidance = pipe.guidance(args.guidance)
    data = json.loads(out.read_text()) if out.is_file() else {}
    rows = data.get("tuning", []) + data.get("rows", [])
    if (data.get("count"), data.get("steps"), data.get("guidance_scale")) != (args.count, args.steps, guidance) or any(
        k not in r for r in rows for k in (*KEYS, "source_right")
    ):
        data = {}  # rows of another count, step number, guidance or version of the study: start over, never mix
    data.update({"model": args.model, "count": args.count, "steps": args.steps, "guidance_scale": guidance})
    data.setdefault("tuning", [])
    data.setdefault("rows", [])
    data.setdefault("reweight", [])

    def done(rows, **key):
        return any(all(r.get(k) == v for k, v in key.items()) for r in rows)

    def run(rows, kind, setting, seed, label):
        if done(rows, edit=kind, seed=seed, **dict(zip(KEYS, setting))):
            return
        row = study_row(
            pipe, kind, EditSettings(**dict(zip(KEYS, setting))), args.count, args.steps, guidance, seed, label
        )
        rows.append(row)
        write_json(out, data)
        fraction, self_fraction, blend, states, shared = setting
        print(
            f"{label:>8} {kind:>14} cross {fraction:.1f} self {self_fraction:.1f} blend {blend:d} states {states:d} "
            f"shared {shared:.1f}: "
            f"edited {row['edited']:.3f} kept {row['kept']:.3f} both {row['both']:.3f} ({row['seconds']:.0f} s)",
            flush=True,
        )

    # The setting is chosen on the tuning captions' colour swaps (both sets), never on the reported ones.
    settings = [(f, 0.0, False, False, 0.0) for f in FRACTIONS[1:]] + [(c, s, False, False, 0.0) for c, s in SELF]
    settings += [(f, 0.0, True, False, 0.0) for f in BLEND] + [(c, s, False, True, 0.0) for c, s in STATES]
    settings += [(c, 0.0, False, False, k) for c, k in SHARE]
    for kind in ("colour_single", "colour_pair"):
        for setting in settings:
            run(data["tuning"], kind, setting, TUNING_SEED, "tuning")

    def tuned(setting):
        both = [r["both"] for r in data["tuning"] if tuple(r[k] for k in KEYS) == setting]
        return sum(both) / len(both)

    chosen = max(settings, key=tuned)  # the first of equals: the plainest, in the order above
    data.update({f"chosen_{k}": v for k, v in zip(KEYS, chosen)})
    write_json(out, data)
    for kind in EDITS:
        for setting in [(0.0, 0.0, False, False, 0.0), *settings]:
            run(data["rows"], kind, setting, REPORT_SEED, "report")

    # Reweighting: the source prompt against itself, its colour word scaled; how often the colour shows.
    # Shared latents would make the first steps the unweighted prompt's: the reweight acts on the rest.
    reweighting = tuple(0.0 if key == "share_latents" else value for key, value in zip(KEYS, chosen))
    data["reweight_setting"] = list(reweighting)
    write_json(out, data)
    scenes = [s for s, _ in edit_set("colour_single", args.count, seed=REPORT_SEED)]
    for factor in FACTORS:
        if done(data["reweight"], factor=factor, setting=list(reweighting)):
            continue
        shown = []
        for colour in sorted({s.objects[0].colour for s in scenes}):
            group = [s for s in scenes if s.objects[0].colour == colour]
            prompts = [s.caption for s in group]
            reweighted = EditSettings(**dict(zip(KEYS, reweighting)), reweight={colour: factor})
            seeds = [scenes.index(s) for s in group]
            _, images = edit_images(pipe, prompts, prompts, reweighted, seeds, args.steps, guidance)
            shown += [bool(judge(image, scene).colour) for image, scene in zip(images, group)]
        data["reweight"].append(
            {
                "factor": factor,
                "setting": list(reweighting),
                "colour_shown": sum(shown) / len(shown),
                "count": len(shown),
            }
        )
        write_json(out, data)
        print(f"reweight x{factor:g}: colour shown {sum(shown) / len(shown):.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
