"""Scoring adapters on held-out prompts: per-token and per-prompt metrics with bootstrap intervals,
the U-Net's noise prediction, the whole comparison (`compare_adapters`) and its report.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from ..common import ADAPTERS_FOLDER, SdkitError, atomic_folder, check_output_folder, format_table, write_json
from ..encoders import TextEncoder, encoder_fingerprint
from .model import KINDS, TextEncoderAdapter
from .prompts import ROLE_CODES, EncodedPrompts, distinct_prompts, encode_prompts
from .training import TrainConfig, check_checkpoint, fit_lstsq, preflight_adapter, split_by_prompt, train_adapter

METHODS = ("width_only", "mean", "lstsq", "linear", "mlp", "mixer")
REPORT_FILE = "report.json"  # beside the adapters in --out


def _cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.cosine_similarity(a, b, dim=-1, eps=1e-8)


def _prompt_parts(pred: torch.Tensor, data: EncodedPrompts, train_mean: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each metric's share of each held-out prompt, (prompts,) tensors in float64, so metrics and
    their bootstrap intervals come from the same sums."""
    true = data.old.float()
    real, counted = data.real, data.read
    mask = counted.double()
    error = (pred - true).pow(2).sum(-1).double()
    spread = (true - train_mean).pow(2).sum(-1).double()
    parts = {
        "count": mask.sum(1),
        "cosine": (_cosine(pred, true).double() * mask).sum(1),
        "cosine_centred": (_cosine(pred - train_mean, true - train_mean).double() * mask).sum(1),
        "rel_mse.num": (error * mask).sum(1),
        "rel_mse.den": (spread * mask).sum(1),
    }
    groups = {"bos": [ROLE_CODES["bos"]], "word": [ROLE_CODES["word"]], "eos_padding": [ROLE_CODES["eos"]]}
    if data.padding_states:
        groups["eos_padding"].append(ROLE_CODES["padding"])
    for name, codes in groups.items():
        role = (counted & torch.isin(data.roles, torch.tensor(codes, dtype=data.roles.dtype))).double()
        parts[f"rel_mse_{name}.num"], parts[f"rel_mse_{name}.den"] = (error * role).sum(1), (spread * role).sum(1)
    weights = real.float().unsqueeze(-1)
    pooled_pred = (pred * weights).sum(1) / weights.sum(1)
    pooled_true = (true * weights).sum(1) / weights.sum(1)
    parts["pooled_cosine"] = _cosine(pooled_pred, pooled_true).double()
    similarity = (
        F.normalize(pooled_pred - pooled_true.mean(0), dim=-1)
        @ F.normalize(pooled_true - pooled_true.mean(0), dim=-1).T
    )
    own = similarity.diagonal()
    parts["prompt_own_cosine"] = own.double()
    parts["prompt_other_cosine"] = ((similarity.sum(1) - own) / max(len(own) - 1, 1)).double()
    parts["prompt_top1"] = (similarity.argmax(1) == torch.arange(len(own))).double()
    return parts


def _aggregate(parts: dict[str, torch.Tensor], index: torch.Tensor | None = None) -> dict:
    """Metrics over the prompts in `index` (all of them by default; repeats count twice)."""
    take = (lambda t: t) if index is None else (lambda t: t[index])  # noqa: E731
    out = {}
    for name, value in parts.items():
        if name == "count" or name.endswith(".den"):
            continue
        if name.endswith(".num"):
            metric = name[: -len(".num")]
            den = take(parts[f"{metric}.den"]).sum()
            out[metric] = float(take(value).sum() / den.clamp_min(1e-30)) if den > 0 else None
        elif name in ("cosine", "cosine_centred"):
            out[name] = float(take(value).sum() / take(parts["count"]).sum())
        else:  # per-prompt values: their mean
            out[name] = float(take(value).mean())
    return out


def bootstrap_intervals(
    parts: dict[str, torch.Tensor], samples: int = 1000, seed: int = 0, level: float = 0.95
) -> dict[str, list[float]]:
    """Percentile intervals of each metric over held-out prompts drawn with replacement."""
    n = len(next(iter(parts.values())))
    generator = torch.Generator().manual_seed(seed)
    draws: dict[str, list[float]] = {}
    for _ in range(samples):
        for name, value in _aggregate(parts, torch.randint(0, n, (n,), generator=generator)).items():
            if value is not None:
                draws.setdefault(name, []).append(value)
    tail = (1 - level) / 2
    return {
        name: [float(torch.tensor(v).quantile(tail)), float(torch.tensor(v).quantile(1 - tail))]
        for name, v in draws.items()
    }


def token_metrics(pred: torch.Tensor, data: EncodedPrompts, train_mean: torch.Tensor) -> dict:
    """Per-token and per-prompt agreement of predicted with true old-encoder states."""
    return _aggregate(_prompt_parts(pred, data, train_mean))


@torch.no_grad()
def unet_noise_error(
    unet,
    predicted: torch.Tensor,
    true: torch.Tensor,
    empty: torch.Tensor,
    read: torch.Tensor | None = None,
    timesteps=(100, 500, 900),
    seeds=(0, 1),
    reference_cache: dict | None = None,
) -> dict:
    """Relative error of the U-Net's noise prediction with adapted states against old-encoder states,
    per prompt (a (prompts,) tensor for each ratio).

    Two ratios, averaged over prompts, timesteps and seeds: ||e_adapted - e_old|| / ||e_old||, and
    the same error against what the text changes at all, ||e_old - e_empty|| (e_empty: the old
    encoder's empty prompt), which is the part of the prediction the text is responsible for.
    `read` (prompts, tokens), true where the U-Net reads a state: elsewhere the adapted states are
    zeroed, as adapted_embeddings gives them to a U-Net (a masked encoder leaves zeros past the
    prompt, and a U-Net trained on it attends to those zeros as to nothing).

    The U-Net is fed Gaussian latents at every timestep, so that the error needs no images (nor a
    VAE); a latent of pure noise is what sampling gives the U-Net at its first steps, so the ratio
    at t = 900 is the one nearest to use, and those at t = 100 and 500 read the text's effect off
    the distribution the U-Net was trained on.
    """
    if read is not None:
        predicted = predicted * read.unsqueeze(-1).to(predicted.dtype)
    param = next(unet.parameters())
    side = unet.config.sample_size
    to_unet = lambda s: s.to(param.device, param.dtype)  # noqa: E731
    vs_eps, vs_text = [], []
    for seed in seeds:
        generator = torch.Generator().manual_seed(seed)
        latent = to_unet(torch.randn(len(true), unet.config.in_channels, side, side, generator=generator))
        for t in timesteps:
            key = (seed, t)
            if reference_cache is not None and key in reference_cache:
                eps_old, eps_empty = reference_cache[key]
            else:
                eps_old = unet(latent, t, encoder_hidden_states=to_unet(true)).sample.float()
                eps_empty = unet(latent, t, encoder_hidden_states=to_unet(empty.expand_as(true))).sample.float()
                if reference_cache is not None:
                    reference_cache[key] = (eps_old, eps_empty)
            eps = unet(latent, t, encoder_hidden_states=to_unet(predicted)).sample.float()
            err = (eps - eps_old).flatten(1).norm(dim=1)
            vs_eps.append(err / eps_old.flatten(1).norm(dim=1))
            vs_text.append(err / (eps_old - eps_empty).flatten(1).norm(dim=1).clamp_min(1e-12))
    # Per prompt: the mean over seeds and timesteps (each entry of the lists is one of those runs).
    return {
        "unet_rel_error": torch.stack(vs_eps).mean(0).double(),
        "unet_rel_to_text_effect": torch.stack(vs_text).mean(0).double(),
    }


@dataclass
class AdapterReport:
    new: str
    old: str
    prompts: dict  # counts per split
    tokens: dict
    from_cache: bool
    methods: dict[str, dict] = field(default_factory=dict)
    histories: dict[str, list] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    unet: str | None = None
    saved: dict[str, str] = field(default_factory=dict)
    best_epochs: dict[str, int] = field(default_factory=dict)  # per trained kind; 0: training never beat the start
    adapters: dict = field(default_factory=dict, repr=False)  # method -> the adapter itself (not in JSON)

    def to_json(self) -> dict:
        out = asdict(replace(self, adapters={}))  # the adapters are modules: not data, and not copied
        del out["adapters"]
        return out

    def best_linear(self) -> str:
        return min(("lstsq", "linear"), key=lambda m: self.methods[m]["rel_mse"] if m in self.methods else math.inf)


def compare_adapters(
    new: TextEncoder,
    old: TextEncoder,
    prompts: list[str],
    kinds=("linear", "mlp"),
    config: TrainConfig | None = None,
    unet=None,
    unet_name: str | None = None,
    cache_dir=None,
    out_dir=None,
    checkpoint_dir=None,
    unet_prompts: int = 8,
    seed: int = 0,
    cut_long_prompts: bool = False,
    progress: bool = True,
) -> AdapterReport:
    """Encode (or read the cache), split by prompt, fit lstsq, train the adapters, evaluate every
    method on the held-out prompts, optionally at a frozen U-Net; save the trained adapters."""
    config = config or TrainConfig(seed=seed)
    if unet is not None and unet.config.cross_attention_dim != old.width:
        raise SdkitError(
            f"the U-Net reads {unet.config.cross_attention_dim}-wide states but the old encoder gives "
            f"{old.width}; choose a U-Net made for the old encoder"
        )
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise SdkitError(f"unknown adapter kind {unknown[0]!r}; choose from {', '.join(KINDS)}")
    if out_dir:
        check_output_folder(out_dir, ADAPTERS_FOLDER, "adapters folder")
    # A prompt longer than the positions read is refused now, not after the split and minutes of
    # encoding; prompts sdkit generated may instead be cut to those positions, and the report says
    # how many were (cut_long_prompts).
    limit = min(new.max_length, old.max_length)
    long = sum(len(ids) > limit for ids in new.tokenizer(list(prompts))["input_ids"])
    if long and not cut_long_prompts:
        for encoder in (new, old):
            encoder.check_length(prompts)
    prompts, merged = distinct_prompts(new, old, prompts)
    train_idx, val_idx, test_idx = split_by_prompt(
        len(prompts), seed, train_only=[i for i, p in enumerate(prompts) if not p.strip()]
    )
    # Everything that decides the training data, so a checkpoint of other data is refused now, not
    # after minutes of encoding.
    data_key = hashlib.sha256(
        json.dumps(
            [encoder_fingerprint(new), encoder_fingerprint(old), prompts, train_idx, val_idx],
            sort_keys=True,
            default=str,
        ).encode()
    ).hexdigest()
    runs = {kind: TrainConfig(**{**asdict(config), "kind": kind}) for kind in kinds}
    checkpoints = {
        kind: Path(checkpoint_dir) / f"{kind}.checkpoint.safetensors" if checkpoint_dir else None for kind in kinds
    }
    for kind, run in runs.items():
        preflight_adapter(run, new.width, old.width)
        if checkpoints[kind]:
            check_checkpoint(checkpoints[kind], run, data_key)
    start = time.perf_counter()
    data, from_cache = encode_prompts(new, old, prompts, cache_dir, progress=progress, cut=bool(long))
    encode_seconds = time.perf_counter() - start
    train, val, test = data.subset(train_idx), data.subset(val_idx), data.subset(test_idx)
    x_train, y_train = train.tokens()
    report = AdapterReport(
        new.source,
        old.source,
        {
            "train": len(train_idx),
            "val": len(val_idx),
            "test": len(test_idx),
            "duplicates_merged": merged,
            "cut_to_positions": long,
        },
        {"train": len(x_train), "val": int(val.read.sum()), "test": int(test.read.sum())},
        from_cache,
        unet=unet_name,
    )
    report.timings["encode_seconds"] = encode_seconds
    train_mean = y_train.mean(0)
    torch.manual_seed(seed)
    adapters = {"width_only": TextEncoderAdapter("linear", new.width, old.width).eval()}  # untrained: sizes match
    start = time.perf_counter()
    adapters["lstsq"] = fit_lstsq(x_train, y_train)
    report.timings["lstsq_seconds"] = time.perf_counter() - start
    for kind, run in runs.items():
        start = time.perf_counter()
        data_train, data_val = (
            (train.sequences(), val.sequences()) if kind == "mixer" else ((x_train, y_train), val.tokens())
        )
        adapters[kind], report.histories[kind] = train_adapter(
            data_train, data_val, run, checkpoints[kind], progress, data_key=data_key
        )
        report.timings[f"{kind}_seconds"] = time.perf_counter() - start
        report.timings[f"{kind}_epochs"] = len(report.histories[kind]) - 1
        report.best_epochs[kind] = min(report.histories[kind], key=lambda h: h["val_rel_mse"])[
            "epoch"
        ]  # 0: never improved
    report.adapters = adapters
    references: dict = {}
    test_new = test.new.float()
    if unet is not None:
        empty = old.encode([""]).float()
        count = min(unet_prompts, len(test_idx))
    for method in METHODS:
        if method == "mean":
            pred = train_mean.expand(*test.old.shape[:2], -1)
        elif method in adapters:
            with torch.no_grad():
                pred = adapters[method](test_new, test.read)
        else:
            continue
        parts = _prompt_parts(pred, test, train_mean)
        report.methods[method] = _aggregate(parts)
        report.methods[method]["interval"] = bootstrap_intervals(parts, seed=seed)
        if unet is not None:
            unet_parts = unet_noise_error(
                unet, pred[:count], test.old[:count].float(), empty, test.read[:count], reference_cache=references
            )
            report.methods[method].update(_aggregate(unet_parts))
            report.methods[method]["interval"].update(bootstrap_intervals(unet_parts, seed=seed))
    if out_dir:
        from accelerate import PartialState

        kept = ("lstsq", *kinds)  # lstsq too: it often ties for best
        report.saved = {kind: str(Path(out_dir) / kind) for kind in kept}
    if out_dir and PartialState().is_main_process:  # one writer, however many processes trained
        with atomic_folder(out_dir, ADAPTERS_FOLDER) as tmp:
            for kind in kept:
                adapters[kind].save_pretrained(tmp / kind)
            write_json(tmp / REPORT_FILE, report.to_json())
    return report


COLUMNS = [  # (header, metric, definition)
    ("cos", "cosine", "mean cosine of predicted and true old-encoder states, per token"),
    ("cos c.", "cosine_centred", "the same after subtracting the training-mean token (what varies)"),
    (
        "relMSE [95% CI]",
        "rel_mse",
        "||pred - true||^2 / ||true - train mean||^2 over tokens: 0 perfect, 1 no "
        "better than the mean token; bootstrap interval over held-out prompts",
    ),
    ("bos", "rel_mse_bos", "relMSE on the BOS token"),
    ("words", "rel_mse_word", "relMSE on word tokens"),
    ("eos/pad", "rel_mse_eos_padding", "relMSE on EOS (and padding, where the U-Net reads it)"),
    ("pooled", "pooled_cosine", "cosine of the prompt's mean token, predicted vs true"),
    ("own-other", None, "pooled similarity to its own prompt minus the mean to other prompts"),
    ("top-1", "prompt_top1", "share of prompts whose pooled prediction is nearest their own target"),
]
UNET_COLUMNS = [
    (
        "U-Net err [95% CI]",
        "unet_rel_error",
        "||eps(adapted) - eps(old)|| / ||eps(old)|| at the frozen U-Net, "
        "on Gaussian latents at t = 100, 500, 900 (mean)",
    ),
    (
        "vs text",
        "unet_rel_to_text_effect",
        "the same error over ||eps(old prompt) - eps(old empty prompt)||: "
        "1 means the adapter loses as much as the text changes",
    ),
]


VERDICT_WORDS = {"better": "beats", "worse": "is worse than", "within noise": "ties (intervals overlap) with"}


def compare_methods(r: AdapterReport, a: str, b: str, metric: str = "rel_mse") -> str:
    """'better', 'worse' (for a, lower is better) or 'within noise': better only when the 95%
    bootstrap intervals of the two methods do not overlap."""
    lo_a, hi_a = r.methods[a]["interval"][metric]
    lo_b, hi_b = r.methods[b]["interval"][metric]
    return "better" if hi_a < lo_b else "worse" if lo_a > hi_b else "within noise"


def format_report(r: AdapterReport) -> str:
    import textwrap

    show = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    has_unet = any("unet_rel_error" in m for m in r.methods.values())

    def cell(m: dict, key: str | None) -> str:
        if key is None:
            own, other = m.get("prompt_own_cosine"), m.get("prompt_other_cosine")
            return show(None if own is None or other is None else own - other)
        if key in ("rel_mse", "unet_rel_error") and key in m.get("interval", {}):
            lo, hi = m["interval"][key]
            return f"{show(m.get(key))} [{show(lo)}, {show(hi)}]"
        return show(m.get(key))

    out = [
        f"new encoder: {r.new}",
        f"old encoder: {r.old}",
        f"prompts: {r.prompts['train']} train / {r.prompts['val']} validation / {r.prompts['test']} held-out test "
        f"({r.tokens['train']:,} training tokens; states {'read from the cache' if r.from_cache else 'encoded and cached'})"
        + (
            f"; {r.prompts['duplicates_merged']:,} repeated prompts merged (the same tokens for both encoders)"
            if r.prompts.get("duplicates_merged")
            else ""
        )
        + (
            f"; {r.prompts['cut_to_positions']:,} generated prompts cut to the positions the U-Net reads"
            if r.prompts.get("cut_to_positions")
            else ""
        ),
    ]
    # Two tables, so that lines stay within 120 columns: per token, then per prompt and at the U-Net.
    for title, columns in (
        ("Held-out prompts, per token", COLUMNS[:6]),
        (
            "Held-out prompts, per prompt" + (" and at the U-Net" if has_unet else ""),
            COLUMNS[6:] + (UNET_COLUMNS if has_unet else []),
        ),
    ):
        rows = [[method, *(cell(m, key) for _, key, _ in columns)] for method, m in r.methods.items()]
        out += ["", format_table(["method", *(c for c, _, _ in columns)], rows, title=title)]
    out.append("\nColumns:")
    for header, _, definition in COLUMNS + (UNET_COLUMNS if has_unet else []):
        lines = textwrap.wrap(definition, 98)
        out += [f"  {header:<18} {lines[0]}", *(f"  {'':<18} {line}" for line in lines[1:])]
    if has_unet:
        out.append(f"  U-Net: {r.unet}")
    best = r.best_linear()
    if "mlp" in r.methods and "interval" in r.methods["mlp"]:
        said = VERDICT_WORDS[compare_methods(r, "mlp", best)]
        mlp, lin = r.methods["mlp"]["rel_mse"], r.methods[best]["rel_mse"]
        out.append(
            f"\nmlp {said} the best linear map ({best}) on held-out relMSE: {mlp:.4f} vs {lin:.4f} "
            f"({100 * (lin - mlp) / lin:+.1f} %)"
        )
    if "mixer" in r.methods and "mlp" in r.methods and "interval" in r.methods["mixer"]:
        said = VERDICT_WORDS[compare_methods(r, "mixer", "mlp")]
        out.append(
            f"mixer (reads neighbouring tokens) {said} the per-token mlp: {r.methods['mixer']['rel_mse']:.4f} "
            f"vs {r.methods['mlp']['rel_mse']:.4f}"
        )
    if {"linear", "lstsq"} <= r.methods.keys() and r.methods["linear"]["rel_mse"] > r.methods["lstsq"]["rel_mse"]:
        history = r.histories.get("linear", [])
        stopped = f"{len(history) - 1} epochs" if history else "its epochs"
        verdict = compare_methods(r, "linear", "lstsq").replace("worse", "outside the noise")
        out += textwrap.wrap(
            f"linear trails lstsq ({r.methods['linear']['rel_mse']:.4f} vs "
            f"{r.methods['lstsq']['rel_mse']:.4f}, {verdict}): lstsq is the exact least-squares optimum "
            f"of the same objective, which training approaches in {stopped} (early stopping on "
            "validation)",
            118,
        )
    for kind, history in r.histories.items():
        best_epoch = min(history, key=lambda h: h["val_rel_mse"])
        if best_epoch["epoch"] == 0:  # what was kept is the starting point: say so, not "a tie"
            start = "its linear skip at the lstsq map" if kind in ("mlp", "mixer") else "its initialisation"
            out += textwrap.wrap(
                f"{kind}: {len(history) - 1} epochs never beat the start (epoch 0, {start}: validation relMSE "
                f"{best_epoch['val_rel_mse']:.4f}; after them {history[-1]['val_rel_mse']:.4f}); the {kind} "
                f"kept is that start, so its scores are the start's, not training's",
                118,
            )
        else:
            out.append(
                f"{kind}: {len(history) - 1} epochs, best validation relMSE {best_epoch['val_rel_mse']:.4f} "
                f"(epoch {best_epoch['epoch']} of {len(history) - 1}; epoch 0: {history[0]['val_rel_mse']:.4f}, "
                "before training)"
            )
    for kind, folder in r.saved.items():
        out.append(f"saved {kind} adapter to {folder}")
    return "\n".join(out)
