"""Swap SD 1.x's text encoder: train an adapter from a new encoder's token states to the old one's.

SD 1.x's cross-attention key/value matrices read 768-wide CLIP ViT-L/14 states. A 1024-wide
encoder (SD 2.x's OpenCLIP ViT-H/14) differs in size and in what every coordinate means. The
adapter maps new token states to where the old encoder would have put them, per token, so the
U-Net stays frozen. We fit the best linear map in closed form, train linear and MLP adapters,
and measure all of them against honest baselines, down to the U-Net's noise prediction.

    model.py       the adapter (a diffusers model), loading it, prompt embeddings through it
    prompts.py     generated or read prompts, repeats merged, both encoders' states and their cache
    training.py    the split by prompt, least squares, gradient training with checkpoints
    evaluation.py  metrics with bootstrap intervals, the U-Net check, compare_adapters and its report
    demo.py        the encoder pair at hand, and what `sdkit adapter` says of itself
"""

import importlib

# Names are loaded on first use (PEP 562): `sdkit adapter`'s explanation needs none of torch, and a
# notebook's `from sdkit.adapter import compare_adapters` loads what it names.
_HOMES = {
    "demo": ("available_pair", "explanation"),
    "evaluation": (
        "METHODS",
        "REPORT_FILE",
        "AdapterReport",
        "bootstrap_intervals",
        "compare_adapters",
        "compare_methods",
        "format_report",
        "token_metrics",
        "unet_noise_error",
    ),
    "model": ("KINDS", "TextEncoderAdapter", "adapted_embeddings", "load_adapter"),
    "prompts": (
        "EncodedPrompts",
        "check_alignment",
        "distinct_prompts",
        "encode_prompts",
        "generate_prompts",
        "read_prompts",
    ),
    "training": ("Interrupted", "TrainConfig", "fit_lstsq", "relative_mse", "split_by_prompt", "train_adapter"),
}
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}
__all__ = sorted(_HOME_OF)


def __getattr__(name: str):
    if name not in _HOME_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_HOME_OF[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
