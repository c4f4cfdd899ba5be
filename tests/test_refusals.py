"""Nothing silently wrong: each reproduction of the reliability report, as a test (the numbers are
its items). A command answers with a finite result and exit 0, or one line and exit 2."""

import json
import os
import pickle
import shutil
import stat
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from sdkit.common import SdkitError
from tests.conftest import micro_config
from tests.test_reliability import one_line


def refusal(result) -> str:
    code, _, err = result
    return one_line(code, err)


def copy_model(micro_minisd, tmp_path):
    folder, encoder = micro_minisd
    copy = tmp_path / "model"
    shutil.copytree(folder, copy)
    return copy, encoder


# --- 4. flags accepted and ignored --------------------------------------------------------------------


@pytest.mark.parametrize(
    "flags",
    [
        ["--seed", "1"],
        ["--prompt", "x"],
        ["--latent-size", "8"],
        ["--timestep", "3"],
        ["--maps", "m"],
        ["--device", "cpu"],
    ],
)
@pytest.mark.parametrize("mode", ["--masks", "--generate"])
def test_4_options_another_mode_reads_are_refused(cli, micro_minisd, mode, flags):
    folder, encoder = micro_minisd
    line = refusal(cli("condition", "--unet", folder, "--text-encoder", encoder, mode, *flags))
    assert f"does not apply with {mode}" in line


def test_4_mini_sd_options_without_the_mode_and_names_that_match_nothing(cli, micro_minisd):
    assert "does not apply without --masks" in refusal(cli("condition", "--count", "3"))
    assert "does not apply with --masks" in refusal(cli("condition", "--masks", "--pooled-model", "x"))
    assert "does not apply with --generate" in refusal(cli("condition", "--generate", "--timesteps", "100"))
    assert "invalid choice: 'bogus'" in refusal(cli("condition", "--unet", micro_minisd[0], "--layer", "bogus"))
    assert "does not apply with --quick" in refusal(cli("memory", "--quick", "--minisd", "/nonexistent"))
    assert "does not apply with --quick" in refusal(cli("memory", "--quick", "--encoders-dir", "/nonexistent"))
    assert "no such file" in refusal(cli("memory", "--minisd", "/nonexistent"))


# --- 5. non-finite results are errors ----------------------------------------------------------------


def test_5_a_guidance_that_overflows_is_an_error_and_writes_nothing(cli, micro_minisd, tmp_path):
    """Past 1,000 the command refuses the scale before sampling; the library, given one, says the
    sampling overflowed rather than return NaN pixels."""
    from sdkit.minisd.pipeline import MiniSDPipeline

    folder, encoder = micro_minisd
    png = tmp_path / "grid.png"
    argv = ["minisd", "sample", "a red circle at the top", "--model", folder, "--text-encoder", encoder, "--seeds", "1"]
    line = refusal(cli(*argv, "--steps", "2", "--guidance", "1e30", "--out", png))
    assert "a guidance scale is 0 to 1000" in line and not png.exists()
    pipe = MiniSDPipeline.from_pretrained(folder, encoder)
    with pytest.raises(SdkitError, match="non-finite pixels .guidance scale 1e[+]30"):
        pipe(["a red circle at the top"], 2, 1e30)


def test_5_nan_weights_are_refused_when_loaded(cli, micro_minisd, tmp_path):
    model, encoder = copy_model(micro_minisd, tmp_path)
    weights = model / "unet" / "diffusion_pytorch_model.safetensors"
    tensors = load_file(weights)
    name = sorted(tensors)[3]
    tensors[name][0] = float("nan")
    save_file(tensors, weights)
    assert "NaN or infinite" in refusal(cli("condition", "--unet", model, "--text-encoder", encoder))
    assert name in refusal(
        cli(
            "minisd", "sample", "a red circle", "--model", model, "--text-encoder", encoder, "--out", tmp_path / "x.png"
        )
    )


# --- 6. empty, zero and too long --------------------------------------------------------------------------


def test_6_no_prompt_sets(cli, micro_minisd):
    folder, encoder = micro_minisd
    assert "names no prompt set" in refusal(
        cli("minisd", "eval", "--model", folder, "--text-encoder", encoder, "--sets", "")
    )
    assert "names no prompt set" in refusal(cli("minisd", "eval", "--sets", ","))


@pytest.mark.parametrize(
    "field,value,words",
    [
        ("max_length", 0, "max_length"),
        ("max_length", -5, "max_length"),
        ("max_length", "24", "max_length"),
        ("max_length", True, "max_length"),
        ("layer", "middle", "layer"),
        ("image_size", 7, "image_size"),
        ("text_encoder", "../../etc", "folder name"),
        ("space", "latent", "pixels"),
    ],
)
def test_6_and_7_a_spec_that_cannot_be_is_refused(cli, micro_minisd, tmp_path, field, value, words):
    model, encoder = copy_model(micro_minisd, tmp_path)
    spec = json.loads((model / "minisd.json").read_text())
    spec[field] = value
    (model / "minisd.json").write_text(json.dumps(spec))
    line = refusal(
        cli(
            "minisd", "sample", "a red circle", "--model", model, "--text-encoder", encoder, "--out", tmp_path / "x.png"
        )
    )
    assert "minisd.json" in line and words in line


def test_6_a_prompt_longer_than_the_model_reads_is_refused(cli, micro_minisd, tmp_path):
    folder, encoder = micro_minisd
    line = refusal(
        cli(
            "minisd",
            "sample",
            "a red circle " * 1000,
            "--model",
            folder,
            "--text-encoder",
            encoder,
            "--seeds",
            "1",
            "--out",
            tmp_path / "x.png",
        )
    )
    assert "tokens long" in line and "reads 24" in line


# --- 7. sampler and model-folder values ------------------------------------------------------------------


def test_7_sampler_values(cli, micro_minisd, tmp_path):
    folder, encoder = micro_minisd
    base = (
        "minisd",
        "sample",
        "a red circle",
        "--model",
        folder,
        "--text-encoder",
        encoder,
        "--out",
        tmp_path / "x.png",
    )
    assert "1 to 1000" in refusal(cli(*base, "--steps", "1001"))
    assert "2^63" in refusal(cli(*base, "--first-seed", str(2**64)))
    assert "2^63" in refusal(cli(*base, "--first-seed", str(2**63 - 1), "--seeds", "2"))
    line = refusal(
        cli("condition", "--unet", folder, "--text-encoder", encoder, "--masks", "--steps", "1001", "--count", "1")
    )
    assert "1 to 1000" in line


@pytest.mark.parametrize(
    "change,words",
    [
        ({"num_train_timesteps": 0}, "num_train_timesteps"),
        ({"num_train_timesteps": "1000"}, "num_train_timesteps"),
        ({"beta_schedule": "bogus"}, "scheduler config"),
    ],
)
def test_7_a_scheduler_config_that_cannot_be_is_refused(cli, micro_minisd, tmp_path, change, words):
    model, encoder = copy_model(micro_minisd, tmp_path)
    path = model / "scheduler" / "scheduler_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    line = refusal(
        cli(
            "minisd", "sample", "a red circle", "--model", model, "--text-encoder", encoder, "--out", tmp_path / "x.png"
        )
    )
    assert words in line


@pytest.mark.parametrize("size", ["1", "7", "13"])
def test_7_image_sizes_training_cannot_use(bert, tmp_path, size):
    from sdkit.minisd.train import TrainSettings, train

    with pytest.raises(SdkitError, match="image_size"):
        train(
            tmp_path / "m",
            bert,
            TrainSettings(steps=1, batch_size=2, image_size=int(size), compile=False),
            micro_config(bert.width),
            cache_dir=None,
            progress=False,
        )


def test_7_a_run_that_diverges_stops_training(bert, tmp_path):
    """A learning rate past 1 is refused before training (AdamW moves each weight by about lr a
    step); a run that diverges anyway (here an attention loss weighted past any scale) stops with
    one line at the step where the loss stopped being finite, and saves nothing."""
    from sdkit.minisd.train import TrainSettings, train

    with pytest.raises(SdkitError, match="lr must be at most 1, not 1e[+]308"):
        train(tmp_path / "m", bert, TrainSettings(steps=4, batch_size=2, lr=1e308, compile=False), progress=False)
    with pytest.raises(SdkitError, match="diverged at step 1: the loss is inf .lower --grounding-weight"):
        train(
            tmp_path / "m",
            bert,
            TrainSettings(steps=4, batch_size=2, grounding_weight=1e308, warmup_steps=1, compile=False),
            micro_config(bert.width),
            cache_dir=None,
            progress=False,
        )
    assert not (tmp_path / "m").exists()


# --- 8. tensors of the wrong rank ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,shape,extra",
    [("conv_in.weight", (), []), ("conv_in.weight", (5,), []), ("attn2.to_k.weight", (7,), ["--context-dim", "1024"])],
)
def test_8_tensors_of_the_wrong_rank(cli, tiny_files, tmp_path, name, shape, extra):
    tensors = load_file(tiny_files / "diffusers.safetensors")
    full = next(k for k in tensors if k.endswith(name))
    tensors[full] = torch.zeros(shape)
    save_file(tensors, tmp_path / "x.safetensors")
    line = refusal(cli("audit", tmp_path / "x.safetensors", *extra))
    assert full in line and "-D weight" in line


# --- 9. a pickle weights_only refuses -------------------------------------------------------------------------


class Payload:  # not something torch.load(weights_only=True) will build
    def __reduce__(self):
        return (print, ("this ran",))


def test_9_a_pickle_weights_only_refuses_is_one_line(cli, micro_minisd, tiny_pair, tmp_path):
    model, encoder = copy_model(micro_minisd, tmp_path)
    (model / "unet" / "diffusion_pytorch_model.safetensors").unlink()
    (model / "unet" / "diffusion_pytorch_model.bin").write_bytes(pickle.dumps({"w": Payload()}))
    for argv in (
        ["condition", "--unet", model, "--text-encoder", encoder],
        ["minisd", "sample", "a red circle", "--model", model, "--text-encoder", encoder, "--out", tmp_path / "x.png"],
    ):
        code, out, err = cli(*argv, "--allow-pickle")
        assert "cannot load" in one_line(code, err) and "this ran" not in out + err
    new = tmp_path / "new"
    shutil.copytree(tiny_pair[0].source, new)
    for weights in (new / "text_encoder").glob("*.safetensors"):
        weights.unlink()
    (new / "text_encoder" / "pytorch_model.bin").write_bytes(pickle.dumps({"w": Payload()}))
    code, out, err = cli(
        "adapter",
        "train",
        "--new",
        new,
        "--old",
        tiny_pair[1].source,
        "--allow-pickle",
        "--unet",
        "none",
        "--out",
        tmp_path / "adapters",
    )
    assert "cannot load the text encoder" in one_line(code, err) and "this ran" not in out + err


# --- 10. preflights ----------------------------------------------------------------------------------------


def test_10_a_model_and_encoder_of_other_widths(micro_minisd, tiny_pair):
    from sdkit.minisd.pipeline import MiniSDPipeline

    with pytest.raises(SdkitError, match="32-wide token states"):
        MiniSDPipeline.from_pretrained(micro_minisd[0], text_encoder=tiny_pair[1].source)


def test_10_an_adapter_too_big_to_train_is_refused_before_encoding(cli, tiny_pair, tmp_path):
    began = time.perf_counter()
    line = refusal(
        cli(
            "adapter",
            "train",
            "--new",
            tiny_pair[0].source,
            "--old",
            tiny_pair[1].source,
            "--kinds",
            "mlp",
            "--hidden-dim",
            "10000000",
            "--unet",
            "none",
            "--out",
            tmp_path / "a",
            "--cache",
            tmp_path / "cache",
        )
    )
    assert "needs about" in line and "to train" in line
    assert not (tmp_path / "cache").exists() and time.perf_counter() - began < 30


# --- 11. Ctrl-C, from just after start-up to shutdown -------------------------------------------------------


@pytest.mark.parametrize("delay", [0.03, 0.05, 0.08, 0.12, 0.2, 0.3, 0.5, 0.8])
def test_11_ctrl_c_at_any_moment_is_130_and_one_line(delay):
    # From when the interpreter's own start-up (site.py, about 20 ms on an idle machine) is over and
    # sdkit's code runs, through the imports of torch and the work, to the interpreter's shutdown. A
    # signal that lands in site.py is the interpreter's to report (its "init_import_site" error, before
    # any sdkit code), as is one that lands while runpy is still finding the module (a traceback with
    # no sdkit frame in it): on a loaded machine start-up takes longer, so that moment is tried again later.
    for attempt in range(6):
        process = subprocess.Popen(
            [sys.executable, "-m", "sdkit", "audit", "tiny"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        time.sleep(delay + 0.02 * attempt)
        process.send_signal(2)
        out, err = process.communicate(timeout=120)
        before_sdkit = "init_import_site" in err or ("KeyboardInterrupt" in err and "/sdkit/" not in err)
        if not before_sdkit:
            break
    if process.returncode == 0:
        assert err == ""
    else:
        assert process.returncode == 130, err
        assert len(err.strip().splitlines()) == 1 and err.strip().endswith("interrupted"), err


# --- 12, 13. bounded work, and refusals before it --------------------------------------------------------------


def test_12_a_block_numbered_in_the_billions_is_quick(cli, tiny_files, tmp_path):
    tensors = load_file(tiny_files / "diffusers.safetensors")
    tensors["down_blocks.99999999999999999999.resnets.0.conv1.weight"] = torch.zeros(2, 2, 3, 3)
    save_file(tensors, tmp_path / "x.safetensors")
    began = time.perf_counter()
    code, out, err = cli("audit", tmp_path / "x.safetensors", "--json")
    assert time.perf_counter() - began < 10
    assert code == 0 and json.loads(out)["total"] == sum(t.numel() for t in tensors.values())


def test_12_and_13_counts_and_kinds_are_refused_at_once(cli):
    assert "at most 200,000" in refusal(cli("adapter", "train", "--new", "x", "--old", "y", "--captions", "1000000000"))
    assert "at most 200,000" in refusal(cli("adapter", "demo", "--prompts", "1000000000"))
    assert "lstsq" in refusal(cli("adapter", "train", "--new", "x", "--old", "y", "--kinds", "lstsq"))


def test_13_a_checkpoint_of_other_data_is_refused_before_encoding(tiny_pair, tmp_path, monkeypatch):
    from sdkit.adapter import TrainConfig, compare_adapters, evaluation, generate_prompts

    new, old = tiny_pair
    config = TrainConfig(max_epochs=1)
    compare_adapters(
        new, old, generate_prompts(40, seed=1), ("linear",), config, checkpoint_dir=tmp_path, progress=False
    )
    monkeypatch.setattr(evaluation, "encode_prompts", lambda *a, **k: pytest.fail("encoded before refusing"))
    with pytest.raises(SdkitError, match="other data"):
        compare_adapters(
            new, old, generate_prompts(40, seed=2), ("linear",), config, checkpoint_dir=tmp_path, progress=False
        )
    with pytest.raises(SdkitError, match="other settings"):
        compare_adapters(
            new,
            old,
            generate_prompts(40, seed=1),
            ("linear",),
            TrainConfig(max_epochs=2),
            checkpoint_dir=tmp_path,
            progress=False,
        )


# --- 14. modes under the umask ------------------------------------------------------------------------------------


def test_14_model_weights_get_the_umask_modes(bert, tmp_path):
    from sdkit.minisd.train import TrainSettings, train

    old = os.umask(0o022)
    try:
        train(
            tmp_path / "m",
            bert,
            TrainSettings(steps=1, batch_size=2, warmup_steps=1, compile=False),
            micro_config(bert.width),
            cache_dir=None,
            progress=False,
        )
    finally:
        os.umask(old)
    weights = tmp_path / "m" / "unet" / "diffusion_pytorch_model.safetensors"
    assert stat.S_IMODE(weights.stat().st_mode) == 0o644


# --- 15. one line means one line ---------------------------------------------------------------------------------


def test_15_no_library_lines_on_stderr(micro_minisd, tmp_path):
    folder, encoder = micro_minisd
    commands = (
        [
            "minisd",
            "sample",
            "a red circle at the top",
            "--model",
            folder,
            "--text-encoder",
            encoder,
            "--seeds",
            "1",
            "--steps",
            "2",
            "--out",
            tmp_path / "x.png",
        ],
        ["condition", "--unet", folder, "--text-encoder", encoder, "--prompt", "a red circle"],
    )
    # side by side: each is mostly a fresh interpreter importing torch
    running = [
        subprocess.Popen(
            [sys.executable, "-m", "sdkit", *map(str, argv)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for argv in commands
    ]
    finished = [(process.communicate()[1], process.returncode) for process in running]
    for stderr, returncode in finished:
        assert returncode == 0 and stderr == "", stderr


# --- 16. minor ------------------------------------------------------------------------------------------------------


def test_16_pictures_by_their_suffix(cli, tmp_path):
    code, _, err = cli("scoretable", "--plot", tmp_path / "x.svg")
    assert code == 0, err
    assert (tmp_path / "x.svg").read_text().lstrip().startswith("<?xml")
    assert "PNG" not in (tmp_path / "x.svg").read_text()[:200]
    assert ".png, .svg, .pdf" in refusal(cli("scoretable", "--plot", tmp_path / "x.txt"))
    assert not (tmp_path / "x.txt").exists()


def test_16_a_finished_checkpoint_says_nothing_was_trained(cli, bert, tmp_path):
    from sdkit.minisd.train import TrainSettings, train

    settings = TrainSettings(steps=2, batch_size=2, warmup_steps=1, compile=False)
    train(tmp_path / "m", bert, settings, micro_config(bert.width), tmp_path / "ck", 1, None, False)
    again = train(tmp_path / "m", bert, settings, micro_config(bert.width), tmp_path / "ck", 1, None, False)
    assert again.resumed_from == again.steps == 2


def test_16_sizes(cli):
    assert "at least one byte" in refusal(cli("scoretable", "--chunk-budget", "0"))
    assert "multiple of 8" in refusal(cli("audit", "sd15", "--image-size", "9"))
