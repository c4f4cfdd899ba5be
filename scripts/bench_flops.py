"""The compute audit's FLOPs beside fvcore's and calflops' counts, on the same forward passes.

sdkit counts analytically from the config (meta device); torch's FlopCounterMode, fvcore and
calflops count a real forward pass (random weights). fvcore counts one multiply-accumulate as one
"flop", so its totals are halved beside the others; calflops reports FLOPs (2 x MACs) and MACs.
The attention products run as bmm here (diffusers' AttnProcessor): fused scaled_dot_product_attention
kernels are not counted by FlopCounterMode on the CPU (aten._scaled_dot_product_flash_attention_for_cpu
has no formula) nor by fvcore. fvcore and calflops are not sdkit's dependencies:

    pip install fvcore calflops && python scripts/bench_flops.py
"""

import torch
from diffusers.models.attention_processor import AttnProcessor
from torch.utils.flop_counter import FlopCounterMode

from sdkit.compute import compute
from sdkit.presets import build_unet, preset_config

CASES = [("tiny", 64, 77), ("minisd", 32, 24), ("sd15", 256, 77)]


class Call(torch.nn.Module):
    """The U-Net as a module of positional tensors, as fvcore and calflops trace it."""

    def __init__(self, unet):
        super().__init__()
        self.unet = unet

    def forward(self, x, t, states):
        return self.unet(x, t, encoder_hidden_states=states).sample


def main() -> None:
    rows = []
    for preset, side, tokens in CASES:
        config = preset_config(preset)
        unet = build_unet(config, weights="random").eval()
        unet.set_attn_processor(AttnProcessor())
        factor = 1 if config["in_channels"] == 3 else 8
        inputs = (
            torch.randn(1, config["in_channels"], side // factor, side // factor),
            torch.tensor([10]),
            torch.randn(1, tokens, config["cross_attention_dim"]),
        )
        ours = compute(unet, side, side, text_tokens=tokens).total
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            Call(unet)(*inputs)
        row = [f"{preset} at {side} px", ours, counter.get_total_flops()]
        try:
            from fvcore.nn import FlopCountAnalysis

            analysis = (
                FlopCountAnalysis(Call(unet), inputs).unsupported_ops_warnings(False).uncalled_modules_warnings(False)
            )
            row.append(2 * analysis.total())
        except ImportError:
            row.append(None)
        try:
            from calflops import calculate_flops

            flops, _, _ = calculate_flops(Call(unet), args=list(inputs), print_results=False, output_as_string=False)
            row.append(flops)
        except ImportError:
            row.append(None)
        rows.append(row)
    print(f"{'model':<18} {'sdkit (analytic)':>18} {'FlopCounterMode':>18} {'fvcore x 2':>18} {'calflops':>18}")
    for name, *values in rows:
        print(f"{name:<18} " + " ".join(f"{v:>18,}" if v is not None else f"{'not installed':>18}" for v in values))


if __name__ == "__main__":
    main()
