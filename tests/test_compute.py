"""The compute audit: analytic FLOPs against torch's FlopCounterMode on real forward passes."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from sdkit.compute import compute, crossover_side, format_compute, shares
from sdkit.presets import build_unet, preset_config


def counted(unet, height: int, width: int, tokens: int, batch: int = 1) -> dict[str, int]:
    """FlopCounterMode's FLOPs per module of one real forward pass (bmm attention: counted)."""
    from diffusers.models.attention_processor import AttnProcessor

    unet.set_attn_processor(AttnProcessor())
    factor = 1 if unet.config.in_channels == 3 else 8
    x = torch.randn(batch, unet.config.in_channels, height // factor, width // factor)
    states = torch.randn(batch, tokens, unet.config.cross_attention_dim)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        unet(x, 10, encoder_hidden_states=states)
    prefix = f"{type(unet).__name__}."
    return {k[len(prefix) :]: sum(v.values()) for k, v in counter.get_flop_counts().items() if k.startswith(prefix)}


def check_by_module(unet, height, width, tokens, batch=1):
    analytic = compute(unet, height, width, batch=batch, text_tokens=tokens)
    real = counted(unet, height, width, tokens, batch)
    modules = dict(unet.named_modules())
    for name, flops in analytic.modules.items():
        if name.endswith(".products"):  # the attention's own bmm: its count less its linear layers'
            attention = name.removesuffix(".products")
            children = sum(real.get(f"{attention}.{c}", 0) for c, _ in modules[attention].named_modules() if c)
            assert real[attention] - children == flops, name
        else:
            assert real.get(name, 0) == flops, name
    assert analytic.total == real[""] if "" in real else sum(v for k, v in real.items() if "." not in k)
    return analytic


@pytest.mark.parametrize("preset,sizes", [("tiny", [(64, 64), (64, 128), (128, 96)]), ("minisd", [(32, 32), (64, 48)])])
def test_analytic_flops_equal_flop_counter_by_module(preset, sizes):
    unet = build_unet(preset_config(preset), weights="random").eval()
    for height, width in sizes:
        result = check_by_module(unet, height, width, tokens=24 if preset == "minisd" else 77)
        assert result.total > 0 and sum(result.roles.values()) == result.total
    doubled = compute(unet, *sizes[0], batch=2)
    assert doubled.total == 2 * compute(unet, *sizes[0]).total == compute(unet, *sizes[0], cfg=True).total


@pytest.mark.slow
def test_sd15_flops_equal_flop_counter_at_a_small_latent():
    unet = build_unet(preset_config("sd15"), weights="random").eval()
    check_by_module(unet, 128, 128, tokens=77)


def test_sd15_at_512():
    c = compute("sd15", 512, 512)
    # GEGLU: 2 x cells x (C x 8C + 4C x C) per block; 5 blocks at each of 64, 32, 16 and one at 8 (mid)
    mlp = sum(
        blocks * 2 * cells * 12 * width**2
        for blocks, cells, width in ((5, 4096, 320), (5, 1024, 640), (5, 256, 1280), (1, 64, 1280))
    )
    assert c.roles["mlp"] == mlp == 153_511_526_400 and c.total == 803_273_441_280
    # Doubling the side: the convolutions' and MLP's work x4, self-attention's products x16.
    big = compute("sd15", 1024, 1024)
    assert (
        big.roles["mlp"] == 4 * c.roles["mlp"]
        and big.roles["self_attention.products"] == 16 * c.roles["self_attention.products"]
    )
    assert shares(c)["self_attention"] > shares(c)["mlp"]  # at 512 px already
    assert crossover_side("sd15") == 512 and crossover_side("sdxl") == 1632
    assert "803.27 GFLOPs" in format_compute(c)
    assert c.levels[1]["attention_bytes"]["self_scores"] == 8 * 4096 * 4096 * 2  # 8 heads of 4,096 x 4,096 in fp16


@pytest.mark.parametrize(
    "argv,words",
    [(["--height", "500"], "multiples of 8"), (["--height", "8"], "too small"), (["--width", "0"], "must be positive")],
)
def test_bad_sizes_are_refused(cli, argv, words):
    from tests.test_reliability import one_line

    code, _, err = cli("audit", "sd15", "--compute", *argv)
    assert words in one_line(code, err)


def test_compute_options_need_compute(cli):
    from tests.test_reliability import one_line

    code, _, err = cli("audit", "sd15", "--height", "512")
    assert "does not apply without --compute" in one_line(code, err)
