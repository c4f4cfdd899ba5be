"""Fitting and training adapters: the split by prompt, the closed-form least-squares map, and
gradient training with early stopping and a checkpoint after every epoch (a killed run resumes; a
checkpoint of other data or settings is refused).
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..common import SdkitError, atomic_path
from .model import TextEncoderAdapter


def split_by_prompt(
    n: int, seed: int = 0, val: float = 0.1, test: float = 0.1, train_only=()
) -> tuple[list[int], list[int], list[int]]:
    """Train / validation / held-out test indices, by prompt (no prompt's tokens in two splits).

    `train_only` indices always train (the empty prompt: the unconditional embedding is needed,
    not tested)."""
    order = [i for i in range(n) if i not in set(train_only)]
    random.Random(seed).shuffle(order)
    n_test, n_val = max(1, round(n * test)), max(1, round(n * val))
    if n - n_test - n_val < 1 or len(order) < n_test + n_val:
        raise SdkitError(f"{n} distinct prompts are too few to split into train, validation and test")
    return (
        sorted(order[n_test + n_val :] + list(train_only)),
        sorted(order[n_test : n_test + n_val]),
        sorted(order[:n_test]),
    )


# --- fitting and training -----------------------------------------------------------------------


def relative_mse(pred: torch.Tensor, true: torch.Tensor, mean: torch.Tensor) -> float:
    """||pred - true||^2 / ||true - mean||^2: 0 is perfect, 1 is no better than the mean token."""
    return float((pred - true).pow(2).sum() / (true - mean).pow(2).sum().clamp_min(1e-30))


def fit_lstsq(new: torch.Tensor, old: torch.Tensor) -> TextEncoderAdapter:
    """The least-squares linear map (with bias) on these token pairs: the best any single linear
    layer can do on them. Solved in float64."""
    x = torch.cat([new.double(), torch.ones(len(new), 1, dtype=torch.float64)], 1)
    solution = torch.linalg.lstsq(x, old.double(), driver="gelsd").solution  # (in + 1, out)
    adapter = TextEncoderAdapter("linear", new.shape[1], old.shape[1])
    with torch.no_grad():
        adapter.linear.weight.copy_(solution[:-1].T.float())
        adapter.linear.bias.copy_(solution[-1].float())
    return adapter.eval()


@dataclass
class TrainConfig:
    kind: str = "mlp"
    hidden_dim: int | None = None
    standardize: bool = True
    init_from_lstsq: bool = True  # mlp only: start the linear skip at the least-squares map
    lr: float = 2e-3  # peak; cosine decay to zero over max_epochs
    weight_decay: float = 0.0
    batch_size: int = 256  # tokens
    max_epochs: int = 24
    patience: int = 8
    cosine_weight: float = 0.0  # adds cosine_weight * (1 - cos(pred, true)) per token
    seed: int = 0


MAX_LR = 1.0  # past it, AdamW's first step alone moves every weight by more than its scale


def preflight_adapter(config: TrainConfig, in_dim: int, out_dim: int) -> None:
    """Refuse, before any work, an adapter whose training would not fit in memory: each parameter
    holds itself, its gradient, AdamW's two moments and the best weights (five float32 copies)."""
    from accelerate import init_empty_weights

    from ..common import available_memory, format_bytes

    if not 0 < config.lr <= MAX_LR:
        raise SdkitError(
            f"the learning rate must lie in (0, {MAX_LR:g}], not {config.lr:g} (AdamW moves each weight "
            "by about lr a step)"
        )
    if not 0 < config.batch_size < 2**31:  # a batch larger than the data is all of it; past this, no loader takes it
        raise SdkitError(f"the batch size must be 1 to 2^31 - 1 tokens, not {config.batch_size:,}")
    with init_empty_weights(include_buffers=True):
        shape = TextEncoderAdapter(config.kind, in_dim, out_dim, config.hidden_dim, config.standardize)
    need = 4 * (5 * sum(p.numel() for p in shape.parameters()) + sum(b.numel() for b in shape.buffers()))
    if need > available_memory():
        raise SdkitError(
            f"a {config.kind} adapter {in_dim} -> {out_dim} with hidden width {config.hidden_dim} needs "
            f"about {format_bytes(need)} to train; {format_bytes(available_memory())} is free"
        )


class Interrupted(Exception):
    """Raised by the stop_after hook of train_adapter, to simulate a run killed after a checkpoint."""


def train_adapter(
    train: tuple,
    val: tuple,
    config: TrainConfig,
    checkpoint: str | os.PathLike | None = None,
    progress: bool = True,
    stop_after: int | None = None,
    data_key: str = "",
) -> tuple[TextEncoderAdapter, list[dict]]:
    """Train an adapter with accelerate; returns (best adapter, history).

    train and val are (new, old) token pairs, (tokens, width) each; for the mixer, which reads
    whole sequences, (new, old, mask): (prompts, tokens, width) states and the (prompts, tokens)
    mask of the positions the U-Net reads. Per-token MSE on standardised targets (plus an optional
    cosine term), AdamW, early stopping on the validation relative MSE. After every epoch a
    checkpoint (model, optimizer, best weights, history) is written atomically; a run that finds
    its checkpoint resumes from it, with the same data order (accelerate's seedable sampler,
    seeded per epoch), so it ends where an uninterrupted run would. `data_key` names the data (its
    prompts and encoders) in the checkpoint, so that `check_checkpoint` can refuse a checkpoint of
    other data before the data is encoded.
    """
    from accelerate import Accelerator, DataLoaderConfiguration
    from torch.utils.data import DataLoader, TensorDataset
    from tqdm import tqdm

    sequences = len(train) == 3
    if sequences != (config.kind == "mixer"):
        raise SdkitError(
            f"a {config.kind} adapter trains on {'token sequences' if config.kind == 'mixer' else 'tokens'}"
        )
    accelerator = Accelerator(
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=config.seed)
    )
    x, y = train[:2]
    mask = train[2].bool() if sequences else torch.ones(x.shape[:-1], dtype=torch.bool)
    flat_x, flat_y = x[mask], y[mask]
    torch.manual_seed(config.seed)
    model = TextEncoderAdapter(config.kind, x.shape[-1], y.shape[-1], config.hidden_dim, config.standardize)
    if config.standardize:
        model.set_standardization(flat_x, flat_y)
    with torch.no_grad():
        target = (y - model.target_mean) / model.target_std if config.standardize else y
        if config.kind in ("mlp", "mixer") and config.init_from_lstsq:
            # Start the skip at the least-squares map, solved in the space the network sees.
            inputs = (flat_x - model.input_mean) @ model.input_whitening if config.standardize else flat_x
            model.linear.load_state_dict(fit_lstsq(inputs, target[mask]).linear.state_dict())
    tensors = (x, target, y, mask) if sequences else (x, target, y)
    # batch_size counts tokens; the mixer takes whole prompts, as many as hold about that many tokens
    batch = max(1, config.batch_size // x.shape[1]) if sequences else config.batch_size
    loader = DataLoader(TensorDataset(*tensors), batch_size=batch, shuffle=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    raw = accelerator.unwrap_model(model)

    # Everything that decides the result: the settings and the token pairs themselves (so other
    # encoders, layers, prompts or splits can never resume this checkpoint).
    fingerprint = _run_fingerprint(config, train, val)
    x_val, y_val = (t.to(accelerator.device) for t in val[:2])
    mask_val = val[2].bool().to(accelerator.device) if sequences else None
    train_mean = flat_y.mean(0).to(accelerator.device)

    def validation_error() -> float:
        with torch.no_grad():
            if sequences:
                return relative_mse(raw(x_val, mask_val)[mask_val], y_val[mask_val], train_mean)
            return relative_mse(raw(x_val), y_val, train_mean)

    start_rel = validation_error()  # the starting point counts: an mlp started at lstsq never ends worse
    state = {"epoch": 0, "best": start_rel, "bad_epochs": 0, "history": [{"epoch": 0, "val_rel_mse": start_rel}]}
    best_weights = copy.deepcopy(raw.state_dict())
    if checkpoint and Path(checkpoint).is_file():
        state, best_weights = _load_checkpoint(checkpoint, raw, optimizer, config, fingerprint)
    bar = tqdm(
        total=config.max_epochs,
        initial=state["epoch"],
        desc=f"training {config.kind}",
        unit="epoch",
        disable=not progress or not accelerator.is_main_process,
    )
    # Epochs are numbered as in the history: epoch 0 is the start, before any training.
    bar.set_postfix(
        epoch=state["epoch"], val_rel_mse=f"{state['history'][-1]['val_rel_mse']:.4f}", best=f"{state['best']:.4f}"
    )
    while state["epoch"] < config.max_epochs and state["bad_epochs"] < config.patience:
        model.train()
        loader.set_epoch(state["epoch"])
        total, count, epoch_start = 0.0, 0, time.perf_counter()
        for step, (xb, tb, yb, *mb) in enumerate(loader, start=state["epoch"] * len(loader)):
            for group in optimizer.param_groups:  # cosine decay, a function of the step: resumes exactly
                group["lr"] = config.lr * 0.5 * (1 + math.cos(math.pi * step / (config.max_epochs * len(loader))))
            if sequences:  # through the wrapper, so several GPUs sync gradients; only read positions count
                out, tb, yb = model(xb, mb[0], standardized=True)[mb[0]], tb[mb[0]], yb[mb[0]]
            else:
                out = model(xb, standardized=True)
            loss = F.mse_loss(out, tb)
            if config.cosine_weight:
                pred = out * raw.target_std + raw.target_mean if config.standardize else out
                loss = loss + config.cosine_weight * (1 - F.cosine_similarity(pred, yb, dim=-1)).mean()
            optimizer.zero_grad()
            accelerator.backward(loss)
            optimizer.step()
            total, count = total + loss.item() * len(out), count + len(out)
        model.eval()
        val_rel = validation_error()
        # every process's share of the epoch's loss, not the main process's alone
        total, count = accelerator.reduce(
            torch.tensor([total, float(count)], device=accelerator.device), "sum"
        ).tolist()
        state["epoch"] += 1
        if not (math.isfinite(total) and math.isfinite(val_rel)):
            raise SdkitError(
                f"training the {config.kind} adapter diverged in epoch {state['epoch']} (loss "
                f"{total / max(count, 1):.3g}, validation {val_rel:.3g}): lower --lr"
                f"{' or --cosine-weight' if config.cosine_weight else ''}"
            )
        state["history"].append(
            {
                "epoch": state["epoch"],
                "train_loss": total / max(count, 1),
                "val_rel_mse": val_rel,
                "seconds": time.perf_counter() - epoch_start,
            }
        )
        if val_rel < state["best"] - 1e-7:
            state["best"], state["bad_epochs"] = val_rel, 0
            best_weights = copy.deepcopy(raw.state_dict())
        else:
            state["bad_epochs"] += 1
        if checkpoint and accelerator.is_main_process:
            _save_checkpoint(checkpoint, raw, optimizer, best_weights, state, config, fingerprint, data_key)
        bar.update(1)
        bar.set_postfix(epoch=state["epoch"], val_rel_mse=f"{val_rel:.4f}", best=f"{state['best']:.4f}")
        if stop_after is not None and state["epoch"] >= stop_after:
            bar.close()
            raise Interrupted(f"stopped after epoch {state['epoch']}")
    bar.close()
    raw.load_state_dict(best_weights)
    return raw.eval().cpu(), state["history"]


def _run_fingerprint(config: TrainConfig, train, val) -> str:
    digest = hashlib.sha256(json.dumps(asdict(config), sort_keys=True).encode())
    for tensor in (*train, *val):
        digest.update(str(tuple(tensor.shape)).encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _save_checkpoint(path, model, optimizer, best_weights, state, config, fingerprint: str, data_key: str) -> None:
    from safetensors.torch import save_file

    tensors = {f"model.{k}": v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    tensors.update({f"best.{k}": v.detach().cpu().contiguous() for k, v in best_weights.items()})
    opt = optimizer.state_dict()
    for index, param_state in opt["state"].items():
        for name, value in param_state.items():
            tensors[f"optimizer.{index}.{name}"] = torch.as_tensor(value).detach().cpu().contiguous()
    metadata = {
        "state": json.dumps(state),
        "param_groups": json.dumps(opt["param_groups"]),
        "config": json.dumps(asdict(config)),
        "fingerprint": fingerprint,
        "data_key": data_key,
    }
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)


def _load_checkpoint(path, model, optimizer, config: TrainConfig, fingerprint: str) -> tuple[dict, dict]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata()
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (a safetensors handle)
        saved = json.loads(metadata["config"])
    except Exception as e:  # a checkpoint from elsewhere, or damaged: say which file
        raise SdkitError(f"{path}: cannot resume from this checkpoint ({e}); delete it to start over") from None
    _refuse_other_settings(path, saved, config)
    if metadata.get("fingerprint") != fingerprint:
        raise SdkitError(
            f"{path}: this checkpoint was trained on other data (other encoders, layers, prompts or "
            "split); delete it or choose another checkpoint folder"
        )
    try:
        model.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")})
    except RuntimeError:
        raise SdkitError(f"{path}: this checkpoint is for other encoder widths; delete it to start over") from None
    best = {k[5:]: v for k, v in tensors.items() if k.startswith("best.")}
    opt_state: dict = {}
    for k, v in tensors.items():
        if k.startswith("optimizer."):
            _, index, name = k.split(".", 2)
            opt_state.setdefault(int(index), {})[name] = v
    optimizer.load_state_dict({"state": opt_state, "param_groups": json.loads(metadata["param_groups"])})
    return json.loads(metadata["state"]), best


def _refuse_other_settings(path, saved: dict, config: TrainConfig) -> None:
    if saved != asdict(config):
        changed = sorted(k for k in saved if saved[k] != asdict(config).get(k))
        raise SdkitError(
            f"{path}: this checkpoint was trained with other settings ({', '.join(changed)}); "
            "delete it or choose another checkpoint folder"
        )


def check_checkpoint(path: str | os.PathLike, config: TrainConfig, data_key: str) -> None:
    """Refuse, from its metadata alone and before any data is encoded, a checkpoint written for other
    settings or other data; nothing to check when there is no checkpoint yet."""
    from safetensors import safe_open

    if not Path(path).is_file():
        return
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
        saved = json.loads(metadata["config"])
    except Exception as e:  # a checkpoint from elsewhere, or damaged: say which file
        raise SdkitError(f"{path}: cannot resume from this checkpoint ({e}); delete it to start over") from None
    _refuse_other_settings(path, saved, config)
    if metadata.get("data_key") != data_key:
        raise SdkitError(
            f"{path}: this checkpoint was trained on other data (other encoders, layers, prompts or "
            "split); delete it or choose another checkpoint folder"
        )
