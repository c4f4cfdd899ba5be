"""Benchmark: the cost of tracing the cross-attention on the full SD 1.5 U-Net, in one run.

The SD 1.5 architecture (random weights, float32) at a 64x64 latent on this CPU: one forward with
CrossAttentionTrace (statistics only) against one without. Times are interleaved in one process
(median of --repeats each, after a warm-up); peak memory is measured in two fresh child processes
(peak resident set above the baseline, one forward each after a warm-up one, with a fixed glibc
mmap threshold so that freed tensors leave the resident set).
Targets: time ratio <= 1.15, extra peak memory <= 1 % of the U-Net's weights.

    python scripts/bench_condition.py [--repeats 3] [--latent 64]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
from tqdm import tqdm

from sdkit.common import peak_rss
from sdkit.presets import build_unet, preset_config
from sdkit.trace import CrossAttentionTrace


def setup(latent: int):
    unet = build_unet(preset_config("sd15"), weights="random")
    generator = torch.Generator().manual_seed(0)
    sample = torch.randn(1, 4, latent, latent, generator=generator)
    text = torch.randn(1, 77, 768, generator=generator)
    return unet, sample, text


@torch.no_grad()
def forward(unet, sample, text, capture: bool):
    if capture:
        with CrossAttentionTrace(unet) as trace:
            unet(sample, 500, encoder_hidden_states=text)
        return trace.summary()
    return unet(sample, 500, encoder_hidden_states=text)


def child(mode: str, latent: int) -> None:
    unet, sample, text = setup(latent)
    forward(unet, sample, text, mode == "capture")  # warm-up: one-time kernel and allocator setup
    _, peak = peak_rss(lambda: forward(unet, sample, text, mode == "capture"))
    print(json.dumps({"peak": peak}))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--latent", type=int, default=64)
    parser.add_argument("--child", choices=["plain", "capture"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.latent)

    print(
        f"expected duration: about {2 + 2 * args.repeats * (args.latent // 64) ** 2} minutes on 2 CPU cores "
        "(SD 1.5 forward passes of ~20 s each)",
        flush=True,
    )
    bar = tqdm(total=2 + 2 * args.repeats, desc="forward passes", unit="run")
    peaks = {}
    # A fixed mmap threshold: glibc otherwise raises it as blocks are freed and serves later tensors
    # from memory it kept, which hides them from the resident set and makes the peaks wander.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    for mode in ("plain", "capture"):
        proc = subprocess.run(
            [sys.executable, __file__, "--child", mode, "--latent", str(args.latent)],
            capture_output=True,
            text=True,
            check=True,
            env=env,
        )
        peaks[mode] = json.loads(proc.stdout.strip().splitlines()[-1])["peak"]
        bar.update(1)

    unet, sample, text = setup(args.latent)
    weights = sum(p.numel() * p.element_size() for p in unet.parameters())
    forward(unet, sample, text, capture=False)  # warm-up
    times = {"plain": [], "capture": []}
    for _ in range(args.repeats):
        for mode in ("plain", "capture"):
            start = time.perf_counter()
            forward(unet, sample, text, mode == "capture")
            times[mode].append(time.perf_counter() - start)
            bar.update(1)
    bar.close()
    plain, capture = statistics.median(times["plain"]), statistics.median(times["capture"])
    extra = peaks["capture"] - peaks["plain"]
    print(f"SD 1.5 U-Net, {args.latent}x{args.latent} latent, float32, {torch.get_num_threads()} threads")
    print(f"forward without capture: {plain:6.2f} s   peak {peaks['plain'] / 2**20:8.1f} MiB above baseline")
    print(f"forward with capture:    {capture:6.2f} s   peak {peaks['capture'] / 2**20:8.1f} MiB above baseline")
    ratio_ok, memory_ok = capture / plain <= 1.15, extra <= 0.01 * weights
    print(f"{'PASS' if ratio_ok else 'FAIL'}  time ratio {capture / plain:.3f} (target <= 1.15)")
    print(
        f"{'PASS' if memory_ok else 'FAIL'}  extra memory {extra / 2**20:+.1f} MiB = "
        f"{100 * extra / weights:+.2f} % of the weights ({weights / 2**20:.0f} MiB; target <= 1 %)"
    )
    return 0 if ratio_ok and memory_ok else 1


if __name__ == "__main__":
    sys.exit(main())
