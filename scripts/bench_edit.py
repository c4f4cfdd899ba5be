"""What a Prompt-to-Prompt edit costs against one plain image, measured side by side on the mini SD.

    python scripts/bench_edit.py            # 16 prompts, DDIM 25 steps, guidance 4, 7 rounds

An edit samples two branches (source and edited) in one batch, so the target is at most 2.2x the
time of a plain image. Each round times the same 16 plain images (one call: a U-Net batch of 32
with guidance), then 16 edits and 16 edits with local blending, each in two calls of 8 pairs (the
same U-Net batch of 32), and the 32 images of both prompts sampled plainly, in two calls of 16
(what an edit's two branches cost with no editing) and in one call (a batch of 64: what the
batch's size costs on its own). Each kind's fastest round is its time (the machine's neighbours
only ever add time, and one round's ratio moved from 1.4x to 2.6x on a noisy day); each round's
own ratios are printed too.
"""

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROUNDS = 7


def main() -> int:
    import torch

    from sdkit.editing import EditSettings
    from sdkit.minisd.edit import edit_images, edit_set
    from sdkit.minisd.pipeline import MiniSDPipeline

    pipe = MiniSDPipeline.from_pretrained(ROOT / "weights" / "minisd", encoders_dir=ROOT / "weights" / "encoders")
    pairs = edit_set("colour_pair", 16)
    sources, edits = [s.caption for s, _ in pairs], [e.caption for _, e in pairs]
    seeds = list(range(16))
    settings = {
        "edits": EditSettings(cross_replace=0.8),
        "edits with local blending": EditSettings(cross_replace=0.8, local_blend=True),
    }
    pipe(sources[:2], 2, seeds=seeds[:2])  # warm-up
    doubled = {"32 plain images in two batches of 32": 16, "32 plain images in one batch of 64": 32}
    times = {name: [] for name in ("plain", *settings, *doubled)}
    for round_ in range(ROUNDS):
        start = time.perf_counter()
        pipe(sources, 25, 4.0, seeds=seeds, batch_size=16)
        plain = time.perf_counter() - start
        times["plain"].append(plain)
        line = f"round {round_ + 1}: 16 plain images {plain:.1f} s"
        for name, setting in settings.items():
            start = time.perf_counter()
            edit_images(pipe, sources, edits, setting, seeds, 25, 4.0, pairs_per_batch=8)
            edit = time.perf_counter() - start
            times[name].append(edit)
            line += f", 16 {name} {edit:.1f} s ({edit / plain:.2f}x)"
        for name, batch_size in doubled.items():
            start = time.perf_counter()
            pipe(sources + edits, 25, 4.0, seeds=seeds + seeds, batch_size=batch_size)
            both = time.perf_counter() - start
            times[name].append(both)
            line += f", {name} {both:.1f} s ({both / plain:.2f}x)"
        print(line, flush=True)
    plain = min(times.pop("plain"))
    for name, values in times.items():
        what = "16 plain images" if name in doubled else "a plain image"
        print(
            f"{name}: {'cost' if name in doubled else 'one costs'} {min(values) / plain:.2f}x {what} (fastest "
            f"of {ROUNDS} rounds each: {min(values):.1f} s against {plain:.1f} s; {torch.get_num_threads()} threads)"
        )
    print("target: an edit at most 2.2x a plain image")
    return 0


if __name__ == "__main__":
    sys.exit(main())
