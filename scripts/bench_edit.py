"""What a Prompt-to-Prompt edit costs against one plain image, measured side by side on the mini SD.

    python scripts/bench_edit.py            # 16 prompts, DDIM 25 steps, guidance 4, 3 rounds

An edit samples two branches (source and edited) in one batch, so the target is at most 2.2x the
time of a plain image. Each round times the same 16 plain images, 16 edits (32 images) and 16
edits with local blending; the median round's ratio of each is printed.
"""

import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


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
    ratios = {name: [] for name in settings}
    for round_ in range(3):
        start = time.perf_counter()
        pipe(sources, 25, 4.0, seeds=seeds, batch_size=32)
        plain = time.perf_counter() - start
        line = f"round {round_ + 1}: 16 plain images {plain:.1f} s"
        for name, setting in settings.items():
            start = time.perf_counter()
            edit_images(pipe, sources, edits, setting, seeds, 25, 4.0, pairs_per_batch=16)
            edit = time.perf_counter() - start
            ratios[name].append(edit / plain)
            line += f", 16 {name} {edit:.1f} s ({edit / plain:.2f}x)"
        print(line, flush=True)
    for name, values in ratios.items():
        print(
            f"{name}: one costs {statistics.median(values):.2f}x a plain image (median of 3 rounds; target at "
            f"most 2.2x; {torch.get_num_threads()} threads)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
