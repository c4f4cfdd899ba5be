"""Regenerate the docs' findings from the shipped mini SD, in one run: numbers and pictures.

    python scripts/findings.py [--model weights/minisd] [--pooled-model weights/minisd-pooled] [--count 64]

Runs, on the trained model (each is also one `sdkit` command):
  1. sdkit minisd eval                 judged accuracy against floors, and a panel of samples
  2. sdkit condition --masks           word attention maps against the objects' masks
  3. sdkit condition --generate        one token against many (and the pooled-trained model)
  4. sdkit adapter train --unet MODEL  mpnet (768) -> MiniLM (384) adapters driving the frozen model,
                                       trained on its captions and, apart, on generic prompts
  5. sdkit memory                      attention as key-value memory (random and real keys)
writing JSON and PNGs to weights/minisd/findings/ (the pictures the docs show) and printing each
table. Needs the real encoders (python scripts/get_real_encoders.py). About 35 minutes on 2 CPU
cores; --count 32 takes off about a third.
"""

import argparse
import subprocess
import sys
import time
from pathlib import Path


def run(title: str, argv: list[str]) -> None:
    print(f"\n## {title}\n\n$ sdkit {' '.join(argv)}", flush=True)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "sdkit", *argv], check=False)
    if done.returncode:
        sys.exit(f"findings.py: `sdkit {' '.join(argv)}` failed with exit code {done.returncode}")
    print(f"({time.perf_counter() - start:.0f} s)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="weights/minisd")
    parser.add_argument("--pooled-model", default="weights/minisd-pooled")
    parser.add_argument("--count", type=int, default=64, help="prompts per set")
    parser.add_argument("--out", default=None, help="where to write (default: MODEL/findings)")
    parser.add_argument("--skip", default="", help="comma-separated steps to skip: eval,masks,generate,adapter,memory")
    parser.add_argument("--encoders", default="weights/encoders", help="where the real encoders are")
    args = parser.parse_args()
    out = Path(args.out or Path(args.model) / "findings")
    out.mkdir(parents=True, exist_ok=True)
    skip = set(args.skip.split(","))
    print(f"expected duration: about {25 * args.count // 64 + 10} minutes on 2 CPU cores", flush=True)
    count = str(args.count)
    if "eval" not in skip:
        run(
            "Judged accuracy",
            [
                "minisd",
                "eval",
                "--model",
                args.model,
                "--count",
                count,
                "--panel",
                str(out / "eval.png"),
                "--json-out",
                str(out / "eval.json"),
            ],
        )
    if "masks" not in skip:
        run(
            "Attention against the answer key",
            [
                "condition",
                "--unet",
                args.model,
                "--masks",
                "--count",
                count,
                "--plot",
                str(out / "maps.png"),
                "--json-out",
                str(out / "maps.json"),
            ],
        )
    if "generate" not in skip:
        pooled = ["--pooled-model", args.pooled_model] if Path(args.pooled_model).is_dir() else []
        run(
            "One token against many",
            [
                "condition",
                "--unet",
                args.model,
                "--generate",
                "--count",
                count,
                *pooled,
                "--plot",
                str(out / "tokens.png"),
                "--json-out",
                str(out / "tokens.json"),
            ],
        )
    if "adapter" not in skip:
        mpnet, minilm = (str(Path(args.encoders) / name) for name in ("all-mpnet-base-v2", "all-MiniLM-L6-v2"))
        for corpus, flag in (("captions", ["--captions", "2000"]), ("generic", ["--generate", "2000"])):
            run(
                f"The adapter end to end, trained on {corpus}",
                [
                    "adapter",
                    "train",
                    "--new",
                    mpnet,
                    "--old",
                    minilm,
                    "--unet",
                    args.model,
                    *flag,
                    "--kinds",
                    "linear,mlp,mixer",
                    "--judge",
                    str(max(16, args.count // 2)),
                    "--out",
                    str(out / f"adapters-{corpus}"),
                    "--json-out",
                    str(out / f"adapter-{corpus}.json"),
                ],
            )
    if "memory" not in skip:
        run(
            "Attention as key-value memory",
            [
                "memory",
                "--minisd",
                args.model,
                "--plot",
                str(out / "memory.png"),
                "--json-out",
                str(out / "memory.json"),
            ],
        )
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
