"""Benchmark: naive vs query-chunked vs SDPA self-attention on this machine, in one run.

SD 1.5's finest self-attention (8 heads of 40, float32 on the CPU) at 4,096, 8,192 and 16,384
tokens (512, ~724 and 1024 px images). Checks, printed as measured:
- naive peak memory within 10 % of the prediction (table plus q, k, v, output) at 4,096 and 8,192;
- at 16,384 tokens chunked peak <= 1/8 of naive's and chunked time <= 1.5x naive's;
- the measured table bytes (naive peak minus q, k, v, output) grow 16x from 4,096 to 16,384.

    python scripts/bench_scoretable.py [--device auto] [--plot out/bench_scoretable.png]
"""

import argparse

from tqdm import tqdm

from sdkit.common import write_json
from sdkit.scoretable import format_measurements, measure, plot, predicted_peak, score_tables

TOKENS = (4096, 8192, 16384)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=40)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--plot", help="also draw the measured points on the analytic lines (PNG)")
    parser.add_argument("--json", help="write the measurements here")
    args = parser.parse_args()

    print("expected duration: about 3 minutes on 2 CPU cores", flush=True)
    results = {}
    with tqdm(total=3 * len(TOKENS), desc="measuring", unit="run") as bar:
        for tokens in TOKENS:
            results[tokens] = {
                m.implementation: m
                for m in measure(
                    tokens, args.heads, args.head_dim, args.dtype, args.device, repeats=args.repeats, progress=bar
                )
            }
    for tokens in TOKENS:
        print(format_measurements(list(results[tokens].values())), end="\n\n")

    checks = []
    for tokens in TOKENS[:2]:
        naive = results[tokens]["naive"]
        off = naive.peak_bytes / naive.predicted_bytes - 1
        checks.append(
            (
                f"naive peak at {tokens:,} tokens within 10 % of prediction",
                abs(off) <= 0.10,
                f"{naive.peak_bytes / 2**20:.1f} MiB measured vs {naive.predicted_bytes / 2**20:.1f} MiB predicted ({off:+.1%})",
            )
        )
    naive, chunked = results[16384]["naive"], results[16384]["chunked"]
    checks.append(
        (
            "chunked peak <= 1/8 of naive's at 16,384 tokens",
            chunked.peak_bytes * 8 <= naive.peak_bytes,
            f"ratio {chunked.peak_bytes / naive.peak_bytes:.4f}",
        )
    )
    checks.append(
        (
            "chunked time <= 1.5x naive's at 16,384 tokens",
            chunked.median_seconds <= 1.5 * naive.median_seconds,
            f"{chunked.median_seconds:.2f} s vs {naive.median_seconds:.2f} s, ratio {chunked.median_seconds / naive.median_seconds:.2f}",
        )
    )

    def table_measured(tokens):  # naive peak minus what is not the table
        tensors = predicted_peak("sdpa", tokens, args.heads, args.head_dim, args.dtype, tokens)
        return results[tokens]["naive"].peak_bytes - tensors

    growth = table_measured(16384) / table_measured(4096)
    checks.append(
        ("measured table grows 16x from 4,096 to 16,384 tokens", abs(growth / 16 - 1) <= 0.10, f"{growth:.2f}x")
    )
    for name, ok, detail in checks:
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}")
    if args.plot:
        plot(score_tables(512), [m for r in results.values() for m in r.values()], args.plot)
        print(f"wrote {args.plot}")
    if args.json:
        from dataclasses import asdict

        write_json(
            args.json,
            {
                "measured": [asdict(m) for r in results.values() for m in r.values()],
                "checks": [{"check": n, "ok": ok, "detail": d} for n, ok, d in checks],
            },
        )
    return 0 if all(ok for _, ok, _ in checks) else 1


if __name__ == "__main__":
    raise SystemExit(main())
