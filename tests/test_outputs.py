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


def test_names_in_the_cli_are_the_modules_own():
    from sdkit import adapter, presets, scoretable
    from sdkit.cli import common as cli
    from sdkit.cli import scoretable as scoretable_cli
    from sdkit.encoders import LAYERS
    from sdkit.steering import OBJECTIVES

    assert scoretable_cli.DTYPES == tuple(scoretable.DTYPES) and cli.PRESET_NAMES.split(", ") == list(presets.PRESETS)

    assert (cli.LAYERS, cli.ADAPTER_KINDS, cli.STEERING_OBJECTIVES) == (LAYERS, adapter.KINDS, OBJECTIVES)


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
    assert "not empty" in line and "sdkit.json" in line
    assert tree(user) == before
    monkeypatch.chdir(user)
    line = refusal(cli("minisd", "train", "--steps", "1", "--out", ".", "--text-encoder", tmp_path / "none"))
    assert "not empty" in line
    assert tree(user) == before and sorted(p.name for p in user.iterdir()) == ["sub", "thesis.txt"]
    line = refusal(cli("condition", "--maps", user))
    assert "sdkit.json" in line and tree(user) == before
    line = refusal(cli("adapter", "train", "--new", tmp_path / "none", "--old", tmp_path / "none", "--out", user))
    assert "sdkit.json" in line and tree(user) == before


def _record(folder: Path) -> dict:
    import json

    return json.loads((folder / "sdkit.json").read_text())


def test_a_folder_of_ours_keeps_what_the_writer_did_not_write(tmp_path):
    model = tmp_path / "minisd"
    with atomic_folder(model, "minisd-model") as tmp:
        (tmp / "unet").mkdir()
        (tmp / "unet" / "old.safetensors").write_text("old weights")
        (tmp / "minisd.json").write_text("{}")
    assert _record(model) == {
        "written_by": "sdkit",
        "kind": "minisd-model",
        "version": 1,
        "files": ["minisd.json", "unet/old.safetensors"],
    }
    (model / "findings").mkdir()
    (model / "findings" / "eval.json").write_text('{"pairs": 0.2}')
    (model / "unet" / "NOTES.md").write_text("my notes")  # a user's file inside a folder sdkit writes
    check_output_folder(model, "minisd-model")  # ours: accepted
    with atomic_folder(model, "minisd-model") as tmp:
        (tmp / "unet").mkdir()
        (tmp / "unet" / "weights.safetensors").write_text("new weights")
        (tmp / "minisd.json").write_text('{"new": true}')
    assert (model / "findings" / "eval.json").read_text() == '{"pairs": 0.2}'
    # ours from the last write and not written now: removed; the user's: kept
    assert sorted(p.name for p in (model / "unet").iterdir()) == ["NOTES.md", "weights.safetensors"]
    assert (model / "minisd.json").read_text() == '{"new": true}'
    assert _record(model)["files"] == ["minisd.json", "unet/weights.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["minisd"]  # no temporary folder left behind
    with pytest.raises(RuntimeError), atomic_folder(model, "minisd-model") as tmp:
        (tmp / "minisd.json").write_text("half")
        raise RuntimeError("crash")
    assert (model / "minisd.json").read_text() == '{"new": true}'


def test_a_file_sdkit_did_not_write_is_never_replaced(tmp_path):
    from sdkit.common import SdkitError

    model = tmp_path / "m"
    with atomic_folder(model, "minisd-model") as tmp:
        (tmp / "minisd.json").write_text("{}")
    (model / "unet").mkdir()
    (model / "unet" / "config.json").write_text("the user's")
    before = tree(model)
    with pytest.raises(SdkitError, match="sdkit did not write"), atomic_folder(model, "minisd-model") as tmp:
        (tmp / "unet").mkdir()
        (tmp / "unet" / "config.json").write_text("ours")
        (tmp / "minisd.json").write_text('{"new": true}')
    assert tree(model) == before  # refused before anything moved
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


@pytest.mark.parametrize(
    "content",
    [
        '{"unet": "x"}',
        "not json",
        '{"written_by": "sdkit", "kind": "maps"}',
        '{"written_by": "someone", "kind": "maps", "version": 1, "files": []}',
    ],
)
def test_a_record_sdkit_did_not_write_is_not_enough(tmp_path, content):
    from sdkit.common import SdkitError

    folder = tmp_path / "f"
    folder.mkdir()
    (folder / "sdkit.json").write_text(content)
    (folder / "maps.json").write_text("a user's maps")
    with pytest.raises(SdkitError, match="sdkit did not write it"):
        check_output_folder(folder, "maps")
    (folder / "sdkit.json").write_text('{"written_by": "sdkit", "kind": "maps", "version": 1, "files": []}')
    check_output_folder(folder, "maps")  # the record sdkit writes: accepted


def test_a_folder_of_another_kind_is_refused(tmp_path):
    from sdkit.common import SdkitError

    with atomic_folder(tmp_path / "maps", "maps") as tmp:
        (tmp / "maps.json").write_text("{}")
    with pytest.raises(SdkitError, match="holds attention maps that sdkit wrote, not a mini SD model"):
        check_output_folder(tmp_path / "maps", "minisd-model")


def test_shipped_model_folders_carry_their_record():
    from sdkit.common import folder_record

    for folder in (Path("weights/minisd"), Path("weights/minisd-pooled")):
        record = folder_record(folder)
        assert record["kind"] == "minisd-model"
        assert (
            sorted(
                str(p.relative_to(folder))
                for p in folder.rglob("*")
                if p.is_file() and "findings" not in p.parts and p.name != "sdkit.json"
            )
            == record["files"]
        )


def test_maps_into_findings_that_hold_a_maps_json_are_refused(cli, tmp_path):
    """Issue 49.1: a file named like sdkit's own (findings/maps.json) does not make a folder sdkit's."""
    import shutil

    findings = tmp_path / "findings"
    shutil.copytree(
        "weights/minisd/findings", findings, ignore=lambda d, names: [n for n in names if n.endswith(".png")]
    )
    before = tree(findings)
    line = refusal(cli("condition", "--maps", findings))
    assert "sdkit did not write it" in line and tree(findings) == before


def test_adapters_never_replace_a_users_report(cli, tmp_path):
    """Issue 49.1: a user's own report.json in --out is not sdkit's."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "report.json").write_text("my report")
    line = refusal(cli("adapter", "demo", "--prompts", "20", "--epochs", "1", "--unet", "none", "--out", out))
    assert "sdkit did not write it" in line and (out / "report.json").read_text() == "my report"


def test_files_written_by_libraries_get_the_umask_modes(tmp_path):
    import torch
    from safetensors.torch import save_file

    old = os.umask(0o022)
    try:
        with atomic_folder(tmp_path / "model", "minisd-model") as tmp:
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
    assert "what this command reads" in line and digest(checkpoint) == before
    folder = tmp_path / "pipeline"
    shutil.copytree(tiny_files / "pipeline", folder)
    before = tree(folder)
    line = refusal(cli("condition", "--unet", folder, "--json-out", folder / "unet" / "config.json"))
    assert "what this command reads" in line and tree(folder) == before
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


def _encoders_dir(tmp_path, micro_minisd) -> tuple[Path, Path]:
    """A mini SD copied beside an encoders folder holding its text encoder, as --encoders-dir finds it."""
    import json
    import shutil

    folder, encoder = micro_minisd
    model = tmp_path / "model"
    shutil.copytree(folder, model)
    name = json.loads((model / "minisd.json").read_text())["text_encoder"]
    encoders = tmp_path / "encoders"
    shutil.copytree(encoder, encoders / name)
    return model, encoders / name


def test_outputs_never_land_on_what_the_command_reads_through_any_flag(cli, tmp_path, micro_minisd):
    """Issue 49.4: an encoder found through --encoders-dir is read, so no output may replace its files."""
    model, encoder = _encoders_dir(tmp_path, micro_minisd)
    before, model_before = tree(encoder), tree(model)
    sample = [
        "minisd",
        "sample",
        "a red circle",
        "--seeds",
        "1",
        "--steps",
        "1",
        "--model",
        model,
        "--encoders-dir",
        encoder.parent,
    ]
    for argv in (
        [*sample, "--out", tmp_path / "x.png", "--json-out", encoder / "config.json"],
        [*sample, "--out", encoder / "grid.png"],
        [
            "minisd",
            "eval",
            "--model",
            model,
            "--encoders-dir",
            encoder.parent,
            "--count",
            "1",
            "--no-floors",
            "--json-out",
            encoder / "tokenizer.json",
        ],
        ["condition", "--unet", model, "--encoders-dir", encoder.parent, "--json-out", encoder / "config.json"],
        ["condition", "--unet", model, "--json-out", model / "unet" / "config.json"],
        [
            "minisd",
            "train",
            "--steps",
            "1",
            "--encoders-dir",
            encoder.parent,
            "--out",
            tmp_path / "m2",
            "--json-out",
            encoder / "vocab.txt",
        ],
    ):
        line = refusal(cli(*argv))
        assert "what this command reads" in line, argv
    assert tree(encoder) == before and tree(model) == model_before
    # beside a model sdkit wrote, its findings are not what it reads
    code, _, err = cli(*sample, "--out", tmp_path / "x.png", "--json-out", model / "findings" / "sample.json")
    assert code == 0, err


@pytest.mark.parametrize(
    "argv",
    [
        ["minisd", "sample", "a red circle", "--out", "{t}/c.png", "--json-out", "{t}/c.png"],
        ["audit", "tiny", "--compute", "--sweep", "--plot", "{t}/x.png", "--json-out", "{t}/x.png"],
        ["memory", "--quick", "--plot", "{t}/x.png", "--json-out", "{t}/x.png"],
        ["minisd", "train", "--out", "{t}/m", "--json-out", "{t}/m/minisd.json"],
        ["minisd", "train", "--out", "{t}/m", "--checkpoints", "{t}/m"],
        ["minisd", "train", "--checkpoints", "{t}/c", "--json-out", "{t}/c/checkpoint.safetensors"],
        ["condition", "--maps", "{t}/maps", "--json-out", "{t}/maps/maps.json"],
        ["adapter", "demo", "--out", "{t}/a", "--json-out", "{t}/a/report.json"],
        ["minisd", "edit", "a red circle", "--to", "a blue circle", "--out", "{t}/w", "--json-out", "{t}/w/x.json"],
    ],
)
def test_outputs_of_one_command_never_land_on_each_other(cli, tmp_path, argv):
    """Issue 49.5: two outputs on one path, or a file inside a folder the same command writes."""
    line = refusal(cli(*[a.format(t=tmp_path) for a in argv]))
    assert "same path" in line or "inside the" in line
    assert list(tmp_path.iterdir()) == []


def test_checkpoints_never_delete_a_users_files_in_its_model_folder(cli, tmp_path, bert):
    """Issue 49.2 and 14: DIR/model is held to the --out rule before training starts."""
    checkpoints = tmp_path / "ckpt"
    (checkpoints / "model").mkdir(parents=True)
    (checkpoints / "model" / "mine.txt").write_text("mine")
    argv = ["minisd", "train", "--steps", "1", "--text-encoder", bert.source, "--out", tmp_path / "m"]
    line = refusal(cli(*argv, "--checkpoints", checkpoints))
    assert "sdkit did not write it" in line and (checkpoints / "model" / "mine.txt").read_text() == "mine"
    (checkpoints / "model" / "mine.txt").unlink()
    (checkpoints / "model").rmdir()
    (checkpoints / "model").write_text("a file")
    line = refusal(cli(*argv, "--checkpoints", checkpoints))
    assert "must be a folder" in line and sorted(p.name for p in checkpoints.iterdir()) == ["model"]


def test_training_into_a_model_folder_keeps_the_users_files_inside_it(tmp_path, bert):
    """Issue 49.3: a user's NOTES.md in unet/, a backup in unet/, a sampler in scheduler/ stay."""
    from sdkit.minisd.train import TrainSettings, train
    from tests.conftest import micro_config

    out = tmp_path / "model"
    settings = TrainSettings(steps=1, batch_size=4, warmup_steps=1, compile=False)
    train(out, bert, settings, micro_config(bert.width), progress=False)
    mine = {
        out / "unet" / "NOTES.md": "notes",
        out / "unet" / "backup.safetensors": "backup",
        out / "scheduler" / "ddim.json": "{}",
        out / "findings" / "eval.json": "{}",
    }
    for path, text in mine.items():
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    weights = digest(out / "unet" / "diffusion_pytorch_model.safetensors")
    train(
        out,
        bert,
        TrainSettings(steps=1, batch_size=4, warmup_steps=1, compile=False, seed=1),
        micro_config(bert.width),
        progress=False,
    )
    assert {path: path.read_text() for path in mine} == mine
    assert digest(out / "unet" / "diffusion_pytorch_model.safetensors") != weights  # the model was replaced
