"""Benchmark: header-only audit against loading the U-Net with diffusers and counting.

Writes a full-size SD 1.5 U-Net (random fp16 weights, original single-file layout, ~1.7 GB) into a
temporary folder, then, in one run:
1. in-process: the header read against diffusers' from_single_file + count (target >= 200x,
   reading under 1 MiB of the file);
2. whole processes, as a user waits for them: `sdkit audit FILE` against a python process that
   loads the file with diffusers and counts (target >= 10x, and `sdkit audit FILE` under 1 s), and
   `sdkit --help` and an argument error (target under 1 s each).
About 2 minutes on 2 CPU cores, most of it writing the 1.7 GB file and diffusers' loads.

    python scripts/bench_audit.py [--repeats 5] [--keep DIR]
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import resources
from pathlib import Path

import torch
from diffusers import UNet2DConditionModel
from safetensors.torch import save_file

from sdkit.audit import audit
from sdkit.checkpoints import ORIGINAL_UNET_PREFIX, diffusers_to_original_names
from sdkit.presets import build_unet, preset_config
from sdkit.tensors import module_index


def bytes_read_by_process() -> int:
    # rchar: bytes this process asked read() for, page cache or not.
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise RuntimeError("no rchar in /proc/self/io")


def write_checkpoint(path: Path) -> int:
    unet = build_unet(preset_config("sd15"), weights="meta")
    shapes = module_index(unet)
    names = diffusers_to_original_names(shapes, unet.config.layers_per_block)
    generator = torch.Generator().manual_seed(0)
    tensors = {
        ORIGINAL_UNET_PREFIX + names[n]: torch.randn(info.shape, generator=generator).half()
        for n, info in shapes.items()
    }
    save_file(tensors, str(path))
    return path.stat().st_size


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--keep", type=Path, help="write the checkpoint here and keep it")
    args = parser.parse_args()
    os.environ["HF_HUB_OFFLINE"] = "1"
    print("expected duration: about 2 minutes on 2 CPU cores (writes a 1.7 GB checkpoint first)", flush=True)

    folder = args.keep or Path(tempfile.mkdtemp(prefix="sdkit-bench-"))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "sd15-random-fp16.safetensors"
    if not path.exists():
        t = time.perf_counter()
        size = write_checkpoint(path)
        print(f"wrote {path} ({size / 1e9:.2f} GB) in {time.perf_counter() - t:.1f} s")
    size = path.stat().st_size

    header_times, header_bytes = [], []
    for _ in range(args.repeats):
        before = bytes_read_by_process()
        t = time.perf_counter()
        result = audit(path)
        header_times.append(time.perf_counter() - t)
        header_bytes.append(bytes_read_by_process() - before)

    config_dir = str(resources.files("sdkit.configs").joinpath("sd15"))
    load_times = []
    for _ in range(max(1, args.repeats // 2)):
        t = time.perf_counter()
        unet = UNet2DConditionModel.from_single_file(str(path), config=config_dir, local_files_only=True)
        loaded_total = sum(p.numel() for p in unet.parameters())
        load_times.append(time.perf_counter() - t)
        del unet

    header_s, load_s = statistics.median(header_times), statistics.median(load_times)
    assert result.total == loaded_total == 859_520_964, (result.total, loaded_total)
    print(f"checkpoint: {size:,} bytes, {result.total:,} parameters counted both ways")
    print(
        f"header-only audit:              {header_s * 1e3:8.1f} ms  (median of {len(header_times)}), "
        f"read {max(header_bytes):,} bytes of the file"
    )
    print(f"diffusers from_single_file+count: {load_s * 1e3:8.1f} ms  (median of {len(load_times)})")
    print(
        f"ratio: header-only is {load_s / header_s:,.0f}x faster "
        f"(target >= 200x), reads {max(header_bytes) / 2**20:.3f} MiB (target < 1 MiB)"
    )
    whole_processes(path, config_dir, args.repeats)
    if not args.keep:
        path.unlink()
        folder.rmdir()


def seconds(argv: list[str], repeats: int, expect: int = 0) -> float:
    """Median wall time of a whole process (start-up, imports and all)."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        done = subprocess.run(argv, capture_output=True, text=True)
        times.append(time.perf_counter() - t)
        assert done.returncode == expect, (argv, done.returncode, done.stderr[-300:])
    return statistics.median(times)


def whole_processes(path: Path, config_dir: str, repeats: int) -> None:
    sdkit = [sys.executable, "-m", "sdkit"]
    load = [
        sys.executable,
        "-c",
        "import sys; from diffusers import UNet2DConditionModel; "
        "m = UNet2DConditionModel.from_single_file(sys.argv[1], config=sys.argv[2], local_files_only=True); "
        "print(sum(p.numel() for p in m.parameters()))",
        str(path),
        config_dir,
    ]
    audit_s = seconds([*sdkit, "audit", str(path)], repeats)
    load_s = seconds(load, max(1, repeats // 2))
    help_s = seconds([*sdkit, "--help"], repeats)
    error_s = seconds([*sdkit, "audit", str(path), "--image-size", "0"], repeats, expect=2)
    missing_s = seconds([*sdkit, "condition", "--unet", "no/such/file.safetensors"], repeats, expect=2)
    print("\nwhole processes (median wall time, start-up included):")
    print(f"  sdkit audit FILE:                   {audit_s:6.2f} s  (target < 1 s)")
    print(f"  python: diffusers load + count:     {load_s:6.2f} s")
    print(f"  ratio: sdkit audit FILE is {load_s / audit_s:.1f}x faster (target >= 10x)")
    print(f"  sdkit --help:                       {help_s:6.2f} s  (target < 1 s)")
    print(f"  argument error (--image-size 0):    {error_s:6.2f} s  (target < 1 s)")
    print(f"  missing --unet file (condition):    {missing_s:6.2f} s  (target < 1 s)")


if __name__ == "__main__":
    main()
