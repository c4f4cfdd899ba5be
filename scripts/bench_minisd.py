"""Benchmark: the mini SD's training loop against a plain eager loop, and the time of one sampling call.

Both loops train the minisd preset on the same batches (the generator's images and captions, the
same noise and timesteps). The plain loop is what a first training script does: float32, eager,
forward, MSE, backward, AdamW step and nothing else. Ours is `sdkit.minisd.train.train` with its
defaults (precision auto: float32 on a CPU, bfloat16 autocast with float32 ends on a GPU that has
it; bmm attention on the CPU; the U-Net compiled, whole in bfloat16 and block by block in float32;
the parameters in one flat tensor for fused AdamW, clipping and EMA; freed memory kept for reuse),
with everything a real run does besides (Min-SNR weighting, gradient clipping, EMA, logging), and on
a CPU also with `--precision bf16` and `bf16-fp32-ends` (on a GPU, `bf16` and `fp32`). Each loop
runs in a fresh process of its own, as a user's script would, so none inherits another's compiled
code or allocator state. Samples/s are steady-state rates, measured after warm-up steps (for ours,
after compilation, whose time is printed apart), in interleaved rounds. It prints the rates, the
ratios and the machine's core count, then times one sampling call of 16 images (DDIM, 25 steps,
guidance: 50 U-Net evaluations of a batch of 16).

Both loops, and the sampling, run on the device train() runs on: the one accelerate picks (CUDA
where present, else the CPU), so the ratio compares like with like on either.

Needs the real text encoder (python scripts/get_real_encoders.py); about 11 minutes on 2 cores.
Where it cannot be had (a GPU machine with no network), `--encoder` may name a stand-in of its
width, `sdkit.encoders.write_tiny_bert_encoder(folder, width=384)`: it only encodes the captions
once, before the clocks start, and a step's work is the U-Net's, which reads the states' width alone.

    python scripts/bench_minisd.py [--steps 50] [--rounds 2] [--encoder FOLDER]
"""

import argparse
import multiprocessing
import os
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

import torch
import torch.nn.functional as F
from tqdm import tqdm

from sdkit.common import synchronize
from sdkit.encoders import load_text_encoder
from sdkit.minisd.data import all_captions
from sdkit.minisd.pipeline import MiniSDPipeline
from sdkit.minisd.train import (
    TrainSettings,
    batch_at,
    encode_captions,
    recipe_unet,
    scheduler_config,
    train,
    training_target,
)
from sdkit.presets import preset_config

WARMUP = 25  # steps before the clock starts (ours: compilation happens in the first of them)


def captions_of(encoder):
    captions = encode_captions(encoder, ["", *all_captions()], "weights/cache", progress=False)
    captions.max_length = TrainSettings().context_length
    return captions


def plain_loop(encoder_path: str, steps: int) -> float:
    """Samples per second of the simplest loop that trains the same model on the same batches."""
    from diffusers import DDPMScheduler

    settings = TrainSettings(steps=WARMUP + steps)
    captions = captions_of(load_text_encoder(encoder_path))
    device = training_device()
    # the recipe's model, schedule and target (its place embeddings, zero terminal SNR and v)
    scheduler = DDPMScheduler.from_config(scheduler_config(settings))
    unet = recipe_unet(preset_config("minisd"), settings).to(device)
    optimizer = torch.optim.AdamW(unet.parameters(), lr=settings.lr)
    for step in range(WARMUP + steps):
        if step == WARMUP:
            synchronize(device)
            began = time.perf_counter()
        pixels, states, noise, timesteps = (t.to(device) for t in batch_at(step, settings, captions)[:4])
        target = training_target(scheduler, pixels, noise, timesteps)
        loss = F.mse_loss(unet(scheduler.add_noise(pixels, noise, timesteps), timesteps, states).sample, target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    synchronize(device)
    return steps * settings.batch_size / (time.perf_counter() - began)


def training_device() -> torch.device:
    """The device train() runs on in a process of its own: the one accelerate picks."""
    from accelerate import PartialState

    return PartialState().device


def our_loop(encoder_path: str, steps: int, out: str, precision: str = "auto") -> tuple[float, float, str]:
    """(steady samples per second, seconds to the end of warm-up, the precision it ran in) of sdkit's own loop."""
    settings = TrainSettings(steps=WARMUP + steps, precision=precision)
    result = train(out, load_text_encoder(encoder_path), settings, cache_dir="weights/cache", progress=False)
    at = {h["step"]: h["seconds"] for h in result.history}  # a history entry every 25 steps
    return steps * settings.batch_size / (at[settings.steps] - at[WARMUP]), at[WARMUP], result.settings["precision"]


def in_a_fresh_process(function, *args):
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(function, *args).result()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50, help="timed steps per loop per round (a multiple of 25)")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds (median reported)")
    parser.add_argument("--encoder", default="weights/encoders/all-MiniLM-L6-v2")
    args = parser.parse_args()
    device = training_device()
    # Where the defaults train in float32 (a CPU), ours also runs in bfloat16: faster on some CPUs,
    # at a cost in what the model learns, none told apart from a run's own draw with the ends in float32
    # (docs/training.md, "Speed"). Where they train in bfloat16 with float32 ends (a GPU), ours also runs in plain
    # bfloat16 and in float32, the precision the shipped model learnt in.
    precisions = ["auto", "bf16", "bf16-fp32-ends"] if device.type == "cpu" else ["auto", "bf16", "fp32"]
    print(f"expected duration: about {args.rounds * (1 + len(precisions)) + 2} minutes on 2 CPU cores", flush=True)
    captions_of(load_text_encoder(args.encoder))  # encoded once into the cache both loops read
    plain = []
    ours = {precision: {"rates": [], "warmups": []} for precision in precisions}
    loops = args.rounds * (1 + len(precisions))
    with tempfile.TemporaryDirectory() as tmp, tqdm(total=loops, desc="rounds", unit="loop") as bar:
        for r in range(args.rounds):
            plain.append(in_a_fresh_process(plain_loop, args.encoder, args.steps))
            bar.update(1)
            for precision, runs in ours.items():
                rate, warmup, runs["ran_in"] = in_a_fresh_process(
                    our_loop, args.encoder, args.steps, f"{tmp}/{precision}{r}", precision
                )
                runs["rates"].append(rate)
                runs["warmups"].append(warmup)
                bar.update(1)
        pipe = MiniSDPipeline.from_pretrained(f"{tmp}/auto0", text_encoder=args.encoder)
    plain_s = statistics.median(plain)
    settings = TrainSettings()
    amx = "with" if torch.cpu._is_amx_tile_supported() else "without"
    on = f", on {torch.cuda.get_device_name(device)}" if device.type == "cuda" else ""
    print(
        f"\ntraining, batch {settings.batch_size}, {args.steps} timed steps x {args.rounds} rounds (median), "
        f"{os.cpu_count()} CPU cores {amx} AMX{on}, torch {torch.__version__}:"
    )
    for precision, runs in ours.items():
        name = "sdkit minisd train" + ("" if precision == "auto" else f" --precision {precision}")
        print(
            f"  {name + ':':47s} {statistics.median(runs['rates']):7.1f} samples/s  (precision {precision} = "
            f"{runs['ran_in']}, compile; Min-SNR, EMA, clipping, logging; first 25 steps incl. compilation: "
            f"{statistics.median(runs['warmups']):.0f} s)"
        )
    print(f"  {'plain eager loop:':47s} {plain_s:7.1f} samples/s  (float32, eager, MSE, AdamW)")
    for precision, runs in ours.items():
        name = "defaults" if precision == "auto" else f"--precision {precision}"
        print(f"  ratio ours ({name}) / plain: {statistics.median(runs['rates']) / plain_s:.2f}")
    prompts = ["a red circle at the top left"] * 16
    pipe.unet.to(device)
    pipe(prompts[:2], num_inference_steps=2, seeds=[0, 1])  # warm-up
    began = time.perf_counter()
    pipe(prompts, num_inference_steps=25, seeds=list(range(16)))  # returns images on the CPU: synchronised
    seconds = time.perf_counter() - began
    print(
        f"\nsampling: one call of 16 images, DDIM 25 steps with guidance: {seconds:.2f} s ({seconds / 16:.3f} s per image)"
    )


if __name__ == "__main__":
    main()
