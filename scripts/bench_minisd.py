"""Benchmark: the mini SD's training loop against a plain loop, and the time of one sampling call.

Both loops train the minisd preset on the same batches (the generator's images and captions, the
same noise and timesteps) for --steps steps each, interleaved in rounds so that the machine's
mood is shared. Ours is `sdkit.minisd.train.train` (accelerate, Min-SNR weighting, EMA, gradient
clipping, logging); the plain loop is forward, MSE, backward, AdamW step and nothing else. It
prints samples/s for both and their ratio (ours should not be slower), then times one sampling call
of 16 images (DDIM, 25 steps, guidance: 50 U-Net evaluations of a batch of 16).

Needs the real text encoder (python scripts/get_real_encoders.py); about 2 minutes on 2 cores.

    python scripts/bench_minisd.py [--steps 20] [--rounds 2]
"""

import argparse
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

from sdkit.encoders import load_text_encoder
from sdkit.minisd.data import all_captions
from sdkit.minisd.pipeline import SCHEDULER_CONFIG, MiniSDPipeline
from sdkit.minisd.train import TrainSettings, batch_at, encode_captions, train
from sdkit.presets import build_unet, preset_config


def plain_loop(settings: TrainSettings, captions, steps: int, start: int) -> float:
    """Samples per second of the simplest loop that trains the same model on the same batches."""
    from diffusers import DDPMScheduler

    scheduler = DDPMScheduler.from_config(SCHEDULER_CONFIG)
    unet = build_unet(preset_config("minisd"), weights="random", seed=settings.seed).train()
    optimizer = torch.optim.AdamW(unet.parameters(), lr=settings.lr)
    began = time.perf_counter()
    for step in range(start, start + steps):
        pixels, states, noise, timesteps, _ = batch_at(step, settings, captions)
        loss = F.mse_loss(unet(scheduler.add_noise(pixels, noise, timesteps), timesteps, states).sample, noise)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return steps * settings.batch_size / (time.perf_counter() - began)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="steps per loop per round")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds (median reported)")
    parser.add_argument("--encoder", default="weights/encoders/all-MiniLM-L6-v2")
    args = parser.parse_args()
    print(f"expected duration: about {args.rounds * args.steps * 2 // 60 + 1} minutes on 2 CPU cores", flush=True)
    torch.manual_seed(0)
    encoder = load_text_encoder(args.encoder)
    captions = encode_captions(encoder, ["", *all_captions()], "weights/cache", progress=True)
    ours, plain = [], []
    with tempfile.TemporaryDirectory() as tmp, tqdm(total=2 * args.rounds, desc="rounds", unit="loop") as bar:
        for r in range(args.rounds):
            settings = TrainSettings(steps=args.steps)
            plain.append(plain_loop(settings, captions, args.steps, 0))
            bar.update(1)
            result = train(f"{tmp}/run{r}", encoder, settings, cache_dir="weights/cache", progress=False)
            ours.append(result.samples_per_second)
            bar.update(1)
        pipe = MiniSDPipeline.from_pretrained(f"{tmp}/run0", text_encoder=args.encoder)
    ours_s, plain_s = statistics.median(ours), statistics.median(plain)
    print(f"\ntraining, batch {settings.batch_size}, {args.steps} steps x {args.rounds} rounds (median):")
    print(f"  sdkit minisd train: {ours_s:7.1f} samples/s  (accelerate, Min-SNR, EMA, clipping, logging)")
    print(f"  plain loop:         {plain_s:7.1f} samples/s")
    print(f"  ratio ours / plain: {ours_s / plain_s:.3f}")
    prompts = ["a red circle at the top left"] * 16
    pipe(prompts[:2], seeds=[0, 1], steps=2)  # warm-up
    began = time.perf_counter()
    pipe(prompts, seeds=list(range(16)), steps=25)
    seconds = time.perf_counter() - began
    print(f"\nsampling: one call of 16 images, DDIM 25 steps with guidance: {seconds:.2f} s ({seconds / 16:.3f} s per image)")


if __name__ == "__main__":
    main()
