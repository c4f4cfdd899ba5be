"""The trace in words, on a stock diffusers SD pipeline (DAAM's `word_map("cat")`): prompts read from
the text encoder's input, guidance's halves told apart from the pipeline call, maps at the image's
size, overlays, and steering guides given by words."""

import numpy as np
import pytest
import torch

from sdkit.common import SdkitError
from sdkit.trace import CrossAttentionTrace, overlay

PROMPTS = ["a red cat on a blue chair", "a dog"]


def traced(pipe, half="conditional", guidance_scale=7.5):
    pipe.set_progress_bar_config(disable=True)
    with CrossAttentionTrace(pipe, maps=True, by_timestep=True, half=half) as trace:
        out = pipe(
            PROMPTS, num_inference_steps=2, guidance_scale=guidance_scale, generator=torch.Generator().manual_seed(0)
        )
    return trace, out


@pytest.fixture(scope="module")
def runs(tiny_sd):
    pipe, _ = tiny_sd
    return {half: traced(pipe, half) for half in ("conditional", "unconditional", "both")}


def test_a_guided_call_is_traced_on_its_conditional_half(runs):
    conditional, _ = runs["conditional"]
    both, _ = runs["both"]
    unconditional, _ = runs["unconditional"]
    assert conditional.cfg and conditional.items == 2 and both.items == 4 and unconditional.items == 2
    for item in range(2):
        assert torch.equal(conditional.token_maps(item=item), both.token_maps(item=2 + item))
        assert torch.equal(unconditional.token_maps(item=item), both.token_maps(item=item))
    # the halves differ: an empty prompt's attention is not a prompt's
    assert not torch.allclose(conditional.token_maps(item=0), unconditional.token_maps(item=0))
    assert len(both.prompt_ids) == 4 and both.prompt_ids[2:] == conditional.prompt_ids


def test_without_guidance_the_whole_batch_is_the_prompts(tiny_sd, runs):
    pipe, _ = tiny_sd
    plain, _ = traced(pipe, guidance_scale=1.0)
    assert not plain.cfg and plain.items == 2 and plain.prompt_ids == runs["conditional"][0].prompt_ids


def test_a_word_map_is_the_sum_of_its_pieces(runs):
    trace, _ = runs["conditional"]
    words = dict(trace.words(0))
    assert list(words) == ["a", "red", "cat", "on", "blue", "chair"] and len(words["cat"]) == 2  # cat: two pieces
    tokens = trace.token_maps(item=0, size=(64, 64))
    assert torch.allclose(trace.word_map("cat"), tokens[words["cat"]].sum(0), atol=1e-7)
    first_step = [trace.map_keys()[0][1]]
    per_token = trace.token_maps(item=0, timesteps=first_step, size=(64, 64))
    assert torch.allclose(trace.word_map("Cat", item=0, timesteps=first_step), per_token[words["cat"]].sum(0))
    # "a" is two words of the prompt: both occurrences count
    a_positions = [p for w, ps in trace.words(0) if w == "a" for p in ps]
    assert len(a_positions) == 2 and torch.allclose(trace.word_map("a"), tokens[a_positions].sum(0), atol=1e-7)


def test_maps_at_the_image_size_or_the_latent(runs):
    trace, out = runs["conditional"]
    image = out.images[0]
    assert trace.word_map("cat").shape == (image.size[1], image.size[0]) == (64, 64)
    assert trace.word_map("cat", size="latent").shape == (32, 32)
    assert trace.word_map("dog", item=1, size=(8, 16)).shape == (8, 16)


def test_a_word_the_prompt_lacks_is_one_clear_error(runs, tiny_unet):
    trace, _ = runs["conditional"]
    with pytest.raises(
        SdkitError, match="'horse' is not a word of prompt 0; its words: a, red, cat, on, a, blue, chair"
    ):
        trace.word_map("horse")
    with pytest.raises(SdkitError, match="item 2 is not a traced prompt"):
        trace.word_map("cat", item=2)
    with CrossAttentionTrace(tiny_unet, maps=True) as bare:
        tiny_unet(torch.randn(1, 4, 8, 8), 500, encoder_hidden_states=torch.randn(1, 77, 768))
    with pytest.raises(SdkitError, match="words need the pipeline"):
        bare.word_map("cat")
    assert bare.token_maps(item=0).shape == (77, 8, 8)  # positions stay available underneath


def test_an_overlay_blends_the_map_over_the_image(runs):
    trace, out = runs["conditional"]
    image, heat = out.images[0], trace.word_map("cat")
    shown = overlay(image, heat, alpha=0.5)
    assert shown.size == image.size and shown.mode == "RGB"
    assert np.array_equal(np.asarray(overlay(image, heat, alpha=0.0)), np.asarray(image.convert("RGB")))
    full = np.asarray(overlay(image, heat, alpha=1.0)).astype(int)
    from matplotlib import colormaps

    row, col = np.unravel_index(int(heat.argmax()), heat.shape)
    top = np.round(np.array(colormaps["inferno"](1.0)[:3]) * 255).astype(int)
    assert np.abs(full[row, col] - top).max() <= 1  # the hottest cell gets the colour map's top
    with pytest.raises(SdkitError, match="alpha must lie in"):
        overlay(image, heat, alpha=2)


def test_guides_by_words_are_guides_by_their_positions(tiny_sd):
    from sdkit.steering import Guide

    pipe, _ = tiny_sd
    region = torch.zeros(4, 4)
    region[:, :2] = 1
    bind = [("red", "cat", ["chair"])]
    by_words = Guide.from_words(
        pipe.tokenizer, PROMPTS[0], excite=["cat", "chair"], bind=bind, layout=[("cat", region)]
    )
    assert by_words.excite == [[3, 4], [8]]
    assert by_words.bind == [([2], [3, 4], [[8]])]
    assert by_words.layout[0][0] == [3, 4] and by_words.layout[0][1] is region
    with pytest.raises(SdkitError, match="'horse' is not a word of 'a red cat on a blue chair'"):
        Guide.from_words(pipe.tokenizer, PROMPTS[0], excite=["horse"])


def test_sample_draws_each_words_map_over_each_image(cli, micro_minisd, tmp_path):
    import json

    from sdkit.common import folder_record
    from tests.test_reliability import one_line

    folder, encoder = micro_minisd
    base = [
        "minisd",
        "sample",
        "a red circle at the top left",
        "a blue square",
        "--seeds",
        "2",
        "--steps",
        "2",
        "--model",
        folder,
        "--text-encoder",
        encoder,
        "--out",
        tmp_path / "grid.png",
    ]
    code, out, err = cli(*base, "--overlays", tmp_path / "maps")
    assert code == 0, err
    files = sorted(p.name for p in (tmp_path / "maps").iterdir())
    assert files == ["000_seed0.png", "001_seed1.png", "002_seed0.png", "003_seed1.png", "maps.json", "sdkit.json"]
    assert folder_record(tmp_path / "maps")["kind"] == "maps"
    assert json.loads((tmp_path / "maps" / "maps.json").read_text())["seeds"] == [0, 1, 0, 1]
    assert "each word's map over each image" in out
    line = one_line(*cli(*base, "--overlays", tmp_path / "m2", "--guide", "layout")[::2])
    assert "--guide does not apply with --overlays" in line
