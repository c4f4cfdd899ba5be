"""The mechanics of the findings on tiny models: scores against hand-made maps, the one-token
conditions, and the localisation and generation runs end to end (numbers on trained weights are in
the docs, from scripts/findings.py)."""

from pathlib import Path

import numpy as np
import pytest
import torch

from sdkit.localization import Localization, auc, centre_prior, format_localization, iou, object_words
from sdkit.minisd.conditions import TokenComparison, format_token_comparison
from sdkit.minisd.data import pair_scene, single_scene


def test_iou_and_auc_on_hand_made_maps():
    mask = np.zeros((8, 8), bool)
    mask[2:4, 2:4] = True
    exact = mask.astype(float)
    assert iou(exact, mask) == 1.0 and auc(exact, mask) == 1.0
    inverted = 1 - exact
    assert iou(inverted, mask) == 0.0 and auc(inverted, mask) == 0.0
    uniform = np.ones((8, 8))
    assert iou(uniform, mask) == pytest.approx(4 / 64) and auc(uniform, mask) == 0.5
    half = exact.copy()
    half[2:4, 4:6] = 0.5  # a second blob at half height: cut by tau = 0.6, kept by 0.4
    assert iou(half, mask, 0.6) == 1.0 and iou(half, mask, 0.4) == pytest.approx(0.5)
    ramp = np.tile(np.arange(8.0), (8, 1))  # brighter to the right; the mask sits at columns 2-3
    inside = ramp[mask]
    outside = ramp[~mask]
    expected = ((inside[:, None] > outside[None]).sum() + 0.5 * (inside[:, None] == outside[None]).sum()) / (
        len(inside) * len(outside)
    )
    assert auc(ramp, mask) == pytest.approx(expected)
    prior = centre_prior(8)
    assert prior.argmax() in (27, 28, 35, 36) and prior.max() == pytest.approx(prior[3, 3])


def test_words_are_matched_to_their_objects(tmp_path):
    from sdkit.encoders import load_text_encoder, token_roles, write_tiny_bert_encoder

    tokenizer = load_text_encoder(write_tiny_bert_encoder(tmp_path / "bert", 32)).tokenizer
    scene = pair_scene(("red", "square"), "left of", ("red", "circle"), template=0)
    words = object_words(token_roles(tokenizer, scene.caption, 24), scene.objects)
    assert [(w["word"], w["kind"], w["object"]) for w in words] == [
        ("red", "colour", 0),
        ("square", "shape", 0),
        ("red", "colour", 1),
        ("circle", "shape", 1),
    ]
    single = single_scene("magenta", "triangle", "top", template=5)  # "a triangle colored magenta at the top"
    words = object_words(token_roles(tokenizer, single.caption, 24), single.objects)
    assert {(w["word"], w["object"]) for w in words} == {("triangle", 0), ("magenta", 0)}
    assert all(len(w["positions"]) >= 1 for w in words)


@pytest.fixture(scope="module")
def micro_pipes(tmp_path_factory):
    from sdkit.encoders import load_text_encoder, write_tiny_bert_encoder
    from sdkit.minisd.pipeline import MiniSDPipeline
    from sdkit.minisd.train import TrainSettings, train

    root = tmp_path_factory.mktemp("findings")
    bert = load_text_encoder(write_tiny_bert_encoder(root / "bert", 32))
    config = {
        "_class_name": "UNet2DConditionModel",
        "in_channels": 3,
        "out_channels": 3,
        "sample_size": 32,
        "block_out_channels": [16, 32],
        "layers_per_block": 1,
        "norm_num_groups": 8,
        "attention_head_dim": 2,
        "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
        "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
        "cross_attention_dim": 32,
    }
    pipes = {}
    for conditioning in ("tokens", "pooled"):
        out = root / conditioning
        train(
            out,
            bert,
            TrainSettings(steps=2, batch_size=4, warmup_steps=1, conditioning=conditioning, compile=False),
            config,
            progress=False,
            cache_dir=None,
        )
        pipes[conditioning] = MiniSDPipeline.from_pretrained(out, text_encoder=bert.source)
    return pipes


def test_the_pooled_model_reads_one_key_value(micro_pipes):
    from sdkit.trace import CrossAttentionTrace

    pipe = micro_pipes["pooled"]
    states = pipe.encode(["a red circle at the top", "a blue square to the left of a green triangle"])
    assert states.shape == (2, 1, 32)
    with torch.no_grad(), CrossAttentionTrace(pipe.unet) as trace:
        pipe.unet(torch.randn(2, 3, 32, 32), 500, encoder_hidden_states=states)
    for stats in trace.summary().values():
        assert stats["token_mass"] == [pytest.approx(1.0)]  # one key: all the weight on it
        assert stats["spatial_spread"] < 1e-5  # every cell receives the same vector


def test_token_conditions_have_the_right_shapes(micro_pipes):
    from sdkit.minisd.conditions import CONDITIONS, condition_states

    pipe = micro_pipes["tokens"]
    captions = ["a red circle at the top", "a blue square to the left of a green triangle"]
    states = condition_states(pipe, captions)
    assert set(states) == set(CONDITIONS)
    assert [s.shape[0] for s in states["tokens"]] == [pipe.spec.max_length] * 2
    assert all(s.shape[0] == 1 for name in ("pooled", "eos", "bos only") for s in states[name])
    assert states["words only"][0].shape[0] == 6 and states["words only"][1].shape[0] == 10
    assert torch.equal(states["pooled repeated"][0][0], states["pooled"][0][0])


def test_findings_commands_run_on_a_micro_model(micro_pipes, cli, tmp_path):
    import json

    folder = tmp_path / "model"
    micro_pipes["tokens"].save_pretrained(folder)
    pooled = tmp_path / "pooled"
    micro_pipes["pooled"].save_pretrained(pooled)
    encoder = micro_pipes["tokens"].encoder.source
    code, out, err = cli(
        "condition",
        "--unet",
        folder,
        "--text-encoder",
        encoder,
        "--masks",
        "--count",
        "4",
        "--timesteps",
        "300,700",
        "--steps",
        "2",
        "--json",
        "--plot",
        tmp_path / "maps.png",
    )
    assert code == 0, err
    reports = json.loads(out)["localization"]
    assert [r["images"] for r in reports] == ["generator", "generated"]
    generator = reports[0]
    assert {row["timestep"] for row in generator["rows"]} == {300, 700}
    word = [row["word"] for row in generator["rows"] if row["resolution"] == "all layers" and row["word"]]
    assert word and all(0 <= w["auc"] <= 1 and 0 <= w["iou"] <= 1 for w in word)
    uniform = [row["uniform"]["auc"] for row in generator["rows"] if row["uniform"]]
    assert uniform and all(a == 0.5 for a in uniform)
    assert sum(generator["mass_by_role"].values()) == pytest.approx(1.0, abs=1e-4)
    best_layer = max(generator["by_layer"], key=lambda x: x["word"]["auc"])
    text = format_localization(Localization(**generator))
    assert f"Best single layer: {best_layer['layer']}" in text
    assert max(len(line) for line in text.splitlines() if str(folder) not in line) <= 120
    assert (tmp_path / "maps-generator.png").is_file()
    assert json.loads(out)["pictures"][0] == str(tmp_path / "maps-generator.png")
    assert all(Path(p).is_file() for p in json.loads(out)["pictures"])
    code, out, err = cli(
        "condition",
        "--unet",
        folder,
        "--text-encoder",
        encoder,
        "--generate",
        "--count",
        "2",
        "--steps",
        "2",
        "--pooled-model",
        pooled,
        "--json",
        "--plot",
        tmp_path / "tokens.png",
    )
    assert code == 0, err
    comparison = json.loads(out)
    results = comparison["results"]
    text = format_token_comparison(TokenComparison(**comparison))
    assert "A model trained on the pooled state only" in text
    assert max(len(line) for line in text.splitlines() if str(folder) not in line) <= 120
    assert set(results) == {
        "tokens",
        "pooled",
        "eos",
        "pooled repeated",
        "words only",
        "bos only",
        "pooled-trained model",
    }
    assert (tmp_path / "tokens.png").read_bytes()[:4] == b"\x89PNG"
    code, _, err = cli("condition", "--unet", "tiny", "--masks")
    assert code == 2 and "mini SD folder" in err


def test_adapters_drive_the_mini_sd_with_the_right_widths(micro_pipes, tmp_path):
    from sdkit.adapter import TrainConfig, compare_adapters, load_adapter
    from sdkit.encoders import load_text_encoder, write_tiny_bert_encoder
    from sdkit.minisd.adapters import judge_adapters, training_captions

    pipe = micro_pipes["tokens"]
    new = load_text_encoder(write_tiny_bert_encoder(tmp_path / "wide", 48, seed=1), context_length=pipe.spec.max_length)
    old = load_text_encoder(pipe.encoder.source, context_length=pipe.spec.max_length)
    prompts = training_captions(120)
    assert not any(p in {"a red triangle at the bottom right"} for p in prompts)  # no held-out combination
    report = compare_adapters(
        new,
        old,
        prompts,
        ("linear", "mixer"),
        TrainConfig(max_epochs=2),
        pipe.unet,
        "micro",
        out_dir=tmp_path / "out",
        progress=False,
    )
    mixer = load_adapter(tmp_path / "out" / "mixer")
    assert (mixer.config.in_dim, mixer.config.out_dim, mixer.config.kind) == (48, 32, "mixer")
    with torch.no_grad():  # the saved (folded) mixer computes what the trained one did
        states, real = new.encode(prompts[:3]), new.real_mask(prompts[:3])
        torch.testing.assert_close(mixer(states, real), report.adapters["mixer"](states, real), rtol=1e-4, atol=1e-4)
    judged = judge_adapters(
        pipe,
        new,
        {k: report.adapters[k] for k in ("width_only", "linear", "mixer")},
        sets=("singles",),
        count=2,
        steps=2,
    )
    assert set(judged["results"]) == {"native", "width_only", "linear", "mixer"}
    assert all(v is None or 0 <= v <= 1 for r in judged["results"].values() for v in r["singles"].values())
