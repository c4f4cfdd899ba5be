"""README.md and docs/ against what they claim: every table of measured numbers is the one
scripts/maintain/tables.py writes from the committed JSON (or, for FLOPs, from the code itself);
every code block runs as written, in the default run or the slow one, or says why it is not run;
and every output the front page shows is what the command prints."""

import contextlib
import functools
import importlib.util
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
PAGES = [
    ROOT / "README.md",
    ROOT / "docs" / "index.md",
    *sorted(p for p in (ROOT / "docs").rglob("*.md") if p.name != "index.md" or p.parent.name != "docs"),
]
BLOCK = re.compile(r"(?:<!-- (slow|not run: [^>]*?) -->\n)?```(\w+)\n(.*?)```", re.S)


def tables_module():
    spec = importlib.util.spec_from_file_location("tables", ROOT / "scripts" / "maintain" / "tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TABLES = tables_module()


def blocks(kind: str | None = None) -> list[tuple[Path, str, str, str]]:
    """(page, marker, language, code) of every fenced block, in page order; marker is "", "slow" or
    "not run: why"."""
    found = []
    for page in PAGES:
        for marker, language, code in BLOCK.findall(page.read_text()):
            if kind is None or language == kind:
                found.append((page, marker, language, code))
    return found


# --- tables -----------------------------------------------------------------------------------------------


@functools.cache
def table_blocks() -> dict[str, str]:
    """Each table as written from its data (some compute theirs from the code: once per run)."""
    return {name: TABLES.block(name) for name in TABLES.TABLES}


def mismatches(texts: dict[Path, str]) -> list[str]:
    """The tables that no page holds exactly as written from their data, or that two pages hold."""
    wrong = []
    for name, written in table_blocks().items():
        holders = [page for page, text in texts.items() if f"<!-- {name} -->" in text]
        if len(holders) != 1 or written not in texts[holders[0]]:
            wrong.append(name)
    return wrong


def test_tables_are_their_data():
    wrong = mismatches({page: page.read_text() for page in PAGES})
    assert not wrong, (
        f"the {', '.join(wrong)} table(s) differ from their data: python scripts/maintain/tables.py --write"
    )


@pytest.mark.parametrize("name", ["eval", "memory", "steering"])
def test_a_number_edited_by_hand_fails(name):
    texts = {page: page.read_text() for page in PAGES}
    page = TABLES.pages()[name]
    row = table_blocks()[name].splitlines()[3]  # the block's first line is its marker
    digit = next(i for i, c in enumerate(row) if c.isdigit())
    texts[page] = texts[page].replace(row, row[:digit] + str((int(row[digit]) + 1) % 10) + row[digit + 1 :], 1)
    assert mismatches(texts) == [name]


# --- code blocks -------------------------------------------------------------------------------------------


def test_every_block_is_run_or_says_why():
    """A code block is run (unmarked: the default run; <!-- slow -->: the slow run) or marked
    <!-- not run: why -->, with the reason. Outputs are ```text blocks, checked below."""
    for page, marker, language, code in blocks():
        where = f"{page.relative_to(ROOT)}: {code.splitlines()[0][:60]!r}"
        assert language in ("bash", "python", "text"), where
        if marker.startswith("not run"):
            assert len(marker.split(":", 1)[1].strip()) > 10, f"{where} is not run and does not say why"
        elif language == "bash":
            assert marker == "slow", f"{where}: shell blocks run in the slow set (mark it <!-- slow -->)"
    assert any(m.startswith("not run") for _, m, _, _ in blocks()) and blocks("python")


@pytest.fixture
def scratch(tmp_path, monkeypatch):
    """A folder laid out as the docs assume: this checkout's scripts/ and weights/ (read through
    links), the tiny SD pipeline the home page builds at path/to/stable-diffusion-v1-5, and the
    prompt embeddings `sdkit adapter encode` writes for it."""
    from safetensors.torch import save_file

    for name in ("scripts", "weights"):
        (tmp_path / name).symlink_to(ROOT / name)
    monkeypatch.chdir(tmp_path)
    for page, marker, _, code in blocks("python"):
        if page.name == "index.md" and not marker:
            exec(compile(code, str(page), "exec"), {})  # noqa: S102 (our own docs)
    width = 32  # the tiny pipeline's text width
    generator = torch.Generator().manual_seed(0)
    save_file(
        {name: torch.randn(1, 77, width, generator=generator) for name in ("prompt_embeds", "negative_prompt_embeds")},
        str(tmp_path / "embeds.safetensors"),
    )
    return tmp_path


def test_every_python_block_runs_as_written(scratch):
    """Each Python block of README.md and docs/, run as written in the scratch folder, in page order;
    then what the audit, trace and adapter examples computed is checked."""
    from safetensors.torch import load_file

    ran: dict[str, list[dict]] = {}
    for page, marker, _, code in blocks("python"):
        if marker:
            continue
        namespace: dict = {}
        exec(compile(code, str(page), "exec"), namespace)  # noqa: S102 (our own docs)
        ran.setdefault(page.stem, []).append(namespace)
    (audit,), (traced, in_words), (adapted,) = ran["audit"], ran["condition"], ran["adapter"]
    assert in_words["cat"].shape == (64, 64) and Path("cat.png").is_file()
    edited, real = ran["editing"]
    assert len(edited["louder"]) == 2 and edited["source"].size == edited["edited"].size == (64, 64)
    assert real["redrawn"].size == real["edited"].size == (64, 64) and len(real["inversion"].errors) == 3
    assert [image.size for image in edited["kept_chair"]] == [(64, 64)] * 2
    assert audit["a"].attention_blocks["mlp_share"] == pytest.approx(0.5567934304288111, rel=1e-12)
    assert audit["a"].text_width_swap["parameter_change"] == 6_389_760  # to_k, to_v: 2 x 256 x (5x320 + 5x640 + 6x1280)
    maps = load_file("maps.safetensors")
    assert sorted({key.split("@")[1] for key in maps}) == ["501", "981"]
    assert next(iter(maps.values())).shape[:2] == (2, 4)  # two prompts, four heads kept
    assert traced["trace"].token_maps(item=0, layers=[16], timesteps=[981], head=3).shape == (77, 32, 32)
    assert adapted["image"].size == (64, 64)


def shell_commands(code: str) -> list[str]:
    """The commands of a shell block: continuations joined, comments dropped."""
    commands = []
    for line in code.replace("\\\n", " ").splitlines():
        line = line.split(" #")[0].strip()
        if line and not line.startswith("#"):
            commands.append(line)
    return commands


def _run(command: str, cwd: Path) -> subprocess.CompletedProcess:
    """Run a shell command from the docs in cwd. A plain `sdkit ...` runs in this process, through
    the same `main` the console script calls (a new process would spend about 5 s of each command
    importing torch and diffusers again; CI's wheel check runs the console script itself); anything
    else, or anything with shell syntax, runs in bash."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    argv = list(lexer)
    if argv[0] == "sdkit" and not any(set(word) <= set("();<>|&") for word in argv) and "$" not in command:
        from sdkit.cli import main

        out, err, back = io.StringIO(), io.StringIO(), os.getcwd()
        os.chdir(cwd)
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = main(argv[1:])
        except SystemExit as exit:  # argparse's own
            code = exit.code
        finally:
            os.chdir(back)
        return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())
    bin_dir = Path(sys.executable).parent  # sdkit's entry point beside this interpreter
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=1200)


@pytest.mark.slow  # about 7 minutes: every runnable shell command of the docs
def test_every_shell_block_runs_as_written(scratch):
    ran = 0
    for page, marker, _, code in blocks("bash"):
        if marker != "slow":
            continue
        for command in shell_commands(code):
            result = _run(command, scratch)
            assert result.returncode == 0, (str(page), command, result.stderr[-2000:])
            ran += 1
    assert ran > 25, ran


def front_page_outputs() -> list[tuple[str, list[str]]]:
    """(command, the lines shown) of each ```text block of README.md that opens with `$ command`."""
    shown = []
    for _, _, code in BLOCK.findall((ROOT / "README.md").read_text()):
        lines = code.splitlines()
        if lines and lines[0].startswith("$ "):
            shown.append((lines[0][2:], lines[1:]))
    return shown


@pytest.mark.slow  # runs each command the front page shows (the adapter demo for half a minute)
@pytest.mark.parametrize("command, lines", front_page_outputs(), ids=lambda x: x if isinstance(x, str) else "")
def test_front_page_outputs_are_what_the_commands_print(scratch, command, lines):
    """Each line the front page shows is a line the command prints (spaces aside); a line ending in
    '...' is a line's beginning."""
    result = _run(shlex.join(shlex.split(command)), scratch)
    assert result.returncode == 0, result.stderr[-2000:]
    printed = [" ".join(line.split()) for line in result.stdout.splitlines()]
    for line in lines:
        want = " ".join(line.split())
        if want.endswith("..."):
            assert any(p.startswith(want[:-3].rstrip()) for p in printed), (command, line)
        else:
            assert want in printed, (command, line)
