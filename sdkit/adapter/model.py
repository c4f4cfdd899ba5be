"""The adapter itself: a diffusers model from a new text encoder's token states to an old one's.

Three kinds, all with a linear map at their core: `linear`; `mlp`, a linear skip plus a GELU branch
that starts at zero; `mixer`, the linear skip plus one transformer layer over the token sequence.
Saved and loaded as diffusers saves models (config.json + safetensors).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin
from torch import nn

from ..common import SdkitError
from ..encoders import TextEncoder

KINDS = ("linear", "mlp", "mixer")


class TextEncoderAdapter(ModelMixin, ConfigMixin):
    """Per-token map from a new text encoder's states (in_dim) to an old one's (out_dim).

    kind="linear": one linear layer. kind="mlp": the same linear skip plus a GELU branch whose
    last layer starts at zero, so training starts from the linear map and can only add to it.
    kind="mixer": the same linear skip plus one pre-norm transformer layer over the token sequence
    (its output projection starts at zero), so each token's state may read its neighbours'; it
    takes (batch, tokens, width) states and the mask of the real tokens.

    standardize=True adds what makes training well-conditioned: inputs are whitened (centred and
    decorrelated with the training inputs' covariance) and targets standardised per dimension.
    Both are affine, so save_pretrained folds them into the first and last layers: a saved adapter
    is a plain linear / MLP that computes the same function.
    """

    @register_to_config
    def __init__(
        self,
        kind: str = "linear",
        in_dim: int = 1024,
        out_dim: int = 768,
        hidden_dim: int | None = None,
        standardize: bool = False,
    ):
        super().__init__()
        if kind not in KINDS:
            raise SdkitError(f"unknown adapter kind {kind!r}; choose one of {', '.join(KINDS)}")
        self.linear = nn.Linear(in_dim, out_dim)
        if kind == "mlp":
            hidden = hidden_dim or out_dim
            self.mlp = nn.Sequential(nn.Linear(in_dim, hidden), nn.GELU(), nn.Linear(hidden, out_dim))
            nn.init.zeros_(self.mlp[2].weight)
            nn.init.zeros_(self.mlp[2].bias)
        if kind == "mixer":
            hidden = hidden_dim or 256
            self.mix_in = nn.Linear(in_dim, hidden)
            self.mixer = nn.TransformerEncoderLayer(
                hidden,
                nhead=max(1, hidden // 64),
                dim_feedforward=2 * hidden,
                dropout=0.0,
                batch_first=True,
                norm_first=True,
            )
            self.mix_out = nn.Linear(hidden, out_dim)
            nn.init.zeros_(self.mix_out.weight)
            nn.init.zeros_(self.mix_out.bias)
        if standardize:
            self.register_buffer("input_mean", torch.zeros(in_dim))
            self.register_buffer("input_whitening", torch.eye(in_dim))
            self.register_buffer("target_mean", torch.zeros(out_dim))
            self.register_buffer("target_std", torch.ones(out_dim))

    def set_standardization(self, inputs: torch.Tensor, targets: torch.Tensor, eps: float = 1e-6) -> None:
        """Whitening and target scaling from training tokens. Input directions with (almost) no
        variance are scaled as if they had eps x the largest variance, not divided by zero."""
        mean = inputs.double().mean(0)
        centred = inputs.double() - mean
        values, vectors = torch.linalg.eigh(centred.T @ centred / max(len(inputs) - 1, 1))
        scale = values.clamp_min(eps * values.max()).rsqrt()
        with torch.no_grad():
            self.input_mean.copy_(mean.float())
            self.input_whitening.copy_(((vectors * scale) @ vectors.T).float())
            self.target_mean.copy_(targets.mean(0))
            self.target_std.copy_(targets.std(0).clamp_min(1e-6))

    def check_width(self, states: torch.Tensor) -> None:
        if states.shape[-1] != self.config.in_dim:
            raise SdkitError(
                f"the adapter reads {self.config.in_dim}-wide text states, but these are "
                f"{states.shape[-1]} wide (shape {list(states.shape)})"
            )

    def forward(
        self, states: torch.Tensor, mask: torch.Tensor | None = None, standardized: bool = False
    ) -> torch.Tensor:
        """Adapted states; with standardized=True, the network's output before the target scaling
        (what training fits). `mask` (batch, tokens), true at real tokens, is what the mixer may
        read (default: every position, as CLIP's padding holds states)."""
        self.check_width(states)
        if self.config.standardize:
            states = (states - self.input_mean) @ self.input_whitening
        out = self.linear(states)
        if self.config.kind == "mlp":
            out = out + self.mlp(states)
        if self.config.kind == "mixer":
            if states.ndim != 3:
                raise SdkitError(
                    f"a mixer adapter reads token sequences (batch, tokens, width), not {list(states.shape)}"
                )
            padding = None if mask is None else ~mask.bool()
            out = out + self.mix_out(self.mixer(self.mix_in(states), src_key_padding_mask=padding))
        if standardized or not self.config.standardize:
            return out
        return out * self.target_std + self.target_mean

    def folded(self) -> TextEncoderAdapter:
        """An equal adapter with the whitening and target scaling folded into its layers."""
        if not self.config.standardize:
            return self
        plain = TextEncoderAdapter(
            self.config.kind, self.config.in_dim, self.config.out_dim, self.config.hidden_dim, standardize=False
        )
        whitening, mean_in = self.input_whitening.double(), self.input_mean.double()
        std, mean_out = self.target_std.double(), self.target_mean.double()

        def fold_input(weight, bias):  # W (x - m) P  ->  (W P^T) x + (b - W P^T m)
            w = weight.double() @ whitening.T
            return w, bias.double() - w @ mean_in

        state = {}
        w, b = fold_input(self.linear.weight, self.linear.bias)
        state["linear.weight"], state["linear.bias"] = std[:, None] * w, std * b + mean_out
        if self.config.kind == "mlp":
            state["mlp.0.weight"], state["mlp.0.bias"] = fold_input(self.mlp[0].weight, self.mlp[0].bias)
            state["mlp.2.weight"] = std[:, None] * self.mlp[2].weight.double()
            state["mlp.2.bias"] = std * self.mlp[2].bias.double()
        if self.config.kind == "mixer":
            state.update({f"mixer.{k}": v for k, v in self.mixer.state_dict().items()})
            state["mix_in.weight"], state["mix_in.bias"] = fold_input(self.mix_in.weight, self.mix_in.bias)
            state["mix_out.weight"] = std[:, None] * self.mix_out.weight.double()
            state["mix_out.bias"] = std * self.mix_out.bias.double()
        plain.load_state_dict({k: v.float() for k, v in state.items()})
        return plain.to(self.device).eval()

    def save_pretrained(self, save_directory, **kwargs):
        if self.config.standardize:
            return self.folded().save_pretrained(save_directory, **kwargs)
        return super().save_pretrained(save_directory, **kwargs)


def load_adapter(folder: str | os.PathLike) -> TextEncoderAdapter:
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise SdkitError(f"{folder}: not an adapter folder (no config.json; train one with `sdkit adapter train`)")
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise SdkitError(f"{folder}: cannot read its config.json ({e})") from None
    if not isinstance(config, dict) or config.get("_class_name") != "TextEncoderAdapter":
        kind = config.get("_class_name") if isinstance(config, dict) else None
        raise SdkitError(f"{folder}: not an adapter folder (its config.json is for {kind!r})")
    if not (folder / "diffusion_pytorch_model.safetensors").is_file():
        raise SdkitError(
            f"{folder}: no diffusion_pytorch_model.safetensors here (adapters are read from safetensors "
            "only; a .bin would be a pickle)"
        )
    try:
        return TextEncoderAdapter.from_pretrained(folder, use_safetensors=True).eval()
    except Exception as e:  # diffusers raises many types for a folder it cannot load: all mean that
        raise SdkitError(f"{folder}: cannot load the adapter ({str(e).strip().splitlines()[0]})") from None


@torch.no_grad()
def adapted_embeddings(adapter: TextEncoderAdapter, encoder: TextEncoder, prompts: list[str]) -> torch.Tensor:
    """Prompt embeddings for a frozen SD 1.x U-Net: the new encoder's states through the adapter.

    Pass them to diffusers' StableDiffusionPipeline as prompt_embeds (see docs/commands/adapter.md).
    """
    states = encoder.encode(prompts).float()
    adapter.check_width(states)
    if encoder.pads_with_states:  # CLIP-style: every position holds a state and is read
        return adapter(states.to(adapter.device))
    # Masked encoders leave zeros past the prompt, and a U-Net trained on them expects zeros there.
    real = encoder.real_mask(prompts).to(adapter.device)
    return adapter(states.to(adapter.device), real) * real.unsqueeze(-1)
