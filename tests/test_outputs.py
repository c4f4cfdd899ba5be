"""Outputs never destroy: a folder we write keeps what we did not write, an output is never one of
the command's inputs, and devices and pipes are written through, never replaced."""

import hashlib
import os
import stat
import threading
from pathlib import Path

import pytest

from sdkit.common import atomic_folder, atomic_path, check_output_folder
from tests.test_reliability import one_line


def refusal(result) -> str:
    """The one error line of a refused command (exit 2)."""
    code, _, err = result
    return one_line(code, err)


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tree(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): digest(p) for p in sorted(folder.rglob("*")) if p.is_file()}


def test_markers_named_in_the_cli_are_the_modules_own():
    from sdkit import adapter, conditioning
    from sdkit.cli import common as cli
    from sdkit.minisd import pipeline

    from sdkit import presets, scoretable
    from sdkit.cli import scoretable as scoretable_cli
    from sdkit.encoders import LAYERS
    from sdkit.steering import OBJECTIVES

    assert scoretable_cli.DTYPES == tuple(scoretable.DTYPES) and cli.PRESET_NAMES.split(", ") == list(presets.PRESETS)

    assert (cli.MODEL_MARKER, cli.ADAPTERS_MARKER, cli.MAPS_MARKER, cli.LAYERS, cli.ADAPTER_KINDS,
            cli.STEERING_OBJECTIVES) == \
        (pipeline.SPEC_FILE, adapter.REPORT_FILE, conditioning.MAPS_FILE, LAYERS, adapter.KINDS, OBJECTIVES)  # fmt: skip


def test_minisd_train_never_writes_the_shipped_model_by_default():
    from sdkit.cli import build_parser

    args = build_parser().parse_args(["minisd", "train"])
    assert Path(args.out) != Path("weights/minisd")


def test_a_folder_that_is_not_ours_is_refused_before_any_work(cli, tmp_path, monkeypatch):
    user = tmp_path / "userdir"
    (user / "sub").mkdir(parents=True)
    (user / "thesis.txt").write_text("four years")
    (user / "sub" / "data.csv").write_text("1,2,3")
    before = tree(user)
    # --text-encoder names nothing: the refusal must come first, from the output check
    line = refusal(cli("minisd", "train", "--steps", "1", "--out", user, "--text-encoder", tmp_path / "none"))
    assert "not empty" in line and "minisd.json" in line
    assert tree(user) == before
    monkeypatch.chdir(user)
    line = refusal(cli("minisd", "train", "--steps", "1", "--out", ".", "--text-encoder", tmp_path / "none"))
    assert "not empty" in line
    assert tree(user) == before and sorted(p.name for p in user.iterdir()) == ["sub", "thesis.txt"]
    line = refusal(cli("condition", "--maps", user))
    assert "maps.json" in line and tree(user) == before
    line = refusal(cli("adapter", "train", "--new", tmp_path, "--old", tmp_path, "--out", user))
    assert "report.json" in line and tree(user) == before


def test_a_folder_of_ours_keeps_what_the_writer_did_not_write(tmp_path):
    model = tmp_path / "minisd"
    (model / "unet").mkdir(parents=True)
    (model / "unet" / "stale.safetensors").write_text("old weights")
    (model / "minisd.json").write_text("{}")
    (model / "findings").mkdir()
    (model / "findings" / "eval.json").write_text("{\"pairs\": 0.2}")
    check_output_folder(model, "minisd.json")  # ours: accepted
    with atomic_folder(model) as tmp:
        (tmp / "unet").mkdir()
        (tmp / "unet" / "weights.safetensors").write_text("new weights")
        (tmp / "minisd.json").write_text("{\"new\": true}")
    assert (model / "findings" / "eval.json").read_text() == "{\"pairs\": 0.2}"
    assert sorted(p.name for p in (model / "unet").iterdir()) == ["weights.safetensors"]  # unet/ replaced whole
    assert (model / "minisd.json").read_text() == "{\"new\": true}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["minisd"]  # no temporary folder left behind
    with pytest.raises(RuntimeError), atomic_folder(model) as tmp:
        (tmp / "minisd.json").write_text("half")
        raise RuntimeError("crash")
    assert (model / "minisd.json").read_text() == "{\"new\": true}"


def test_files_written_by_libraries_get_the_umask_modes(tmp_path):
    from safetensors.torch import save_file
    import torch

    old = os.umask(0o022)
    try:
        with atomic_folder(tmp_path / "model") as tmp:
            save_file({"w": torch.zeros(2)}, str(tmp / "weights.safetensors"))  # created 0600 by safetensors
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "model" / "weights.safetensors").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "model").stat().st_mode) == 0o755


def test_an_output_that_is_an_input_is_refused(cli, tmp_path, tiny_files):
    import shutil

    checkpoint = tmp_path / "x.safetensors"
    shutil.copy(tiny_files / "diffusers.safetensors", checkpoint)
    before = digest(checkpoint)
    line = refusal(cli("audit", checkpoint, "--json-out", checkpoint))
    assert "input" in line and digest(checkpoint) == before
    folder = tmp_path / "pipeline"
    shutil.copytree(tiny_files / "pipeline", folder)
    before = tree(folder)
    line = refusal(cli("condition", "--unet", folder, "--json-out", folder / "unet" / "config.json"))
    assert "input" in line and tree(folder) == before
    # A findings file beside a model is not part of it: writing it is fine.
    code, _, err = cli("audit", folder, "--json-out", folder / "findings" / "audit.json")
    assert code == 0, err
    assert (folder / "findings" / "audit.json").is_file()


def test_devices_and_pipes_are_written_through_not_replaced(cli, tmp_path):
    code, _, err = cli("audit", "tiny", "--json-out", "/dev/null")
    assert code == 0, err
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    if Path("/dev/full").exists():
        line = refusal(cli("audit", "tiny", "--json-out", "/dev/full"))
        assert "/dev/full" in line and "space" in line.lower()
        assert stat.S_ISCHR(os.stat("/dev/full").st_mode)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    received = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_text()))
    reader.start()
    code, _, err = cli("audit", "tiny", "--json-out", fifo)
    reader.join(timeout=30)
    assert code == 0, err
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and '"total"' in received[0]


def test_atomic_path_writes_through_a_device(tmp_path):
    with atomic_path("/dev/null") as tmp:
        tmp.write_text("gone")
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
