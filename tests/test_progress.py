"""What a person sees while a command works: a phase line from the first moment on a terminal,
cleared before the result; one line per long phase in a log; sample grids one prompt to a row."""

import os
import select
import subprocess
import sys
import time

import pytest

from sdkit.cli import common
from sdkit.minisd.evaluate import grid_places


def test_a_log_gets_one_line_per_long_phase_and_none_for_short_ones(monkeypatch, capsys):
    now = [0.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    phase = common._Phase()
    phase.program = "sdkit x"
    for at, text in ((0.0, "starting"), (20.0, "quick"), (23.0, "sampling 64 images"), (60.0, "judging")):
        now[0] = at
        phase(text, log=text != "starting")  # the start-up is never logged; "quick" takes 3 s: no line
    now[0] = 150.5
    phase.clear()
    assert capsys.readouterr().err.splitlines() == ["sdkit x: sampling 64 images: 37 s", "sdkit x: judging: 1 min 30 s"]


def test_on_a_terminal_the_first_output_is_the_phase_and_it_is_cleared_before_the_table():
    if not hasattr(os, "openpty"):
        pytest.skip("no pseudo-terminals here")
    master, slave = os.openpty()
    process = subprocess.Popen(
        [sys.executable, "-m", "sdkit", "audit", "tiny"], stdin=subprocess.DEVNULL, stdout=slave, stderr=slave
    )
    os.close(slave)
    out = b""
    while True:
        ready, _, _ = select.select([master], [], [], 60)
        try:
            chunk = os.read(master, 65536) if ready else b""
        except OSError:  # the terminal closed
            chunk = b""
        if not chunk:
            break
        out += chunk
    process.wait(timeout=60)
    os.close(master)
    text = out.decode()
    assert process.returncode == 0, text
    assert text.startswith("\r\x1b[Ksdkit audit: loading torch and the model code ..."), text[:200]
    before, table = text.rsplit("\r\x1b[K", 1)  # the last clear, then only the result
    assert "sdkit audit:" not in table and "parameters" in table.lower(), table[:300]


def test_each_prompt_of_a_sample_grid_starts_its_own_row():
    assert grid_places(["a"] * 6 + ["b"] * 6) == (2, 6, [(0, c) for c in range(6)] + [(1, c) for c in range(6)])
    rows, cols, places = grid_places(["a"] * 10 + ["b"] * 3)
    assert (rows, cols) == (3, 8) and places[8:10] == [(1, 0), (1, 1)] and places[10:] == [(2, 0), (2, 1), (2, 2)]
    assert grid_places(["a", "b", "c"]) == (1, 3, [(0, 0), (0, 1), (0, 2)])  # one seed each: side by side


def test_library_load_bars_stay_off_when_a_script_imported_diffusers_first():
    """A script that imports sdkit's pipelines (so diffusers and huggingface_hub, which read their
    settings at import) before it calls quiet_libraries still gets no transformers load bars."""
    code = (
        "import diffusers\n"
        "from sdkit.cli import quiet_libraries\n"
        "quiet_libraries()\n"
        "from transformers.utils import logging\n"
        "print(logging.is_progress_bar_enabled())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
