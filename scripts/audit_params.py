"""Audit several U-Nets (presets, diffusers folders, checkpoint files) into JSON and a paper table.

    python scripts/audit_params.py sd15 sd21 sdxl path/to/model.safetensors --out out/audit
writes out/audit.json (one audit per model) and the table as out/audit.md, out/audit.csv and
out/audit.tex (booktabs). Each model is audited at its native image size (SD 1.5: 512, SD 2.1:
768, SDXL: 1024); the block parts (MLP, self- and cross-attention, norm, proj) add up to the
parameters in the Transformer2D blocks. Seconds for the presets; a header read per file.
"""

import argparse
import sys

from tqdm import tqdm

from sdkit.audit import audit, paper_table
from sdkit.common import SdkitError, write_json, write_text


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("models", nargs="*", default=["sd15", "sd21", "sdxl"], help="presets, folders or files")
    parser.add_argument(
        "--out", default="out/audit", help="path stem for .json, .md, .csv and .tex (default: out/audit)"
    )
    parser.add_argument("--allow-pickle", action="store_true", help="read pickle checkpoints (weights_only=True)")
    args = parser.parse_args()

    audits, failed = [], 0
    for model in tqdm(args.models, desc="audit", unit="model", disable=len(args.models) < 2):
        try:
            audits.append(audit(model, allow_pickle=args.allow_pickle))
        except SdkitError as e:  # one bad file in a folder of checkpoints should not stop the rest
            print(f"audit_params: skipped: {e}", file=sys.stderr)
            failed += 1
    write_json(f"{args.out}.json", [a.to_json() for a in audits])
    for fmt, suffix in (("markdown", "md"), ("csv", "csv"), ("latex", "tex")):
        write_text(f"{args.out}.{suffix}", paper_table(audits, fmt))
    print(paper_table(audits))
    print(f"wrote {args.out}.json, .md, .csv and .tex", file=sys.stderr)
    return 2 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
