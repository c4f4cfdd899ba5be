"""Benchmark: the VAE's encode as latent training does it (`scaled_latents`, channels-last) against the
plain call (`vae.encode(pixels)`, the pixels as they come), on a training batch of the generator's
images.

Both encode the same batch with the same VAE in one process, in interleaved rounds; it prints each
one's median time, the ratio, and how far apart their latents are (the convolutions sum in another
order). On a GPU both run there.

    python scripts/bench_vae_encode.py [--vae weights/minisd-latent/vae] [--batch 32] [--rounds 5]
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sdkit.common import synchronize  # noqa: E402
from sdkit.minisd.data import sample_at, to_model  # noqa: E402
from sdkit.minisd.pipeline import load_vae, scaled_latents  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vae", default="weights/minisd-latent/vae")
    parser.add_argument("--batch", type=int, default=32, help="images per encode (training's batch)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    vae = load_vae(args.vae).to(device).eval().requires_grad_(False)
    side = vae.config.sample_size
    images = [to_model(sample_at(0, i, side, 0.5).image) for i in range(args.batch)]
    pixels = torch.from_numpy(np.stack(images)).to(device)

    def plain():
        return vae.encode(pixels).latent_dist.mean * vae.config.scaling_factor

    def ours():
        return scaled_latents(vae, pixels)

    times = {"plain": [], "channels-last": []}
    with torch.no_grad():
        difference = plain() - ours()  # also the warm-up
        for _ in range(args.rounds):
            for name, encode in (("plain", plain), ("channels-last", ours)):
                began = time.perf_counter()
                encode()
                synchronize(device)
                times[name].append(time.perf_counter() - began)
    plain_s, ours_s = (statistics.median(times[name]) for name in ("plain", "channels-last"))
    print(f"{device}, {torch.get_num_threads()} threads, {args.batch} images of {side} px, {args.rounds} rounds")
    print(f"plain vae.encode      {plain_s * 1000:7.1f} ms")
    print(f"scaled_latents        {ours_s * 1000:7.1f} ms   {plain_s / ours_s:.2f}x")
    print(f"latents apart         {difference.pow(2).mean().sqrt():.1e} RMS, {difference.abs().max():.1e} at most")


if __name__ == "__main__":
    main()
