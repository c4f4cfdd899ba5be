import json
import shutil

import pytest
import torch

from sdkit.adapter import (
    Interrupted,
    TextEncoderAdapter,
    TrainConfig,
    check_alignment,
    compare_adapters,
    encode_prompts,
    fit_lstsq,
    format_report,
    generate_prompts,
    load_adapter,
    relative_mse,
    split_by_prompt,
    train_adapter,
)
from sdkit.common import SdkitError
from sdkit.encoders import load_text_encoder

PROMPTS = generate_prompts(200, seed=0)


@pytest.fixture(scope="module")
def encoded(tiny_pair, tmp_path_factory):
    data, from_cache = encode_prompts(*tiny_pair, PROMPTS, tmp_path_factory.mktemp("cache"), progress=False)
    assert not from_cache
    train_idx, val_idx, test_idx = split_by_prompt(len(PROMPTS))
    return data.subset(train_idx).tokens(), data.subset(val_idx).tokens(), data.subset(test_idx).tokens()


def test_generated_prompts():
    prompts = generate_prompts(2000, seed=3)
    assert prompts == generate_prompts(2000, seed=3)
    assert 5 <= prompts.count("") <= 40  # about 1 %
    assert len(set(prompts)) > 1500


def test_save_load_gives_identical_outputs(tmp_path):
    torch.manual_seed(0)
    adapter = TextEncoderAdapter("mlp", 64, 48, standardize=True)
    adapter.set_standardization(torch.randn(500, 64) * 3 + 1, torch.randn(500, 48) * 5 - 2)
    with torch.no_grad():
        adapter.mlp[2].weight.normal_()  # a trained-looking branch, not the zero start
    adapter.save_pretrained(tmp_path / "a")
    assert (tmp_path / "a" / "diffusion_pytorch_model.safetensors").is_file()
    loaded = load_adapter(tmp_path / "a")
    assert not loaded.config.standardize  # folded into the layers when saved
    x = torch.randn(3, 77, 64)
    with torch.no_grad():
        assert torch.equal(loaded(x), adapter.folded()(x))
        torch.testing.assert_close(loaded(x), adapter(x), rtol=1e-4, atol=1e-4)
    loaded.save_pretrained(tmp_path / "b")
    with torch.no_grad():
        assert torch.equal(load_adapter(tmp_path / "b")(x), loaded(x))


def test_wrong_width_is_a_clear_error():
    adapter = TextEncoderAdapter("linear", 1024, 768)
    with pytest.raises(SdkitError, match="reads 1024-wide text states, but these are 768 wide"):
        adapter(torch.randn(1, 77, 768))


def test_alignment_refuses_a_mismatched_pair(tiny_pair, tmp_path):
    new, old = tiny_pair
    other = tmp_path / "other"
    shutil.copytree(new.source, other)
    merges = other / "tokenizer" / "merges.txt"
    merges.write_text("\n".join(line for line in merges.read_text().splitlines() if not line.startswith("p h")) + "\n")
    mismatched = load_text_encoder(other)
    check_alignment(new, old, ["a photo of a cat"])  # the shared tokenizer aligns
    with pytest.raises(SdkitError, match=r"do not align: prompt 'a photo of a cat', position 2"):
        check_alignment(mismatched, old, ["a cat", "a photo of a cat"])


def test_trained_linear_reaches_the_least_squares_optimum(encoded):
    (x, y), val, _ = encoded
    mean = y.mean(0)
    adapter, history = train_adapter(
        (x, y), val, TrainConfig(kind="linear", max_epochs=10, patience=100), progress=False
    )
    with torch.no_grad():
        optimum = relative_mse(fit_lstsq(x, y)(x), y, mean)
        trained = relative_mse(adapter(x), y, mean)
    assert len(history) == 11
    assert optimum < 0.5  # the pair is learnable, so the comparison means something
    assert trained <= 1.02 * optimum, (trained, optimum)


def test_cache_is_reused_when_settings_match_and_rebuilt_when_not(tiny_pair, tmp_path):
    new, old = tiny_pair
    prompts = PROMPTS[:20]
    first, hit = encode_prompts(new, old, prompts, tmp_path, progress=False)
    assert not hit
    again, hit = encode_prompts(new, old, prompts, tmp_path, progress=False)
    assert hit and torch.equal(again.new, first.new) and torch.equal(again.roles, first.roles)
    assert torch.equal(again.real, new.tokenize(prompts)["attention_mask"].bool()) and again.padding_states
    penultimate = load_text_encoder(new.source, layer="penultimate")
    changed, hit = encode_prompts(penultimate, old, prompts, tmp_path, progress=False)
    assert not hit and not torch.equal(changed.new, first.new)
    _, hit = encode_prompts(new, old, prompts[:19], tmp_path, progress=False)
    assert not hit
    assert len(list(tmp_path.iterdir())) == 3  # one cache folder per distinct setting


@pytest.mark.slow  # half a minute; the mini SD's resume test runs by default
def test_interrupted_training_resumes_to_the_same_result(encoded, tmp_path):
    train, val, (x_test, y_test) = encoded
    config = TrainConfig(kind="mlp", max_epochs=4, patience=100)
    whole, _ = train_adapter(train, val, config, tmp_path / "whole.safetensors", progress=False)
    checkpoint = tmp_path / "killed.safetensors"
    with pytest.raises(Interrupted):
        train_adapter(train, val, config, checkpoint, progress=False, stop_after=2)
    resumed, history = train_adapter(train, val, config, checkpoint, progress=False)
    assert [h["epoch"] for h in history] == [0, 1, 2, 3, 4]
    mean = train[1].mean(0)
    with torch.no_grad():
        a, b = relative_mse(whole(x_test), y_test, mean), relative_mse(resumed(x_test), y_test, mean)
    assert a == pytest.approx(b, rel=1e-5)
    with pytest.raises(SdkitError, match="trained with other settings \\(lr\\)"):
        train_adapter(
            train, val, TrainConfig(kind="mlp", max_epochs=4, patience=100, lr=1e-3), checkpoint, progress=False
        )


def test_comparison_against_baselines(tiny_pair, tiny_unet, tmp_path):
    report = compare_adapters(
        *tiny_pair,
        PROMPTS[:100],
        config=TrainConfig(max_epochs=4),
        unet=tiny_unet,
        unet_name="tiny",
        cache_dir=tmp_path / "cache",
        out_dir=tmp_path / "out",
        progress=False,
    )
    m = report.methods
    assert list(m) == ["width_only", "mean", "lstsq", "linear", "mlp"]
    assert m["mean"]["rel_mse"] == pytest.approx(1.0, abs=0.05)  # by definition, up to train/test shift
    assert m["width_only"]["rel_mse"] > 1.0  # matching the width is not matching the meaning
    for method in ("lstsq", "linear", "mlp"):
        assert m[method]["rel_mse"] < 0.5 * m["mean"]["rel_mse"]
        assert m[method]["unet_rel_error"] < m["width_only"]["unet_rel_error"]
    assert set(m["lstsq"]) >= {
        "cosine",
        "cosine_centred",
        "rel_mse_bos",
        "rel_mse_word",
        "rel_mse_eos_padding",
        "pooled_cosine",
        "prompt_top1",
        "unet_rel_to_text_effect",
    }
    assert (
        json.loads((tmp_path / "out" / "report.json").read_text())["methods"]["mlp"]["rel_mse"] == m["mlp"]["rel_mse"]
    )
    assert load_adapter(tmp_path / "out" / "mlp").config.kind == "mlp"
    assert load_adapter(tmp_path / "out" / "lstsq").config.kind == "linear"  # saved too: it often ties
    for method in m.values():
        lo, hi = method["interval"]["rel_mse"]
        assert lo <= method["rel_mse"] <= hi
    text = format_report(report)
    assert "the best linear map" in text and "Columns:" in text
    assert max(len(line) for line in text.splitlines()) <= 120


def test_the_unet_error_ignores_what_an_adapter_writes_where_the_unet_reads_nothing(tiny_unet):
    from sdkit.adapter import unet_noise_error

    # A masked encoder's states: three prompts of 3, 5 and 8 tokens, zeros past them (as the U-Net saw
    # in training). The adapter gets every state right but writes garbage at the padding, where
    # adapted_embeddings zeroes it before any U-Net reads it.
    generator = torch.Generator().manual_seed(0)
    read = torch.arange(8) < torch.tensor([[3], [5], [8]])
    true = torch.randn(3, 8, 768, generator=generator) * read.unsqueeze(-1)
    predicted = torch.where(read.unsqueeze(-1), true, torch.randn(3, 8, 768, generator=generator))
    empty = torch.zeros(1, 8, 768)
    kept = unet_noise_error(tiny_unet, predicted, true, empty, read, timesteps=(500,), seeds=(0,))
    assert kept["unet_rel_error"].tolist() == [0.0, 0.0, 0.0]  # the states it reads are the true ones
    garbage = unet_noise_error(tiny_unet, predicted, true, empty, timesteps=(500,), seeds=(0,))
    assert (garbage["unet_rel_error"][:2] > 0.01).all() and garbage["unet_rel_error"][2] == 0.0


def test_bootstrap_verdict_needs_separated_intervals():
    from sdkit.adapter import AdapterReport, bootstrap_intervals, compare_methods
    from sdkit.adapter.evaluation import _aggregate

    def method(mean_error: float) -> dict:  # 40 held-out prompts, the same noisy per-prompt errors
        noise = torch.rand(40, generator=torch.Generator().manual_seed(0))
        parts = {"rel_mse.num": (mean_error + 0.3 * noise).double(), "rel_mse.den": torch.ones(40, dtype=torch.float64)}
        return {**_aggregate(parts), "interval": bootstrap_intervals(parts, samples=400)}

    close = AdapterReport(
        "new",
        "old",
        {"train": 1, "val": 1, "test": 40},
        {"train": 1, "val": 1, "test": 1},
        False,
        methods={"lstsq": method(0.300), "mlp": method(0.298)},
    )
    assert close.methods["mlp"]["rel_mse"] < close.methods["lstsq"]["rel_mse"]  # "better" by the point value ...
    assert compare_methods(close, "mlp", "lstsq") == "within noise"  # ... but not beyond the noise
    assert "ties (intervals overlap)" in format_report(close)
    far = AdapterReport(
        "new", "old", close.prompts, close.tokens, False, methods={"lstsq": method(0.6), "mlp": method(0.2)}
    )
    assert compare_methods(far, "mlp", "lstsq") == "better" and "mlp beats" in format_report(far)


def test_cli_adapter(cli, tiny_pair, tmp_path):
    code, out, _ = cli("adapter")
    assert code == 0 and "width_only" in out and "sdkit adapter demo" in out
    new, _ = tiny_pair
    adapter = TextEncoderAdapter("linear", 1024, 768)
    adapter.save_pretrained(tmp_path / "adapter")
    code, out, _ = cli(
        "adapter",
        "encode",
        "a red cat",
        "a dog",
        "--adapter",
        tmp_path / "adapter",
        "--new",
        new.source,
        "--negative",
        "",
        "--out",
        tmp_path / "embeds.safetensors",
    )
    assert code == 0
    from safetensors.torch import load_file

    embeds = load_file(tmp_path / "embeds.safetensors")
    assert embeds["prompt_embeds"].shape == (2, 77, 768) and embeds["negative_prompt_embeds"].shape == (2, 77, 768)
    code, _, err = cli(
        "adapter",
        "encode",
        "x",
        "--adapter",
        tmp_path / "adapter",
        "--new",
        tiny_pair[1].source,
        "--out",
        tmp_path / "bad.safetensors",
    )
    assert code == 2 and "768 wide" in err and not (tmp_path / "bad.safetensors").exists()
    code, _, err = cli(
        "adapter", "train", "--new", new.source, "--old", tiny_pair[1].source, "--corpus", tmp_path / "missing.txt"
    )
    assert code == 2 and "missing.txt: no such prompt file" in err


def test_repeated_prompts_are_merged_before_the_split(tiny_pair, tmp_path):
    from sdkit.adapter import distinct_prompts

    new, old = tiny_pair
    five = [f"a {c} cat on a mat" for c in ("red", "blue", "green", "white", "black")]
    # Case and spacing are the tokenizers' own normalisation: these read the same tokens.
    prompts, merged = distinct_prompts(new, old, [p for _ in range(20) for p in five] + ["A  RED cat on a mat"])
    assert prompts == five and merged == 96
    report = compare_adapters(new, old, five * 20, ("linear",), TrainConfig(max_epochs=1), progress=False)
    assert report.prompts == {"train": 3, "val": 1, "test": 1, "duplicates_merged": 95, "cut_to_positions": 0}
    assert report.methods["lstsq"]["rel_mse"] > 1e-3  # the held-out prompt was never a training prompt
    assert "95 repeated prompts merged" in format_report(report)
    with pytest.raises(SdkitError, match="too few"):
        compare_adapters(new, old, ["one prompt"] * 100, ("linear",), TrainConfig(max_epochs=1), progress=False)


def test_the_empty_prompt_always_trains():
    for seed in range(20):
        train, val, test = split_by_prompt(30, seed, train_only=[7])
        assert 7 in train and 7 not in val + test and sorted(train + val + test) == list(range(30))


def test_cli_demo_builds_tiny_encoders_in_the_cache_not_the_working_tree(cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SDKIT_CACHE", str(tmp_path / "cache"))
    code, out, err = cli(
        "adapter",
        "demo",
        "--encoders-dir",
        tmp_path / "encoders",
        "--out",
        tmp_path / "adapters",
        "--prompts",
        "60",
        "--epochs",
        "1",
        "--kinds",
        "linear",
        "--unet",
        "none",
        "--json",
    )
    assert code == 0, err
    report = json.loads(out)
    assert "tiny CLIP-shaped encoders" in report["encoders"] and str(tmp_path / "cache") in report["encoders"]
    assert (tmp_path / "cache" / "tiny-encoders" / "tiny-clip-1024" / "text_encoder" / "config.json").is_file()
    assert len(list((tmp_path / "cache").glob("*/index.json"))) == 1  # the encoded states
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapters", "cache"]  # nothing under ./weights
    assert (tmp_path / "adapters" / "report.json").is_file() and (tmp_path / "adapters" / "linear").is_dir()


def test_the_default_cache_follows_the_platform(monkeypatch, tmp_path):
    from sdkit.common import default_cache

    monkeypatch.delenv("SDKIT_CACHE", raising=False)
    monkeypatch.setattr("sys.platform", "linux")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache() == tmp_path / "xdg" / "sdkit"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_cache() == tmp_path / ".cache" / "sdkit"
    monkeypatch.setattr("sys.platform", "darwin")
    assert default_cache() == tmp_path / "Library" / "Caches" / "sdkit"
    monkeypatch.setenv("SDKIT_CACHE", str(tmp_path / "mine"))
    assert default_cache() == tmp_path / "mine"


def test_a_report_says_when_training_never_beat_its_start(tiny_pair):
    new, old = tiny_pair
    prompts = generate_prompts(60, seed=4)
    # A learning rate this large (the largest allowed) only makes the mlp (started at the lstsq map) worse.
    report = compare_adapters(
        new, old, prompts, ("mlp",), TrainConfig(max_epochs=2, lr=1.0, patience=5), progress=False
    )
    assert report.best_epochs == {"mlp": 0}
    assert report.histories["mlp"][0]["epoch"] == 0 and report.histories["mlp"][-1]["epoch"] == 2
    text = format_report(report)
    assert "mlp: 2 epochs never beat the start (epoch 0" in text
    assert report.methods["mlp"]["rel_mse"] == pytest.approx(report.methods["lstsq"]["rel_mse"], rel=1e-3)
    report = compare_adapters(new, old, prompts, ("linear",), TrainConfig(max_epochs=3), progress=False)
    assert report.best_epochs["linear"] > 0 and "of 3; epoch 0: " in format_report(report)


def test_the_explanation_loads_no_torch_and_the_package_names_load_on_use(tmp_path):
    import subprocess
    import sys

    import sdkit.adapter

    code = (
        "import sys; from sdkit.cli import main; rc = main(['adapter', '--encoders-dir', sys.argv[1]]); "
        "heavy = [m for m in ('torch', 'diffusers', 'transformers') if m in sys.modules]; "
        "assert not heavy, heavy; sys.exit(rc)"
    )
    run = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("sdkit adapter: swap the text encoder")
    assert set(sdkit.adapter.__all__) <= set(dir(sdkit.adapter)) and "compare_adapters" in sdkit.adapter.__all__
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        sdkit.adapter.nothing  # noqa: B018 (the attribute access is what is tested)
