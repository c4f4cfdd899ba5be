"""Text encoders and tokenizers from local folders (transformers), per-token states, token roles.

SD 1.x reads CLIP ViT-L/14's last hidden state; SD 2.x reads OpenCLIP ViT-H/14's penultimate
layer passed through the final layer norm. `layer` names that choice: "last" or "penultimate" (for
a BERT-style encoder, whose layers each end in a norm, the penultimate layer's states as they are).
diffusers' SD 2.x folders store the tower already cut to 23 of 24 layers: "last" is right there.
"""

from __future__ import annotations

import hashlib
import json
import os
import string
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from .common import SdkitError

LAYERS = ("last", "penultimate")
# Encoders whose every layer ends in a layer norm, so any layer's states are read as they are.
POST_NORM_ENCODERS = ("bert", "mpnet", "roberta", "xlm-roberta", "distilbert", "electra")


@dataclass
class TextEncoder:
    """A tokenizer and its text model, with the layer a U-Net reads from it.

    Prompts are tokenized to `max_length` positions (SD's 77), capped by the model's positions.
    """

    tokenizer: object
    model: torch.nn.Module
    layer: str = "last"
    source: str = ""
    context_length: int = 77

    @property
    def width(self) -> int:
        return self.model.config.hidden_size

    @property
    def max_length(self) -> int:
        return min(self.context_length, self.tokenizer.model_max_length, self.model.config.max_position_embeddings)

    @property
    def pads_with_states(self) -> bool:
        """CLIP computes states at padding positions and SD reads them; masked encoders (BERT-style)
        do not, and their padding positions are filled with zeros, unless the encoder's config says
        `use_attention_mask` (diffusers' convention, as the latent mini SD's does): then it is encoded
        as diffusers' StableDiffusionPipeline.encode_prompt does, padded to max_length with the mask
        given, and every position's state is read."""
        return not _uses_attention_mask(self.model) or _pipeline_masks(self.model)

    def tokenize(self, prompts: list[str], padding: str = "max_length") -> dict:
        return self.tokenizer(
            list(prompts), padding=padding, max_length=self.max_length, truncation=True, return_tensors="pt"
        )

    def check_length(self, prompts: list[str]) -> None:
        """Refuse a prompt longer than the positions read: cut silently, it would not say what it says."""
        lengths = [len(ids) for ids in self.tokenizer(list(prompts))["input_ids"]]
        for i, length in enumerate(lengths):
            if length > self.max_length:
                raise SdkitError(
                    f"prompt {i + 1} ({prompts[i][:40]!r}...) is {length:,} tokens long; this model reads "
                    f"{self.max_length} (its special tokens included): shorten it"
                )

    def real_mask(self, prompts: list[str]) -> torch.Tensor:
        """(batch, max_length) bool: the positions that hold a token (BOS, words, EOS), not padding."""
        return self.tokenize(prompts)["attention_mask"].bool()

    @torch.no_grad()
    def encode(self, prompts: list[str], cut: bool = False) -> torch.Tensor:
        """Per-token states (batch, max_length, width) from the configured layer. A prompt longer
        than max_length is refused (see check_length), never cut silently: with `cut=True` it is
        cut to max_length tokens (its special tokens kept), for a caller that says so."""
        if not cut:
            self.check_length(list(prompts))
        device = self.model.device
        if self.pads_with_states:
            tokens = self.tokenize(prompts)
            mask = tokens["attention_mask"].to(device) if _pipeline_masks(self.model) else None
            out = self.model(
                tokens["input_ids"].to(device), attention_mask=mask, output_hidden_states=self.layer != "last"
            )
        else:  # padding is masked out: encode to the longest prompt, then zero-fill
            tokens = self.tokenize(prompts, padding="longest")
            out = self.model(
                tokens["input_ids"].to(device),
                attention_mask=tokens["attention_mask"].to(device),
                output_hidden_states=self.layer != "last",
            )
        if self.layer == "last":
            states = out.last_hidden_state
        else:
            states = out.hidden_states[-2]
            # CLIP (pre-norm) normalises only its last layer's output, and SD 2.x passes the penultimate
            # layer through that final norm; a BERT-style encoder (post-norm) ends every layer with one.
            final_norm = getattr(getattr(self.model, "text_model", self.model), "final_layer_norm", None)
            if final_norm is not None:
                states = final_norm(states)
            elif self.model.config.model_type not in POST_NORM_ENCODERS:
                raise SdkitError(
                    f"{self.source}: layer 'penultimate' needs a CLIP-style final_layer_norm or a "
                    f"post-norm encoder ({', '.join(POST_NORM_ENCODERS)}), not {self.model.config.model_type}"
                )
        if not self.pads_with_states:
            states = states * tokens["attention_mask"].to(device, states.dtype).unsqueeze(-1)
            states = F.pad(states, (0, 0, 0, self.max_length - states.shape[1]))
        return states


def _uses_attention_mask(model) -> bool:
    # CLIP's text tower attends causally and SD never passed it a mask; BERT-style encoders need one.
    return model.config.model_type not in ("clip_text_model", "clip")


def _pipeline_masks(model) -> bool:
    """Whether diffusers' SD pipelines pass this encoder an attention mask (they do where its config
    says use_attention_mask, and keep every position's state)."""
    return bool(getattr(model.config, "use_attention_mask", False))


def load_text_encoder(
    folder: str | os.PathLike,
    tokenizer_folder: str | os.PathLike | None = None,
    layer: str = "last",
    device: str = "cpu",
    context_length: int = 77,
    allow_pickle: bool = False,
) -> TextEncoder:
    """A text encoder from a local folder: an SD pipeline folder (text_encoder/ + tokenizer/) or a
    model folder holding both. Weights are read from safetensors; pickle weights (pytorch_model.bin)
    only with allow_pickle, and then with torch.load(weights_only=True)."""
    from transformers import AutoConfig, AutoModel, AutoTokenizer, CLIPTextModel

    if layer not in LAYERS:
        raise SdkitError(f"unknown layer {layer!r}; choose one of {', '.join(LAYERS)}")
    from .checkpoints import resolve_local

    folder = Path(resolve_local(folder))
    if not folder.is_dir():
        raise SdkitError(f"{folder}: no such folder (a text encoder is a local transformers folder)")
    model_dir = folder / "text_encoder" if (folder / "text_encoder" / "config.json").is_file() else folder
    tokenizer_dir = (
        Path(tokenizer_folder)
        if tokenizer_folder
        else (folder / "tokenizer" if (folder / "tokenizer").is_dir() else model_dir)
    )
    if not (model_dir / "config.json").is_file():
        raise SdkitError(f"{folder}: no config.json here or in text_encoder/")
    if not any(model_dir.glob("*.safetensors")):
        if not allow_pickle:
            raise SdkitError(
                f"{model_dir}: no safetensors weights here; pickle weights can run code when loaded: "
                "convert them to .safetensors, or pass --allow-pickle (read with weights_only=True)"
            )
        if not any(model_dir.glob("*.bin")):
            raise SdkitError(f"{model_dir}: no text-encoder weights here (no .safetensors or .bin files)")
    try:
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        cls = CLIPTextModel if config.model_type in ("clip_text_model", "clip") else AutoModel
        model, info = cls.from_pretrained(
            model_dir, local_files_only=True, output_loading_info=True, use_safetensors=None if allow_pickle else True
        )
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    except Exception as e:  # transformers raises many types (a pickle weights_only refuses among them): all mean that
        raise SdkitError(f"{folder}: cannot load the text encoder ({str(e).strip().splitlines()[0]})") from None
    # transformers fills missing weights with a fresh random draw and drops unexpected ones, with no
    # more than a log line: states from such an encoder differ at each load. Held as the U-Net's
    # loading holds its keys. The pooler is never read for token states, so its absence is no loss.
    missing = sorted(k for k in info["missing_keys"] if not k.startswith("pooler."))
    unexpected = sorted(info["unexpected_keys"])
    if missing or unexpected:
        parts = [
            f"{len(keys)} {what} (first: {keys[0]})"
            for what, keys in (("missing", missing), ("unexpected", unexpected))
            if keys
        ]
        raise SdkitError(
            f"{model_dir}: the weights do not match the model its config names ({config.model_type}): "
            f"{' and '.join(parts)}; a wrong or damaged text encoder"
        )
    model = model.to(device).eval()
    return TextEncoder(tokenizer, model, layer, str(folder), context_length)


def for_stock_pipeline(encoder: TextEncoder, max_length: int) -> TextEncoder:
    """The encoder as a stock SD pipeline folder carries it, so that diffusers' encode_prompt gives
    the states sdkit trains on: the tokenizer pads to `max_length` (its model_max_length, which the
    pipeline reads), and a BERT-style model's config says use_attention_mask (the pipeline then
    passes the mask). The caller's encoder is left as it was."""
    import copy

    tokenizer = copy.deepcopy(encoder.tokenizer)
    tokenizer.model_max_length = max_length
    model = encoder.model
    if _uses_attention_mask(model) and not _pipeline_masks(model):
        model = copy.deepcopy(model)
        model.config.use_attention_mask = True
    return replace(encoder, tokenizer=tokenizer, model=model, context_length=max_length)


def encoder_fingerprint(encoder: TextEncoder) -> dict:
    """What decides an encoder's states: its config, tokenizer, weights and settings.

    The weights files by their bytes (file_sha256), not by where they are or when they were
    written: the same encoder fetched again, or moved, keeps its cached states and lets a stopped
    run resume.
    """
    model_dir, tokenizer_dir = Path(encoder.model.name_or_path), Path(encoder.tokenizer.name_or_path)
    files = sorted(p for p in model_dir.iterdir() if p.is_file() and p.suffix in (".safetensors", ".bin"))
    digest = hashlib.sha256()
    for p in sorted(tokenizer_dir.iterdir()):
        if p.name in ("vocab.json", "merges.txt", "vocab.txt", "tokenizer.json", "tokenizer_config.json"):
            digest.update(p.read_bytes())
    config = encoder.model.config.to_diff_dict()
    config.pop("_name_or_path", None)
    return {
        "config": config,
        "weights": [[p.name, file_sha256(p)] for p in files],
        "tokenizer_sha256": digest.hexdigest(),
        "layer": encoder.layer,
        "max_length": encoder.max_length,
    }


_FILE_HASHES: dict[tuple, str] = {}


def file_sha256(path: Path) -> str:
    """A file's SHA-256, read once per process for each (path, size, modification time): about a
    second for half a GB on 2 CPU cores, against the minutes of encoding or training a fingerprint guards."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _FILE_HASHES:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
        _FILE_HASHES[key] = digest.hexdigest()
    return _FILE_HASHES[key]


# --- token roles --------------------------------------------------------------------------------

ROLES = ("bos", "word", "eos", "padding")


@dataclass
class TokenRoles:
    """What each position of a tokenized prompt holds."""

    tokens: list[str]  # token text per position
    roles: list[str]  # bos / word / eos / padding per position
    words: list[tuple[str, list[int]]]  # each word with the positions of its pieces


def token_roles(tokenizer, prompt: str, max_length: int) -> TokenRoles:
    """Label positions BOS / word / EOS / padding and merge sub-word pieces into words.

    CLIP pads with the EOS id, so EOS and padding are told apart by position: the first special
    token after the words is EOS, every later position is padding.
    """
    enc = tokenizer(prompt, padding="max_length", max_length=max_length, truncation=True)
    ids = enc["input_ids"]
    tokens = tokenizer.convert_ids_to_tokens(ids)
    word_ids = enc.word_ids()
    roles: list[str] = []
    for position, word in enumerate(word_ids):
        if word is not None:
            roles.append("word")
        elif position == 0:
            roles.append("bos")  # CLIP's <|startoftext|>, BERT's [CLS]
        elif "eos" not in roles:
            roles.append("eos")
        else:
            roles.append("padding")
    words: dict[int, list[int]] = {}
    for position, word in enumerate(word_ids):
        if word is not None:
            words.setdefault(word, []).append(position)
    merged = [
        (tokenizer.decode([ids[p] for p in positions]).strip(), positions) for _, positions in sorted(words.items())
    ]
    return TokenRoles(tokens, roles, merged)


# --- tiny CLIP-shaped encoders, built locally for tests and demos ---------------------------------

_TINY_WORDS = (
    "a an the of on in with and at by from under over near photo painting drawing picture portrait "
    "cat dog bird horse man woman child house tree city street river mountain sky sea car chair table "
    "red blue green yellow black white small large old young bright dark sitting standing running"
).split()


def write_tiny_clip_tokenizer(folder: str | os.PathLike) -> Path:
    """A CLIP BPE tokenizer with a tiny vocabulary: letters, digits and merges for ~60 caption words.

    Other words fall apart into sub-word pieces, as rare words do in the real CLIP tokenizer.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    alphabet = string.ascii_lowercase + string.digits + ",.!?'-"
    vocab: dict[str, int] = {}
    for token in [*alphabet, *(c + "</w>" for c in alphabet)]:
        vocab[token] = len(vocab)
    merges = []
    for word in _TINY_WORDS:
        pieces = [*word[:-1], word[-1] + "</w>"]
        current = pieces[0]
        for piece in pieces[1:]:
            if (current, piece) not in merges:
                merges.append((current, piece))
            current += piece
            vocab.setdefault(current, len(vocab))
    for special in ("<|startoftext|>", "<|endoftext|>"):
        vocab[special] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(f"{a} {b}" for a, b in merges) + "\n")
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "CLIPTokenizer",
                "model_max_length": 77,
                "bos_token": "<|startoftext|>",
                "eos_token": "<|endoftext|>",
                "pad_token": "<|endoftext|>",
                "unk_token": "<|endoftext|>",
            }
        )
    )
    return folder


def write_tiny_clip_encoder(folder: str | os.PathLike, width: int, seed: int = 0, layers: int = 2) -> Path:
    """A randomly initialised CLIP text model of the given width plus the tiny tokenizer, as an SD
    pipeline-style folder (text_encoder/ + tokenizer/), written with save_pretrained."""
    from transformers import CLIPTextConfig, CLIPTextModel

    folder = Path(folder)
    tokenizer = write_tiny_clip_tokenizer(folder / "tokenizer")
    vocab = json.loads((tokenizer / "vocab.json").read_text())
    config = CLIPTextConfig(
        vocab_size=len(vocab),
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=layers,
        num_attention_heads=max(1, width // 64),
        max_position_embeddings=77,
        projection_dim=width,
        bos_token_id=vocab["<|startoftext|>"],
        eos_token_id=vocab["<|endoftext|>"],
        pad_token_id=vocab["<|endoftext|>"],
        hidden_act="quick_gelu",
    )
    torch.manual_seed(seed)
    CLIPTextModel(config).save_pretrained(folder / "text_encoder")
    return folder


def write_tiny_bert_encoder(folder: str | os.PathLike, width: int, seed: int = 0, layers: int = 2) -> Path:
    """A randomly initialised BERT-style (masked) encoder of the given width with a WordPiece
    vocabulary of letters and ~80 caption words, as one model folder: the shape of
    all-MiniLM-L6-v2, small enough for tests. Words outside it fall apart into ## pieces."""
    from transformers import BertConfig, BertModel, BertTokenizer

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    words = sorted(
        set(_TINY_WORDS)
        | set("circle square triangle cyan magenta top bottom left right center middle to there is has colored".split())
    )
    letters = list(string.ascii_lowercase + string.digits + ",.!?'-")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *letters, *(f"##{c}" for c in letters), *words]
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizer(str(folder / "vocab.txt"), model_max_length=512).save_pretrained(folder)
    config = BertConfig(
        vocab_size=len(vocab),
        hidden_size=width,
        num_hidden_layers=layers,
        num_attention_heads=max(1, width // 32),
        intermediate_size=2 * width,
        max_position_embeddings=128,
    )
    torch.manual_seed(seed)
    BertModel(config).save_pretrained(folder)
    return folder
