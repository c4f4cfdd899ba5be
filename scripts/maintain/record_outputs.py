"""Record the outputs of a fixed set of commands, or compare them with a recording.

A refactor must not change what the commands print or write. Record before it, compare after:

    python scripts/maintain/record_outputs.py record out/outputs-before
    python scripts/maintain/record_outputs.py compare out/outputs-before

Each command's stdout (the table), its --json-out JSON and the files it writes are kept; timings
(seconds, samples/s, peak memory) are masked, since they differ from run to run. The mini SD sample
needs weights/minisd and its encoder (python scripts/get_real_encoders.py); the adapter demo runs on
tiny encoders built in a scratch folder. About 2 minutes on 2 CPU cores.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# name -> arguments of `sdkit`; {tmp} is a scratch folder, {json} the command's --json-out file
COMMANDS = {
    "audit-sd15": ["audit", "sd15"],
    "audit-minisd": ["audit", "minisd"],
    "scoretable": ["scoretable", "--height", "512", "--width", "768"],
    "condition-tiny": ["condition"],
    "adapter-demo-tiny": [
        "adapter",
        "demo",
        "--encoders-dir",
        "{tmp}/encoders",
        "--out",
        "{tmp}/adapters",
        "--cache",
        "{tmp}/cache",
        "--prompts",
        "120",
        "--epochs",
        "3",
    ],
    "memory-quick": ["memory", "--quick"],
    "minisd-sample": [
        "minisd",
        "sample",
        "a red circle at the top left",
        "--seeds",
        "2",
        "--steps",
        "10",
        "--out",
        "{tmp}/sample.png",
    ],
}
TIMING_KEYS = re.compile(r"(seconds|_s$|per_second|peak|elapsed|time)", re.I)
TIMING_TEXT = re.compile(r"\d[\d,.]*\s?(s|ms|min|samples/s|MiB|GiB|KiB)\b")


def masked(value):
    if isinstance(value, dict):
        return {k: "<timing>" if TIMING_KEYS.search(k) else masked(v) for k, v in value.items()}
    if isinstance(value, list):
        return [masked(v) for v in value]
    return value


def run(name: str, args: list[str], out: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        json_out = Path(tmp) / "out.json"
        argv = [a.replace("{tmp}", tmp) for a in args] + ["--json-out", str(json_out)]
        done = subprocess.run(
            [sys.executable, "-m", "sdkit", *argv],
            capture_output=True,
            text=True,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
        folder = out / name
        folder.mkdir(parents=True, exist_ok=True)
        text = TIMING_TEXT.sub("<timing>", done.stdout.replace(tmp, "{tmp}"))
        (folder / "stdout.txt").write_text(f"exit {done.returncode}\n{text}")
        if json_out.is_file():
            data = json.loads(json_out.read_text().replace(tmp, "{tmp}"))
            (folder / "out.json").write_text(json.dumps(masked(data), indent=1, sort_keys=True))
        for png in Path(tmp).glob("*.png"):
            shutil.copy(png, folder / png.name)


def main() -> int:
    if len(sys.argv) != 3 or sys.argv[1] not in ("record", "compare"):
        print(__doc__)
        return 2
    mode, target = sys.argv[1], Path(sys.argv[2])
    out = target if mode == "record" else Path(tempfile.mkdtemp(prefix="sdkit-outputs-"))
    for name, args in COMMANDS.items():
        print(f"{name} ...", flush=True)
        run(name, args, out)
    if mode == "record":
        print(f"recorded in {out}")
        return 0
    differ = []
    for before in sorted(p for p in target.rglob("*") if p.is_file()):
        after = out / before.relative_to(target)
        if not after.is_file() or after.read_bytes() != before.read_bytes():
            differ.append(str(before.relative_to(target)))
    missing = [
        str(p.relative_to(out)) for p in out.rglob("*") if p.is_file() and not (target / p.relative_to(out)).exists()
    ]
    for name in differ + missing:
        print(f"differs: {name}")
    print("all outputs the same" if not differ and not missing else f"{len(differ) + len(missing)} outputs differ")
    return 1 if differ or missing else 0


if __name__ == "__main__":
    sys.exit(main())
