"""A fuzzer for the command line: random values for every command's flags (huge, negative, NaN,
empty, unicode, paths that are inputs, devices or folders), on tiny models.

Every case must end in exit 0 with a finite result, or exit 2 with one line on stderr: never a
traceback, never a changed input file, never a deleted or changed file the command did not name
as its output. 40 cases in the default run, 600 in the slow one (-m slow).
"""

import hashlib
import json
import math
import random
import shutil
from pathlib import Path

import pytest

from tests.test_reliability import one_line

# Values for any flag. Work-size flags (steps, counts, epochs) take only the small or invalid ones,
# so that every case stays short: a valid huge amount of work is work, not a defect.
ANY = [
    "0",
    "-1",
    "1",
    "2",
    "3",
    "17",
    "1e308",
    "-1e308",
    "nan",
    "inf",
    "-inf",
    "",
    " ",
    "é",
    "🙂",
    "1.5",
    "0x10",
    "9" * 30,
    "-" + "9" * 30,
    "x",
    "--",
    "a,b",
    "8,",
    "64x96",
    "0,1000",
    "\x7f",
    "0.0001",
]
SMALL = ["0", "-1", "1", "2", "nan", "", "é", "1.5", "x", "-" + "9" * 30]


def paths(root: Path) -> list[str]:
    """Where outputs may go: new files, existing user files, inputs, devices, folders, odd names."""
    return [
        str(root / "out" / "new.json"),
        str(root / "out" / "deep" / "er" / "new.png"),
        str(root / "keep" / "notes.txt"),
        str(root / "keep"),
        str(root / "inputs" / "tiny.safetensors"),
        str(root / "inputs" / "micro" / "minisd.json"),
        "/dev/null",
        str(root / "out" / "é 🙂.png"),
        str(root / "out" / "x.svg"),
        str(root / "out" / "x.txt"),
        "",
        str(root / "inputs" / "micro"),
        str(root / "out" / "fresh"),
    ]


def commands(root: Path, encoder: str) -> dict[str, tuple[list[str], dict[str, list[str]]]]:
    """name -> (the command's fixed arguments, flag -> values to try)."""
    inputs, micro = root / "inputs", str(root / "inputs" / "micro")
    out = paths(root)
    models = [
        "tiny",
        "minisd",
        "sd15",
        str(inputs / "tiny.safetensors"),
        str(inputs / "pipeline"),
        micro,
        "/nonexistent",
        "",
        "é",
        str(root / "keep"),
    ]
    sample = [
        "minisd",
        "sample",
        "a red circle at the top",
        "--model",
        micro,
        "--text-encoder",
        encoder,
        "--out",
        str(root / "out" / "grid.png"),
    ]
    return {
        "audit": (
            ["audit"],
            {
                "": models,
                "--context-dim": ANY,
                "--image-size": ANY,
                "--json-out": out,
                "--allow-pickle": [None],
                "--json": [None],
            },
        ),
        "scoretable": (
            ["scoretable", "--preset", "tiny"],
            {
                "--size": ANY,
                "--height": ANY,
                "--width": ANY,
                "--preset": ["tiny", "minisd", "x", ""],
                "--batch": SMALL,
                "--cfg": [None],
                "--dtype": ["float32", "int8", ""],
                "--plot": out,
                "--chunk-budget": ANY,
                "--json-out": out,
                "--tokens": SMALL,
            },
        ),
        "condition": (
            ["condition"],
            {
                "--unet": ["tiny", micro, "/nonexistent", str(inputs / "tiny.safetensors")],
                "--prompt": ["", "é 🙂", "a red circle", "x " * 500],
                "--latent-size": ANY,
                "--timestep": ANY,
                "--seed": ANY,
                "--maps": out,
                "--map-sides": ANY,
                "--layer": ["last", "x"],
                "--text-encoder": [encoder, "/nonexistent", micro],
                "--json-out": out,
                "--masks": [None],
                "--count": SMALL,
                "--steps": SMALL,
                "--timesteps": ANY,
                "--guidance": ANY,
            },
        ),
        "adapter encode": (
            [
                "adapter",
                "encode",
                "a red cat",
                "--adapter",
                str(inputs / "adapter"),
                "--new",
                str(inputs / "new"),
                "--out",
                str(root / "out" / "embeds.safetensors"),
            ],
            {
                "--negative": ["", "é", "x " * 100],
                "--out": out,
                "--new-layer": ["last", "penultimate", "x"],
                "--adapter": [str(inputs / "adapter"), micro, "/nonexistent"],
            },
        ),
        "minisd sample": (
            sample,
            {
                "--seeds": SMALL,
                "--first-seed": ANY,
                "--steps": SMALL + ["1001"],
                "--guidance": ANY,
                "--sampler": ["ddim", "dpm", "x"],
                "--out": out,
                "--json-out": out,
            },
        ),
        "minisd eval": (
            [
                "minisd",
                "eval",
                "--model",
                micro,
                "--text-encoder",
                encoder,
                "--count",
                "1",
                "--steps",
                "2",
                "--no-floors",
            ],
            {
                "--sets": ["", ",", "pairs", "x", "singles,pairs"],
                "--count": SMALL,
                "--steps": SMALL,
                "--guidance": ANY,
                "--panel": out,
            },
        ),
        "minisd train": (
            ["minisd", "train", "--text-encoder", encoder, "--steps", "1", "--out", str(root / "out" / "m")],
            {
                "--lr": ANY,
                "--image-size": ANY,
                "--batch-size": SMALL,
                "--out": out,
                "--pair-fraction": ANY,
                "--empty-fraction": ANY,
                "--checkpoint-every": ANY,
            },
        ),
    }


def digest_tree(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def stat_tree(folder: Path) -> dict[str, tuple[int, int, int]]:
    """Each file's size, modification time and inode: a write, a replacement by rename, a new file and
    a deleted one each change it. Cheap enough to take after every case (hashing the arena was most
    of these tests' time); digest_tree still reads the bytes once per test."""
    return {
        str(p.relative_to(folder)): (st.st_size, st.st_mtime_ns, st.st_ino)
        for p in sorted(folder.rglob("*"))
        if p.is_file()
        for st in (p.stat(),)
    }


def finite(value) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(finite(v) for v in value.values())
    if isinstance(value, list):
        return all(finite(v) for v in value)
    return True


@pytest.fixture(scope="module")
def arena(tmp_path_factory, micro_minisd, tiny_files, tiny_pair):
    """Inputs (tiny checkpoints, a micro mini SD, an adapter) and a user's folder beside them."""
    from sdkit.adapter import TextEncoderAdapter

    root = tmp_path_factory.mktemp("arena")
    inputs = root / "inputs"
    inputs.mkdir()
    shutil.copy(tiny_files / "diffusers.safetensors", inputs / "tiny.safetensors")
    shutil.copytree(tiny_files / "pipeline", inputs / "pipeline")
    shutil.copytree(micro_minisd[0], inputs / "micro")
    shutil.copytree(tiny_pair[0].source, inputs / "new")
    TextEncoderAdapter("linear", tiny_pair[0].width, 768).save_pretrained(inputs / "adapter")
    (root / "keep" / "sub").mkdir(parents=True)
    (root / "keep" / "notes.txt").write_text("mine")
    (root / "keep" / "sub" / "data.csv").write_text("1,2")
    return root, micro_minisd[1]


INPUT_FLAGS = ("", "--unet", "--model", "--adapter", "--new", "--text-encoder")


def run_cases(cli, arena, count: int, seed: int) -> None:
    root, encoder = arena
    table = commands(root, encoder)
    names = sorted(table)
    pristine = root.parent / f"{root.name}-pristine"
    shutil.copytree(root, pristine, dirs_exist_ok=True)
    before = digest_tree(pristine)
    outcomes = {0: 0, 2: 0}
    for case in range(count):
        rng = random.Random(f"{seed}:{case}")
        base, flags = table[rng.choice(names)]
        argv = list(base)
        for flag in rng.sample(sorted(flags), k=min(len(flags), rng.randint(0, 3))):
            value = rng.choice(flags[flag])
            if flag == "":
                argv.append(value)
            else:
                argv += [flag] if value is None else [flag, value]
        if rng.random() < 0.5:
            argv.append("--json")
        code, out, err = cli(*argv)
        assert code in (0, 2), (argv, code, err[-2000:])
        outcomes[code] += 1
        if code == 2:
            one_line(code, err)
        elif "--json" in argv:
            assert finite(json.loads(out)), argv
        else:
            assert " nan " not in f" {out} ".lower().replace("\n", " "), (argv, out)
        # Files that were there: none deleted; changed only if named as an output, never if read.
        reads = {Path(argv[i + 1]) for i in range(len(argv) - 1) if argv[i] in INPUT_FLAGS[1:]}
        reads |= {Path(argv[1])} if argv[0] == "audit" and len(argv) > 1 and not argv[1].startswith("-") else set()
        named = {Path(v) for v in argv if v.startswith(str(root))}
        after = digest_tree(root)
        for name, digest in before.items():
            if after.get(name) != digest:
                path = root / name
                assert path in named, ("deleted or changed a file it did not name", argv, name)
                assert not any(path == r or r in path.parents for r in reads), ("overwrote an input", argv, name)
                shutil.copy(pristine / name, path)  # the next case starts from the same arena
    print(f"fuzz outcomes: {outcomes}")
    assert outcomes[2] > 0 and (count < 50 or outcomes[0] > 0), outcomes


def test_cli_fuzz(cli, arena):
    run_cases(cli, arena, count=40, seed=0)


@pytest.mark.slow
def test_cli_fuzz_long(cli, arena):
    run_cases(cli, arena, count=600, seed=1)


# --- systematic: every output against every input and every other output; every number at its edges ----

# Options that name what a command writes (files, pictures, folders); INPUT_FLAGS names what it reads.
OUTPUT_OPTIONS = ("--json-out", "--out", "--plot", "--panel", "--maps", "--checkpoints", "--cache")
# How much work to do, and nothing more: at a huge valid value they are hours of work, not a defect.
# Every other number, huge, is refused or done at once (sizes that allocate are bounded first).
WORK_ONLY = ("--steps", "--epochs", "--patience", "--repeats", "--guide-steps", "--checkpoint-every")


def fast_commands(root: Path, encoder: str) -> dict[str, list[str]]:
    """Each command with arguments that make it quick, reading the arena's inputs."""
    inputs, micro = root / "inputs", str(root / "inputs" / "micro")
    out = root / "out"
    minisd = ["--model", micro, "--text-encoder", encoder, "--steps", "1"]
    return {
        "audit": ["audit", str(inputs / "tiny.safetensors"), "--json-out", str(out / "a.json")],
        "audit sweep": ["audit", "tiny", "--compute", "--sweep", "--plot", str(out / "a.png")],
        "scoretable": ["scoretable", "--preset", "tiny", "--plot", str(out / "s.png")],
        "condition": ["condition", "--unet", str(inputs / "pipeline"), "--maps", str(out / "maps")],
        "condition minisd": ["condition", "--unet", micro, "--text-encoder", encoder, "--prompt", "a red circle"],
        "condition masks": [
            "condition",
            "--unet",
            micro,
            "--text-encoder",
            encoder,
            "--masks",
            "--count",
            "1",
            "--timesteps",
            "500",
            "--plot",
            str(out / "c.png"),
        ],
        "adapter encode": [
            "adapter",
            "encode",
            "a red cat",
            "--adapter",
            str(inputs / "adapter"),
            "--new",
            str(inputs / "new"),
            "--out",
            str(out / "e.safetensors"),
        ],
        "adapter train": [
            "adapter",
            "train",
            "--new",
            encoder,
            "--old",
            encoder,
            "--unet",
            "none",
            "--generate",
            "20",
            "--epochs",
            "1",
            "--kinds",
            "linear",
            "--out",
            str(out / "adapters"),
            "--checkpoints",
            str(out / "ack"),
        ],
        "minisd sample": ["minisd", "sample", "a red circle", "--seeds", "1", *minisd, "--out", str(out / "g.png")],
        "minisd eval": [
            "minisd",
            "eval",
            "--count",
            "1",
            "--sets",
            "singles",
            "--no-floors",
            *minisd,
            "--panel",
            str(out / "p.png"),
        ],
        "minisd edit": [
            "minisd",
            "edit",
            "a red circle",
            "--to",
            "a blue circle",
            "--seeds",
            "1",
            *minisd,
            "--out",
            str(out / "edit.png"),
        ],
        "memory": ["memory", "--quick", "--minisd", micro, "--plot", str(out / "m.png")],
    }


def _with(argv: list[str], option: str, value: str) -> list[str]:
    """argv with `option` set to `value` (replaced where it is given, else added)."""
    if option in argv:
        argv = list(argv)
        argv[argv.index(option) + 1] = value
        return argv
    return [*argv, option, value]


def _options(argv: list[str]) -> dict:
    """The parser's actions for the (sub)command that argv names, by option string."""
    import argparse

    from sdkit.cli import build_parser

    parser = build_parser()
    for token in argv:
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        if sub is None or token not in sub.choices:
            break
        parser = sub.choices[token]
    return {s: a for a in parser._actions for s in a.option_strings}


def _input_files(root: Path, argv: list[str]) -> list[Path]:
    """Every file the command reads through its input flags: each input file, or each file in an
    input folder that the folder's loader reads (configs, weights, tokenizer files)."""
    reads = [Path(argv[i + 1]) for i in range(len(argv) - 1) if argv[i] in INPUT_FLAGS[1:] + ("--old", "--minisd")]
    if argv[0] == "audit" and not argv[1].startswith("-") and Path(argv[1]).exists():
        reads.append(Path(argv[1]))
    files = []
    for path in reads:
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            files += [p for p in sorted(path.rglob("*")) if p.is_file() and "findings" not in p.parts]
    return files


def _assert_untouched(cli, root: Path, before: dict, argv: list[str], words: tuple[str, ...]) -> None:
    code, _, err = cli(*argv)
    line = one_line(code, err)
    assert any(w in line for w in words), (argv, line)
    assert stat_tree(root) == before, ("changed a file", argv)


def test_no_output_lands_on_an_input(cli, arena):
    """Every output option of every command, pointed at every file the command reads: refused, and
    nothing changes."""
    root, encoder = arena
    digest, before = digest_tree(root), stat_tree(root)
    cases = 0
    for argv in fast_commands(root, encoder).values():
        options = _options(argv)
        for output in (o for o in OUTPUT_OPTIONS if o in options and o not in ("--cache", "--checkpoints")):
            for path in _input_files(root, argv):
                _assert_untouched(
                    cli,
                    root,
                    before,
                    _with(argv, output, str(path)),
                    ("what this command reads", "must be a folder", "pictures are written as"),
                )
                cases += 1
    assert cases > 100, cases
    assert digest_tree(root) == digest


def test_no_output_lands_on_another(cli, arena):
    """Two outputs of one command on one path, and a file output inside a folder the command writes."""
    root, encoder = arena
    digest, before = digest_tree(root), stat_tree(root)
    cases = 0
    for name, argv in fast_commands(root, encoder).items():
        options = _options(argv)
        outputs = [o for o in OUTPUT_OPTIONS if o in options and o != "--cache"]
        for i, first in enumerate(outputs):
            for second in outputs[i + 1 :]:
                same = str(root / "out" / "same.png")
                _assert_untouched(
                    cli,
                    root,
                    before,
                    _with(_with(argv, first, same), second, same),
                    ("same path", "inside the", "must be a folder", "must be a file"),
                )
                cases += 1
            if (
                first in ("--out", "--maps", "--checkpoints")
                and options[first].metavar not in ("FILE.png",)
                and name not in ("minisd sample", "adapter encode")
            ):
                folder = str(root / "out" / "written")
                for second in (o for o in outputs if o != first):
                    _assert_untouched(
                        cli, root, before, _with(_with(argv, first, folder), second, folder + "/x.png"), ("inside the",)
                    )
                    cases += 1
    assert cases > 10, cases
    assert digest_tree(root) == digest


def error_line(code, err) -> str:
    """The error of a command that may have worked a while first: in a log, each phase of 10 s or more
    gets a line before it; the error is the last line, and nothing else is said."""
    lines = err.strip().splitlines()
    assert code == 2 and lines and "Traceback" not in err and all(line.startswith("sdkit") for line in lines), err
    return lines[-1]


def _number_cases(root: Path, encoder: str) -> list[tuple[str, list[str], str]]:
    edges = ["0", "-1", "nan", "inf", "-inf"]
    cases = []
    for name, argv in fast_commands(root, encoder).items():
        for option, action in _options(argv).items():
            kind = getattr(action.type, "__name__", "")
            if (
                not kind
                or kind in ("cache_folder", "adapter_kinds", "steering_objectives")
                or option != action.option_strings[0]
            ):
                continue
            huge = [] if option in WORK_ONLY else ["1e308" if "float" in kind else "9" * 30]
            cases += [(name, _with(argv, option, value), value) for value in edges + huge]
    return cases


@pytest.mark.slow  # about 400 cases, a few of them a step of work each
def test_every_number_at_its_edges(cli, arena):
    """Every numeric option of every command at 0, -1, NaN, +-inf and huge: refused in one line, or
    done with a finite result; never a traceback, never a file of the user's changed."""
    root, encoder = arena
    shutil.rmtree(root / "out", ignore_errors=True)  # what the fuzzers before it wrote there
    pristine = digest_tree(root)
    outcomes = {0: 0, 2: 0}
    for name, argv, _ in _number_cases(root, encoder):
        code, out, err = cli(*argv, "--json") if "encode" not in name else cli(*argv)
        assert code in (0, 2), (argv, code, err[-2000:])
        outcomes[code] += 1
        if code == 2:
            error_line(code, err)
        elif "encode" not in name:
            assert finite(json.loads(out)), argv
        after = digest_tree(root)
        changed = [n for n, d in pristine.items() if after.get(n) != d]
        assert not changed, (argv, changed)
        shutil.rmtree(root / "out", ignore_errors=True)
    assert outcomes[2] > 200, outcomes


def test_numbers_at_their_edges_sampled(cli, arena):
    """The default run's share of the sweep above: 40 cases, drawn the same way each run."""
    root, encoder = arena
    cases = random.Random(0).sample(_number_cases(root, encoder), 40)
    for name, argv, _ in cases:
        code, out, err = cli(*argv, "--json") if "encode" not in name else cli(*argv)
        assert code in (0, 2), (argv, code, err[-2000:])
        if code == 2:
            error_line(code, err)
        shutil.rmtree(root / "out", ignore_errors=True)
