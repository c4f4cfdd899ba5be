"""Prompts and their states: generated or read prompts, repeats merged, both encoders' token
states encoded once and cached as safetensors shards keyed by both encoders and their settings.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from ..common import SdkitError, atomic_path, write_json
from ..encoders import TextEncoder, TokenRoles, encoder_fingerprint, token_roles

ROLE_CODES = {"bos": 0, "word": 1, "eos": 2, "padding": 3}


_SUBJECTS = [
    "a cat",
    "a dog",
    "an old man",
    "a young woman",
    "two children",
    "a red fox",
    "a horse",
    "a robot",
    "a lighthouse",
    "a castle",
    "a bowl of fruit",
    "a vintage car",
    "a sailboat",
    "an owl",
    "a dragon",
    "a cup of coffee",
    "a mountain village",
    "a city street",
    "a forest path",
    "an astronaut",
    "a bicycle",
    "a wooden cabin",
    "a teapot",
    "a whale",
    "a field of sunflowers",
    "a knight",
    "a bookshop",
    "a train station",
    "a jellyfish",
    "a chess board",
]
_ADJECTIVES = [
    "",
    "small",
    "giant",
    "ancient",
    "colorful",
    "misty",
    "glowing",
    "rusty",
    "snowy",
    "golden",
    "dark",
    "tiny",
    "majestic",
    "abandoned",
    "futuristic",
    "cozy",
]
_PLACES = [
    "",
    "on a beach",
    "in a forest",
    "at sunset",
    "in the rain",
    "under the stars",
    "in a busy market",
    "on a mountain top",
    "in a kitchen",
    "by a river",
    "in the desert",
    "in a snowy field",
    "inside a library",
    "on the moon",
    "in a garden",
    "at night",
]
_STYLES = [
    "",
    "a photo of",
    "an oil painting of",
    "a watercolor of",
    "a pencil sketch of",
    "a 3d render of",
    "a close-up photograph of",
    "an illustration of",
    "a cinematic shot of",
    "a pixel art image of",
]
_EXTRAS = [
    "",
    "highly detailed",
    "soft lighting",
    "wide angle",
    "trending on artstation",
    "black and white",
    "bokeh",
    "4k",
    "in the style of van gogh",
    "dramatic shadows",
    "pastel colors",
]


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
        return EncodedPrompts(
            [self.prompts[i] for i in index], self.new[index], self.old[index], self.roles[index], self.padding_states
        )

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


def encode_prompts(
    new: TextEncoder,
    old: TextEncoder,
    prompts: list[str],
    cache_dir: str | os.PathLike | None = None,
    batch_size: int = 64,
    shard_prompts: int = 1024,
    progress: bool = True,
    cut: bool = False,
) -> tuple[EncodedPrompts, bool]:
    """Encode prompts with both encoders, or read them from the cache; returns (data, from_cache).

    The cache is keyed by both encoders' fingerprints and the prompts: it is reused when they
    match and rebuilt when anything changes. Shards are safetensors files, the index is written
    last, so an interrupted build is never mistaken for a finished one.
    """
    from safetensors.torch import save_file
    from tqdm import tqdm

    if new.max_length != old.max_length:
        raise SdkitError(f"the encoders have different lengths ({new.max_length} vs {old.max_length} tokens)")
    settings = {
        "format": 2,
        "new": encoder_fingerprint(new),
        "old": encoder_fingerprint(old),
        "prompts_sha256": hashlib.sha256("\n".join(prompts).encode()).hexdigest(),
        "count": len(prompts),
    }
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
        parts["new"].append(new.encode(batch, cut=cut).half().cpu())
        parts["old"].append(old.encode(batch, cut=cut).half().cpu())
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
    keys = zip(
        *(
            encoder.tokenizer(list(prompts), truncation=True, max_length=encoder.max_length)["input_ids"]
            for encoder in (new, old)
        )
    )
    seen, kept = set(), []
    for prompt, key in zip(prompts, keys):
        key = tuple(map(tuple, key))
        if key not in seen:
            seen.add(key)
            kept.append(prompt)
    return kept, len(prompts) - len(kept)
