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

from .demo import available_pair, explanation
from .evaluation import (METHODS, REPORT_FILE, AdapterReport, bootstrap_intervals, compare_adapters, compare_methods,
                         format_report, token_metrics, unet_noise_error)  # fmt: skip
from .model import KINDS, TextEncoderAdapter, adapted_embeddings, load_adapter
from .prompts import EncodedPrompts, check_alignment, distinct_prompts, encode_prompts, generate_prompts, read_prompts
from .training import Interrupted, TrainConfig, fit_lstsq, relative_mse, split_by_prompt, train_adapter

__all__ = ["METHODS", "KINDS", "REPORT_FILE", "AdapterReport", "EncodedPrompts", "Interrupted", "TextEncoderAdapter",
           "TrainConfig", "adapted_embeddings", "available_pair", "bootstrap_intervals", "check_alignment",
           "compare_adapters", "compare_methods", "distinct_prompts", "encode_prompts", "explanation",
           "fit_lstsq", "format_report", "generate_prompts", "load_adapter", "read_prompts", "relative_mse",
           "split_by_prompt", "token_metrics", "train_adapter", "unet_noise_error"]  # fmt: skip
