import json

import pytest
import torch
from diffusers.models.attention_processor import AttnProcessor2_0, SlicedAttnProcessor

from sdkit.common import SdkitError
from sdkit.conditioning import compare_conditionings, prompt_conditionings, synthetic_conditionings, write_maps
from sdkit.encoders import load_text_encoder, token_roles
from sdkit.presets import build_unet, preset_config
from sdkit.trace import CaptureProcessor, CrossAttentionTrace


def _check_single_vs_multi(comparison):
    for case in ("single", "repeated"):
        spreads = [v["spatial_spread"] for v in comparison.cases[case]["layers"].values()]
        assert len(spreads) == 16 and max(spreads) <= 1e-5, case
    assert min(v["spatial_spread"] for v in comparison.cases["multi"]["layers"].values()) >= 1e-3
    assert comparison.cases["single"]["overall"]["effective_tokens"] == pytest.approx(1.0, abs=1e-6)
    assert comparison.cases["repeated"]["overall"]["effective_tokens"] == pytest.approx(77.0, rel=1e-5)
    assert comparison.cases["repeated"]["overall"]["token_mass"] == pytest.approx([1 / 77] * 77, rel=1e-5)


def test_single_token_gives_every_cell_the_same_vector_tiny(tiny_unet):
    _check_single_vs_multi(compare_conditionings(tiny_unet, synthetic_conditionings(768)))


@pytest.mark.slow
def test_single_token_gives_every_cell_the_same_vector_sd15():
    unet = build_unet(preset_config("sd15"), weights="random")  # the real architecture, random weights
    _check_single_vs_multi(compare_conditionings(unet, synthetic_conditionings(768), latent_size=(16, 16)))


def _inputs(batch=1):
    generator = torch.Generator().manual_seed(3)
    return torch.randn(batch, 4, 16, 16, generator=generator), torch.randn(batch, 77, 768, generator=generator)


def test_processors_are_restored_exactly(tiny_unet):
    before = tiny_unet.attn_processors
    sample, text = _inputs()
    with torch.no_grad(), CrossAttentionTrace(tiny_unet):
        during = tiny_unet.attn_processors
        tiny_unet(sample, 10, text)
    assert all(during[n] is before[n] for n in before if ".attn1." in n)  # self-attention untouched
    assert all(isinstance(during[n], CaptureProcessor) for n in before if ".attn2." in n)
    assert all(tiny_unet.attn_processors[n] is before[n] for n in before)
    with pytest.raises(RuntimeError, match="boom"), CrossAttentionTrace(tiny_unet):
        raise RuntimeError("boom")
    assert all(tiny_unet.attn_processors[n] is before[n] for n in before)


def test_capture_leaves_the_output_unchanged(tiny_unet):
    sample, text = _inputs()
    with torch.no_grad():
        plain = tiny_unet(sample, 10, text).sample
        with CrossAttentionTrace(tiny_unet, maps=True):
            traced = tiny_unet(sample, 10, text).sample
    assert (traced - plain).abs().max() <= 1e-6
    assert torch.equal(traced, plain)  # the layer output is the original processor's own


def test_refuses_replaced_processors(tiny_unet):
    tiny_unet.set_attn_processor(SlicedAttnProcessor(2))
    try:
        with pytest.raises(SdkitError, match="attention slicing is on"), CrossAttentionTrace(tiny_unet):
            pass
    finally:
        tiny_unet.set_attn_processor(AttnProcessor2_0())


def test_statistics_stream_and_cfg_keeps_the_conditional_half(tiny_unet):
    sample, text = _inputs(2)
    with torch.no_grad():
        with CrossAttentionTrace(tiny_unet) as alone:
            tiny_unet(sample[1:], 10, text[1:])
        with CrossAttentionTrace(tiny_unet, cfg=True) as paired:
            for _ in range(3):  # three "steps": sums grow, memory does not
                tiny_unet(sample, 10, text)
    a, p = alone.summary(), paired.summary()
    for layer in a:
        assert p[layer]["items"] == 3 and len(p[layer]["token_mass"]) == 77
        assert p[layer]["spatial_spread"] == pytest.approx(a[layer]["spatial_spread"], rel=1e-5)
        assert p[layer]["token_mass"] == pytest.approx(a[layer]["token_mass"], rel=1e-4)
        assert sum(p[layer]["token_mass"]) == pytest.approx(1.0, abs=1e-5)


def test_entropy_matches_a_direct_computation():
    # One attn2 layer by hand: softmax weights, their entropy and the spread of the mixed values.
    from diffusers.models.attention_processor import Attention

    torch.manual_seed(0)
    attn = Attention(query_dim=8, cross_attention_dim=6, heads=2, dim_head=4)
    wrapper = torch.nn.Module()
    wrapper.attn2 = attn
    hidden, context = torch.randn(1, 9, 8), torch.randn(1, 5, 6)

    class Holder(torch.nn.Module):  # CrossAttentionTrace reads processors through the diffusers API
        def __init__(self):
            super().__init__()
            self.block = wrapper

        @property
        def attn_processors(self):
            return {"block.attn2.processor": attn.processor}

        def set_attn_processor(self, processors):
            attn.set_processor(processors["block.attn2.processor"])

    holder = Holder()
    with torch.no_grad(), CrossAttentionTrace(holder) as trace:
        attn(hidden, context)
        q = attn.to_q(hidden).view(1, 9, 2, 4).transpose(1, 2)
        k = attn.to_k(context).view(1, 5, 2, 4).transpose(1, 2)
        v = attn.to_v(context).view(1, 5, 2, 4).transpose(1, 2)
        p = torch.softmax(q @ k.transpose(-1, -2) / 2.0, -1)
        out = (p @ v).transpose(1, 2).reshape(1, 9, 8)
    stats = trace.summary()["block.attn2"]
    assert stats["entropy"] == pytest.approx(float(-(p * p.log()).sum(-1).mean()), rel=1e-5)
    assert stats["token_mass"] == pytest.approx(p.mean(dim=(0, 1, 2)).tolist(), rel=1e-5)
    spread = (out - out.mean(1, keepdim=True)).norm() / out.norm()
    assert stats["spatial_spread"] == pytest.approx(float(spread), rel=1e-5)


def test_token_roles(tiny_encoder_dir):
    encoder = load_text_encoder(tiny_encoder_dir)
    roles = token_roles(encoder.tokenizer, "a red xylophone", 77)
    words = [w for w, _ in roles.words]
    assert words == ["a", "red", "xylophone"]
    n = sum(len(ps) for _, ps in roles.words)
    assert len(roles.words[2][1]) > 1  # not in the tiny vocabulary: sub-word pieces, merged
    assert roles.roles[0] == "bos" and roles.roles[1 : n + 1] == ["word"] * n
    assert roles.roles[n + 1] == "eos" and set(roles.roles[n + 2 :]) == {"padding"}
    empty = token_roles(encoder.tokenizer, "", 77)
    assert empty.roles[:3] == ["bos", "eos", "padding"] and empty.words == []


def test_prompt_cases_and_mass_by_role(tiny_unet, tiny_encoder_dir, tmp_path):
    encoder = load_text_encoder(tiny_encoder_dir)
    conditioning = prompt_conditionings(encoder, "a photo of a red cat")
    result = compare_conditionings(tiny_unet, conditioning, maps=True)
    assert set(result.cases) == {"single", "repeated", "multi", "bos_only", "words_only"}
    assert result.cases["words_only"]["tokens"] == 7  # "cat" is two pieces (c, at) in the tiny vocabulary
    multi = result.cases["multi"]
    assert sum(multi["mass_by_role"].values()) == pytest.approx(1.0, abs=1e-5)
    assert result.cases["bos_only"]["mass_by_role"] == {"bos": pytest.approx(1.0)}
    assert [w["word"] for w in multi["mass_by_word"]] == ["a", "photo", "of", "a", "red", "cat"]
    assert result.maps.shape == (77, 16, 16)
    assert result.maps.sum(0).mean() == pytest.approx(1.0, abs=1e-4)  # weights per cell sum to one
    paths = write_maps(result, conditioning, tmp_path / "maps", shared_scale=True)
    assert len(paths) == 6 + 2 + 1  # words, <bos>, <eos>, overview
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in paths)


def test_width_mismatch_is_a_clear_error(tiny_unet, cli, tmp_path):
    from sdkit.encoders import write_tiny_clip_encoder

    with pytest.raises(SdkitError, match="1024 wide but the U-Net's cross-attention reads 768"):
        compare_conditionings(tiny_unet, synthetic_conditionings(1024))
    wide = write_tiny_clip_encoder(tmp_path / "enc1024", width=1024)
    code, _, err = cli("condition", "--text-encoder", wide)
    assert code == 2 and "1024 wide" in err and len(err.strip().splitlines()) == 1


def test_cli_condition(cli, tiny_encoder_dir, tmp_path):
    code, out, _ = cli("condition", "--json")
    assert code == 0
    data = json.loads(out)
    assert set(data["cases"]) == {"single", "repeated", "multi"}
    for name, case in data["cases"].items():
        spreads = [layer["spatial_spread"] for layer in case["layers"].values()]
        assert (max(spreads) <= 1e-5) if name != "multi" else (min(spreads) >= 1e-3)
    assert "RANDOM weights" in data["note"]
    code, out, _ = cli("condition", "--text-encoder", tiny_encoder_dir, "--prompt", "a cat", "--maps", tmp_path)
    assert code == 0 and "Attention mass by token role" in out and (tmp_path / "overview.png").exists()


def test_maps_per_prompt_are_each_prompts_own(tiny_unet, tmp_path):
    # A batch of two prompts (with classifier-free guidance: four rows) gives each prompt the maps and
    # statistics it gets when run alone, per layer and per timestep.
    generator = torch.Generator().manual_seed(5)
    samples, texts = torch.randn(2, 4, 16, 16, generator=generator), torch.randn(2, 77, 768, generator=generator)
    empty = torch.randn(1, 77, 768, generator=generator).expand(2, -1, -1)
    with torch.no_grad():
        with CrossAttentionTrace(tiny_unet, cfg=True, maps=True, by_timestep=True, keep_heads=True) as both:
            for t in (900, 100):
                tiny_unet(torch.cat([samples, samples]), t, torch.cat([empty, texts]))
        alone = []
        for i in range(2):
            with CrossAttentionTrace(tiny_unet, maps=True, by_timestep=True, keep_heads=True) as trace:
                for t in (900, 100):
                    tiny_unet(samples[i : i + 1], t, texts[i : i + 1])
            alone.append(trace)
    assert both.items == 2
    for i in range(2):
        for select in ({}, {"timesteps": [900]}, {"layers": [8]}, {"head": 1}, {"layers": [8], "timesteps": [100]}):
            torch.testing.assert_close(
                both.token_maps(item=i, **select), alone[i].token_maps(item=0, **select), rtol=1e-4, atol=1e-6
            )
        a, b = both.summary(item=i), alone[i].summary(item=0)
        for layer in a:
            assert a[layer]["spatial_spread"] == pytest.approx(b[layer]["spatial_spread"], rel=1e-4)
            assert a[layer]["token_mass"] == pytest.approx(b[layer]["token_mass"], rel=1e-4, abs=1e-7)
    assert not torch.allclose(both.token_maps(item=0), both.token_maps(item=1))
    assert {t for _, t in both.map_keys()} == {900, 100}
    with pytest.raises(SdkitError, match=r"no maps match .*timesteps 100, 900") as caught:
        both.token_maps(timesteps=[500])
    assert "grid sides 2, 4, 8, 16" in str(caught.value) and "up_blocks" in str(caught.value)
    both.save_maps(tmp_path / "maps.safetensors")
    from safetensors.torch import load_file

    raw = load_file(tmp_path / "maps.safetensors")
    assert len(raw) == len(both.map_keys()) and all(v.shape[:3] == (2, 2, 77) for v in raw.values())
