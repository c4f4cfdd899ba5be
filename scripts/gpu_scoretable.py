"""On a CUDA machine, in one run of a few minutes: what attention at latent and pixel scale costs.

1. SD 1.5's finest latent level (4,096 tokens, 8 heads of 40, float16): naive vs chunked vs SDPA.
2. The largest naive attention (one float16 head) that fits in the free memory, run to confirm.
3. The pixel level of a 512x512 image (262,144 tokens, one head) with SDPA (flash), timed.
All written as JSON (default out/gpu_scoretable.json).

    python scripts/gpu_scoretable.py
    python scripts/gpu_scoretable.py --device cpu --latent-tokens 256 --pixel-tokens 1024 --budget 64MiB  # logic check
"""

import argparse
import platform
import sys
import time
from dataclasses import asdict

import torch

from sdkit.common import SdkitError, parse_bytes, write_json
from sdkit.scoretable import format_measurements, free_bytes, largest_naive_tokens, measure, resolve_device


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--latent-tokens", type=int, default=4096)
    parser.add_argument("--pixel-tokens", type=int, default=512 * 512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=40)
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--budget", type=parse_bytes, help="memory to allow (default: the device's free memory)")
    parser.add_argument("--out", default="out/gpu_scoretable.json")
    args = parser.parse_args(argv)
    if args.device == "auto" and not torch.cuda.is_available():
        print(
            "gpu_scoretable.py: error: this machine has no CUDA device (for a logic check on the CPU, pass "
            "--device cpu with small --latent-tokens / --pixel-tokens / --budget)",
            file=sys.stderr,
        )
        sys.exit(2)
    try:
        device = resolve_device(args.device)
    except SdkitError as e:
        print(f"gpu_scoretable.py: error: {e}", file=sys.stderr)
        sys.exit(2)
    print("expected duration: a few minutes on a CUDA GPU", flush=True)
    start = time.perf_counter()
    report = {
        "device": device,
        "torch": torch.__version__,
        "host": platform.node(),
        "gpu": torch.cuda.get_device_name(device) if device.startswith("cuda") else None,
    }

    latent = measure(args.latent_tokens, args.heads, args.head_dim, args.dtype, device, budget=args.budget)
    print(format_measurements(latent), end="\n\n")
    report["latent"] = [asdict(m) for m in latent]

    # Leave a tenth of the memory for the allocator's own blocks and the kernels' workspaces.
    available = int(0.9 * (args.budget or free_bytes(device)))
    tokens = largest_naive_tokens(1, args.head_dim, args.dtype, available)
    largest = []
    while tokens > 0 and not (largest and largest[-1].peak_bytes):
        largest.append(
            measure(tokens, 1, args.head_dim, args.dtype, device, ("naive",), budget=args.budget, repeats=1)[0]
        )
        tokens -= 1024 * max(1, tokens // 1024 // 10)  # step down if it did not run after all
    print(format_measurements(largest), end="\n\n")
    report["largest_naive"] = [asdict(m) for m in largest]

    pixel = measure(
        args.pixel_tokens, 1, args.head_dim, args.dtype, device, ("sdpa", "chunked"), budget=args.budget, repeats=3
    )
    print(format_measurements(pixel), end="\n\n")
    report["pixel"] = [asdict(m) for m in pixel]
    report["seconds"] = time.perf_counter() - start
    write_json(args.out, report)
    print(f"wrote {args.out} in {report['seconds']:.0f} s")
    return report


if __name__ == "__main__":
    main()
