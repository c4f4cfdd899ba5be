"""Audit several U-Nets (presets, diffusers folders, checkpoint files) into JSON and a Markdown table.

    python scripts/audit_params.py sd15 sd21 sdxl path/to/model.safetensors --out out/audit
writes out/audit.json (one audit per model) and out/audit.md.
"""

import argparse
import sys

from tqdm import tqdm

from sdkit.audit import audit
from sdkit.common import SdkitError, write_json, write_text


def markdown(audits) -> str:
    lines = [
        "| model | layout | U-Net params | attention blocks | MLP | self-attention | cross-attention | MLP share |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for a in audits:
        b = a.attention_blocks
        lines.append(
            f"| {a.source} | {a.layout} | {a.total:,} | {b['total']:,} | {b['mlp']:,} | {b['self_attention']:,} "
            f"| {b['cross_attention']:,} | {100 * b['mlp_share']:.1f} % |"
        )
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("models", nargs="*", default=["sd15", "sd21", "sdxl"])
    parser.add_argument("--out", default="out/audit", help="path stem for .json and .md (default: out/audit)")
    parser.add_argument("--allow-pickle", action="store_true")
    args = parser.parse_args()

    audits, failed = [], 0
    for model in tqdm(args.models, desc="audit", unit="model", disable=len(args.models) < 2):
        try:
            audits.append(audit(model, allow_pickle=args.allow_pickle))
        except SdkitError as e:  # one bad file in a folder of checkpoints should not stop the rest
            print(f"audit_params: skipped: {e}", file=sys.stderr)
            failed += 1
    write_json(f"{args.out}.json", [a.to_json() for a in audits])
    write_text(f"{args.out}.md", markdown(audits))
    print(markdown(audits))
    print(f"wrote {args.out}.json and {args.out}.md", file=sys.stderr)
    return 2 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
