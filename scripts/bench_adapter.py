"""Benchmark: the whole adapter comparison on a real pretrained pair, new = MiniLM -> old = mpnet.

all-MiniLM-L6-v2 (384 wide) stands in for the new encoder, all-mpnet-base-v2 (768 wide) for the
old one the U-Net reads; they tokenize identically (BERT-uncased word pieces). On --prompts
generated prompts (default 2,400): encode and cache, fit lstsq, train linear and mlp, and score
width_only, mean, lstsq, linear and mlp on held-out prompts, with the tiny U-Net (768-wide
cross-attention, random weights) for the noise-prediction check. Then, in the same run: one
training epoch on the cached states against re-encoding the training prompts (target >= 20x).

Run scripts/get_real_encoders.py first.

    python scripts/bench_adapter.py [--prompts 2400] [--encoders weights/encoders] [--json out/bench_adapter.json]
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

from sdkit.adapter import TrainConfig, compare_adapters, format_report, generate_prompts
from sdkit.common import write_json
from sdkit.encoders import load_text_encoder
from sdkit.loading import load_unet


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=2400)
    parser.add_argument("--encoders", type=Path, default=Path("weights/encoders"))
    parser.add_argument("--cache", default="weights/cache")
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args()
    folders = [args.encoders / "all-MiniLM-L6-v2", args.encoders / "all-mpnet-base-v2"]
    if not all((f / "config.json").is_file() for f in folders):
        sys.exit(f"bench_adapter: no real encoders in {args.encoders}; run python scripts/get_real_encoders.py")
    print(
        f"expected duration: about {4 + args.prompts // 300} minutes on 2 CPU cores (encoding, then training)",
        flush=True,
    )
    new, old = (load_text_encoder(f) for f in folders)
    prompts = generate_prompts(args.prompts, seed=0)
    unet = load_unet("tiny")
    report = compare_adapters(
        new, old, prompts, config=TrainConfig(), unet=unet, unet_name="tiny (random weights)", cache_dir=args.cache
    )
    print(format_report(report))
    print(
        "(No U-Net was trained on mpnet's states, and the tiny U-Net's weights are random: its columns show the\n"
        " check working, not how a real SD U-Net would fare. Run `sdkit adapter train --unet` with a real SD 1.5\n"
        " U-Net and CLIP ViT-L/14 as the old encoder for that.)"
    )

    train_prompts = prompts[: report.prompts["train"]]  # as many prompts as the training split holds
    start = time.perf_counter()
    for i in range(0, len(train_prompts), 64):  # what encode_prompts does without its cache
        new.encode(train_prompts[i : i + 64])
        old.encode(train_prompts[i : i + 64])
    encode_seconds = time.perf_counter() - start
    epochs = {kind: statistics.median(h["seconds"] for h in history[1:]) for kind, history in report.histories.items()}
    print(f"\nre-encoding the {len(train_prompts):,} training prompts with both encoders: {encode_seconds:.1f} s")
    for kind, seconds in epochs.items():
        ratio = encode_seconds / seconds
        print(
            f"one {kind} training epoch on cached states ({report.tokens['train']:,} tokens): {seconds:.2f} s "
            f"-> {ratio:.0f}x faster ({'PASS' if ratio >= 20 else 'FAIL'}: target >= 20x)"
        )
    if args.json:
        write_json(args.json, {**report.to_json(), "reencode_seconds": encode_seconds, "epoch_seconds": epochs})


if __name__ == "__main__":
    main()
