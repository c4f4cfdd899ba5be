"""One token against many, on a model that has learned: what a single key/value loses.

In cross-attention every image cell reads a softmax-weighted mix of the token values. With one
token (or one token repeated) the weights are all equal, so every cell receives the same vector:
the text can say what, but not where or which-is-which. Here the trained mini SD is driven with

    tokens           every token state, as trained
    pooled           the mean of the token states: one key/value
    eos              the [SEP] state (what CLIP would pool): one key/value
    pooled repeated  the mean, repeated to the full length
    words only       the word tokens alone (no BOS, EOS or padding)
    bos only         the [CLS] state alone

and its images are judged (colour, position, shape) on single objects and on pairs; beside it, a
mini SD trained from the start on the pooled state only (`sdkit minisd train --conditioning
pooled`, same data, budget and seed), on the same prompts and seeds.
"""

from __future__ import annotations

import textwrap
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from ..common import SdkitError, format_table
from ..encoders import token_roles
from .evaluate import prompt_set
from .judge import ATTRIBUTES, HEADERS, accuracy, accuracy_cells, judge
from .pipeline import MiniSDPipeline, check_images_fit, pool_states

CONDITIONS = ("tokens", "pooled", "eos", "pooled repeated", "words only", "bos only")
SETS = ("singles", "pairs")


def condition_states(pipe: MiniSDPipeline, captions: list[str]) -> dict[str, list[torch.Tensor]]:
    """Per condition, each caption's states (tokens, width): lengths differ for words only."""
    states = pipe.encoder.encode(captions).float()
    real = pipe.encoder.real_mask(captions)
    pooled = pool_states(states, real)
    out = {name: [] for name in CONDITIONS}
    for i, caption in enumerate(captions):
        roles = token_roles(pipe.encoder.tokenizer, caption, pipe.spec.max_length).roles
        eos = roles.index("eos")
        words = [p for p, r in enumerate(roles) if r == "word"]
        out["tokens"].append(states[i])
        out["pooled"].append(pooled[i])
        out["eos"].append(states[i, eos : eos + 1])
        out["pooled repeated"].append(pooled[i].expand(states.shape[1], -1))
        out["words only"].append(states[i, words])
        out["bos only"].append(states[i, :1])
    return out


def generate_grouped(
    pipe: MiniSDPipeline, states: list[torch.Tensor], seeds: list[int], guidance_scale: float, steps: int, progress=None
) -> np.ndarray:
    """Images for per-caption states of varying lengths: batched by length, never padded (zero
    tokens would take attention weight)."""
    images = [None] * len(states)
    lengths = sorted({s.shape[0] for s in states})
    negative = pipe.encode([""])
    for length in lengths:
        index = [i for i, s in enumerate(states) if s.shape[0] == length]
        out = pipe(
            prompt_embeds=torch.stack([states[i] for i in index]),
            negative_prompt_embeds=negative,
            seeds=[seeds[i] for i in index],
            guidance_scale=guidance_scale,
            num_inference_steps=steps,
            progress=progress,
        )
        for j, i in enumerate(index):
            images[i] = out.images[j]
    return np.stack(images)


@dataclass
class TokenComparison:
    model: str
    pooled_model: str | None
    count: int
    guidance_scale: float
    steps: int
    results: dict[str, dict[str, dict[str, float]]]  # condition -> set -> attribute -> accuracy
    seconds: float = 0.0
    grid: dict = field(default_factory=dict, repr=False)  # condition -> images of the first prompts
    grid_captions: list[str] = field(default_factory=list, repr=False)

    def to_json(self) -> dict:
        out = asdict(self)
        del out["grid"]
        return out


def compare_token_conditions(
    pipe: MiniSDPipeline,
    pooled_pipe: MiniSDPipeline | None = None,
    count: int = 64,
    guidance_scale: float | None = None,
    steps: int = 25,
    grid_prompts: int = 3,
    model_name: str = "model",
    pooled_name: str | None = None,
    progress=None,
) -> TokenComparison:
    if pipe.spec.conditioning != "tokens":
        raise SdkitError(
            f"{model_name}: the conditions are cut from every token's state, and this model was trained "
            f"on the {pipe.spec.conditioning} state; give a model trained on tokens"
        )
    if pooled_pipe is not None and pooled_pipe.spec.conditioning != "pooled":
        raise SdkitError(
            f"{pooled_name}: the pooled-trained model must be trained on the pooled state (sdkit minisd "
            f"train --conditioning pooled); this one was trained on {pooled_pipe.spec.conditioning}"
        )
    check_images_fit(count, pipe.spec.image_size, "judging")
    guidance_scale = pipe.guidance(guidance_scale)
    start = time.perf_counter()
    results: dict[str, dict] = {}
    grid: dict[str, list] = {}
    grid_captions = []
    for set_name in SETS:
        scenes = prompt_set(set_name, count)
        captions = [s.caption for s in scenes]
        seeds = list(range(len(scenes)))
        by_condition = condition_states(pipe, captions)
        runs = {name: (pipe, states) for name, states in by_condition.items()}
        if pooled_pipe is not None:
            runs["pooled-trained model"] = (pooled_pipe, list(pooled_pipe.encode(captions)))
        for name, (model, states) in runs.items():
            images = generate_grouped(model, states, seeds, guidance_scale, steps, progress)
            results.setdefault(name, {})[set_name] = accuracy([judge(im, s) for im, s in zip(images, scenes)])
            grid.setdefault(name, []).extend(images[:grid_prompts])
        grid_captions += captions[:grid_prompts]
    return TokenComparison(
        model_name,
        pooled_name if pooled_pipe is not None else None,
        count,
        guidance_scale,
        steps,
        results,
        time.perf_counter() - start,
        grid,
        grid_captions,
    )


def format_token_comparison(c: TokenComparison) -> str:
    rows = []
    for name, by_set in c.results.items():
        for set_name in SETS:
            acc = by_set[set_name]
            rows.append([name if set_name == SETS[0] else "", set_name, *accuracy_cells(acc)])
    out = [
        format_table(
            ["condition", "prompts", *HEADERS],
            rows,
            title=f"{c.model}: judged accuracy by conditioning ({c.count} prompts per set, guidance "
            f"{c.guidance_scale:g}, {c.steps} steps)",
        )
    ]
    tokens, pooled = c.results["tokens"], c.results["pooled"]

    def pct(result, set_name, attribute):
        return f"{100 * result[set_name][attribute]:.1f} %"

    out.append(
        f"\nOne key/value (the pooled state) fed to the multi-token model: singles position "
        f"{pct(pooled, 'singles', 'position')} (all tokens: {pct(tokens, 'singles', 'position')}),\n"
        f"  pairs all {pct(pooled, 'pairs', 'all')} ({pct(tokens, 'pairs', 'all')})."
    )
    if "pooled-trained model" in c.results:
        trained = c.results["pooled-trained model"]
        out.append(
            f"A model trained on the pooled state only: singles position {pct(trained, 'singles', 'position')}, "
            f"all {pct(trained, 'singles', 'all')}\n  (multi-token model: {pct(tokens, 'singles', 'position')}, "
            f"{pct(tokens, 'singles', 'all')}); pairs all {pct(trained, 'pairs', 'all')} "
            f"({pct(tokens, 'pairs', 'all')})."
        )
    out.append(f"({c.seconds:.0f} s)")
    return "\n".join(out)


def draw_comparison(c: TokenComparison, path) -> None:
    """A PNG: accuracy by condition (bars), and the same prompts and seeds under each condition."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..common import save_figure

    names = list(c.results)
    prompts = len(c.grid_captions)
    fig = plt.figure(figsize=(max(10, 1.5 * len(names)), 4.5 + 1.3 * prompts), dpi=110)
    # Bars on top, a spacer row for their tick labels, then one row of samples per prompt.
    grid = fig.add_gridspec(
        2 + prompts,
        len(names),
        height_ratios=[3, 0.6] + [1] * prompts,
        left=0.2,
        right=0.98,
        top=0.93,
        bottom=0.01,
        hspace=0.25,
        wspace=0.08,
    )
    for column, set_name in enumerate(SETS):
        ax = fig.add_subplot(grid[0, column * len(names) // 2 : (column + 1) * len(names) // 2])
        width = 0.8 / len(ATTRIBUTES)
        for k, attribute in enumerate(ATTRIBUTES):
            values = [100 * c.results[n][set_name][attribute] for n in names]
            bars = ax.bar(np.arange(len(names)) + k * width, values, width, label=attribute)
            if attribute == "all":  # the headline; four labels to a group collide ("9797 9595")
                # on a white box: a label can stand over a taller neighbouring bar
                ax.bar_label(
                    bars,
                    fmt="%.0f",
                    fontsize=7,
                    padding=1,
                    bbox={"boxstyle": "square,pad=0.1", "facecolor": "white", "edgecolor": "none"},
                )
        ax.set_xticks(np.arange(len(names)) + 0.4 - width / 2, names, rotation=30, ha="right", fontsize=7)
        ax.set(ylim=(0, 112), title=f"{set_name}")
        ax.set_ylabel("% correct" if column == 0 else "", fontsize=8)
        # one scale for both panels: the second's tick labels would stand on the first's last bars
        ax.tick_params(labelleft=column == 0)
        ax.legend(fontsize=6, ncol=4, loc="upper right")
    for row in range(prompts):
        for column, name in enumerate(names):
            ax = fig.add_subplot(grid[2 + row, column])
            ax.imshow(c.grid[name][row], interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            if row == 0:
                ax.set_title(name, fontsize=7)
            if column == 0:
                ax.text(
                    -0.08,
                    0.5,
                    textwrap.fill(c.grid_captions[row], 24),
                    transform=ax.transAxes,
                    ha="right",
                    va="center",
                    fontsize=7,
                )
    fig.suptitle(f"{c.model}: one token against many (same prompt and seed along each row)", fontsize=9)
    save_figure(fig, path)
