"""How long the docs' commands keep a person waiting in silence, on a terminal.

    python scripts/maintain/silence.py                    # every runnable `sdkit` command of the docs
    python scripts/maintain/silence.py --only minisd      # those whose text contains "minisd"
    python scripts/maintain/silence.py --cap 120 --json   # stop each after 120 s (what it showed so far counts)
    python scripts/maintain/silence.py --cap 900 --json-out weights/minisd/findings/timings.json   # the docs' timings

Each command runs under a pseudo-terminal (stdout and stderr both on it, 120 columns), in a scratch
folder that sees this checkout's weights/, so its pictures land there and not in the checkout. What
is measured is the time to its first output and the longest stretch without any output (a progress
bar's redraw counts; silence until the exit counts too). Commands that name files that are not here
(path/to/..., ~/models/...) are skipped. The target (issue 18): first output within 2 s, no
silence over 5 s. Each command starts cold (a new Python process: start-up, imports, loading
included); caches it fills are its own (a fresh $SDKIT_CACHE per run), so nothing is warm.
"""

import argparse
import json
import os
import re
import select
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PLACEHOLDERS = ("path/to/", "~/")


def docs_commands() -> list[str]:
    """The `sdkit ...` lines of the bash blocks of README.md and docs/, continuations joined,
    comments dropped."""
    commands = []
    text = "".join(page.read_text() for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))])
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if line.startswith("sdkit ") or line == "sdkit":
                commands.append(" ".join(line.split()))
    return list(dict.fromkeys(commands))


def watch(command: str, cwd: Path, cap: float) -> dict:
    """Run `command` on a pseudo-terminal; when each chunk of output came, and how it ended."""
    import fcntl
    import struct
    import termios

    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    sdkit = str(Path(sys.executable).with_name("sdkit"))
    argv = [sdkit, *shlex.split(command)[1:]]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "120"}
    start = time.monotonic()
    process = subprocess.Popen(
        argv, cwd=cwd, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, env=env, start_new_session=True
    )
    os.close(slave)
    times, tail = [], b""
    while True:
        ready, _, _ = select.select([master], [], [], 0.05)
        now = time.monotonic() - start
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the terminal closed: the command is gone
                chunk = b""
            if not chunk:
                break
            times.append(now)
            tail = (tail + chunk)[-2000:]
        elif process.poll() is not None:
            break
        if now > cap:
            process.terminate()
            break
    process.wait()
    end = time.monotonic() - start
    os.close(master)
    marks = [0.0, *times, end]
    return {
        "command": command,
        "seconds": round(end, 1),
        "finished": end <= cap,
        "exit": process.returncode,
        "first_output": round(times[0], 1) if times else None,
        "longest_silence": round(max(b - a for a, b in zip(marks, marks[1:])), 1),
        "last_output": tail.decode(errors="replace").replace("\r", "\n").strip().splitlines()[-1:],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="run only commands containing this text")
    parser.add_argument(
        "--skip", action="append", default=[], help="leave out commands containing this text (repeatable)"
    )
    parser.add_argument("--cap", type=float, default=180.0, help="seconds each command may run (default 180)")
    parser.add_argument("--json", action="store_true", help="the rows as JSON")
    parser.add_argument(
        "--json-out",
        help="also write the rows, with the machine they ran on, to this file (with "
        "--only or --skip, the rows of the commands left out are kept from it)",
    )
    args = parser.parse_args()
    if not shutil.which("sdkit", path=str(Path(sys.executable).parent)):
        sys.exit("silence.py: no sdkit command beside this Python; pip install . first")
    commands = [c for c in docs_commands() if args.only in c and not any(p in c for p in (*PLACEHOLDERS, *args.skip))]
    rows = []
    with tempfile.TemporaryDirectory(prefix="sdkit-silence-") as scratch:
        (Path(scratch) / "weights").symlink_to(ROOT / "weights")
        for i, command in enumerate(commands):
            os.environ["SDKIT_CACHE"] = str(Path(scratch) / f"cache-{i}")
            rows.append(watch(command, Path(scratch), args.cap))
            if not args.json:
                r = rows[-1]
                print(
                    f"{r['first_output']!s:>6} s first  {r['longest_silence']:>6} s silent  {r['seconds']:>7} s "
                    f"{'' if r['finished'] else '(capped) '}exit {r['exit']}  {command}",
                    flush=True,
                )
    if args.json:
        print(json.dumps(rows, indent=2))
    if args.json_out:
        import platform

        import torch

        machine = {
            "cpus": os.cpu_count(),
            "processor": platform.processor() or platform.machine(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        }
        out, written = Path(args.json_out), rows
        if (args.only or args.skip) and out.is_file():  # a partial run updates its own rows only
            ran = {r["command"] for r in rows}
            kept = [r for r in json.loads(out.read_text())["rows"] if r["command"] not in ran]
            order = {c: i for i, c in enumerate(docs_commands())}
            written = sorted(kept + rows, key=lambda r: order.get(r["command"], len(order)))
        out.write_text(json.dumps({"machine": machine, "cap_seconds": args.cap, "rows": written}, indent=2) + "\n")
    late = [r for r in rows if r["first_output"] is None or r["first_output"] > 2 or r["longest_silence"] > 5]
    if not args.json:
        print(f"\n{len(rows) - len(late)} of {len(rows)} commands speak within 2 s and are never silent for over 5 s")
        for r in late:
            print(f"  late: {r['command']}")
    return 1 if late else 0


if __name__ == "__main__":
    sys.exit(main())
