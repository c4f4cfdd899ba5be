"""Trace the cross-attention: capture attn2 through diffusers' attention-processor API, then ask
the trace questions (DAAM's shape: one context manager).

    with CrossAttentionTrace(unet, maps=True) as trace:
        unet(latent, t, encoder_hidden_states=states)
    trace.summary()        # per layer: spatial spread, entropy, effective tokens, mass per token
    trace.token_maps()     # (tokens, H, W): where each token's attention falls

On a diffusers pipeline, in words (DAAM's `word_map("cat")`): the trace reads the prompts from the
text encoder's input and tells classifier-free guidance's halves apart from the pipeline call.

    with CrossAttentionTrace(pipe, maps=True) as trace:
        image = pipe("a red cat on a blue chair").images[0]
    trace.word_map("cat")                  # (H, W) at the image's size: the word's pieces summed
    overlay(image, trace.word_map("cat"))  # the map over the image, as a PIL image

The U-Net's own processors are put back on exit, also after an exception.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from diffusers.models.attention_processor import Attention, AttnProcessor, AttnProcessor2_0

from .common import SdkitError
from .geometry import halved

HALVES = ("conditional", "unconditional", "both")  # what a pipeline trace keeps of a guided batch
_HINTS = {
    "SlicedAttnProcessor": "attention slicing is on; call pipe.disable_attention_slicing() first",
    "XFormersAttnProcessor": "xformers is on; call pipe.disable_xformers_memory_efficient_attention() first",
    "CaptureProcessor": "another CrossAttentionTrace is already active on this U-Net",
}


class CaptureProcessor:
    """Wraps an attn2 layer's own processor: the layer's output is the original processor's, to the
    bit; the attention weights are computed beside it (the fused kernels never materialise them)
    and handed to the trace. With 77 text tokens that extra table is small.
    """

    def __init__(self, trace: CrossAttentionTrace, name: str, original):
        self.trace, self.name, self.original = trace, name, original

    def __call__(
        self,
        attn: Attention,
        hidden_states,
        encoder_hidden_states=None,
        attention_mask=None,
        temb=None,
        *args,
        **kwargs,
    ):
        out = self.original(attn, hidden_states, encoder_hidden_states, attention_mask, temb, *args, **kwargs)
        # With the trace's graph on, the weights keep theirs (steering differentiates a loss on them);
        # otherwise they are computed as a side table, without one.
        with torch.set_grad_enabled(torch.is_grad_enabled() and self.trace.keep_graph):
            if attn.spatial_norm is not None:
                hidden_states = attn.spatial_norm(hidden_states, temb)
            if hidden_states.ndim == 4:
                hidden_states = hidden_states.flatten(2).transpose(1, 2)
            if attn.group_norm is not None:
                hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)
            context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
            if encoder_hidden_states is not None and attn.norm_cross:
                context = attn.norm_encoder_hidden_states(context)
            mask = attn.prepare_attention_mask(attention_mask, context.shape[1], context.shape[0])
            query = attn.head_to_batch_dim(attn.to_q(hidden_states))
            probs = attn.get_attention_scores(query, attn.head_to_batch_dim(attn.to_k(context)), mask)
        with torch.no_grad():
            mixed = torch.bmm(probs, attn.head_to_batch_dim(attn.to_v(context)))
            self.trace._record(self.name, attn.heads, probs, mixed)
        if self.trace.keep_graph:
            self.trace.graph_probs[self.name] = probs
        return out


@dataclass
class _LayerSums:
    """Running sums for one layer, per batch item; memory stays flat however many steps are traced."""

    calls: int = 0
    spread: torch.Tensor | None = None  # (items,) float64
    entropy: torch.Tensor | None = None  # (items,)
    token_mass: torch.Tensor | None = None  # (items, tokens)
    grid: tuple[int, int] | None = None
    heads: int = 0


class CrossAttentionTrace:
    """Context manager: capture every cross-attention (attn2) layer of a U-Net, per prompt.

    Per layer and per batch item (with `cfg=True`, per item of the conditional second half, where
    diffusers' pipelines put it), streamed over calls: the spatial spread of the attention output
    (||O - mean over cells of O|| / ||O||, on the mixed values before to_out), the attention
    entropy per cell (and the effective number of tokens, exp(entropy)), and the attention mass
    per token (mean over cells and heads).

    With `maps=True`, per-token maps at each layer's own grid, per item, summed over calls and kept
    apart by layer (and by timestep with `by_timestep=True`, only the `timesteps` listed when given;
    per head with `keep_heads=True`); `map_sides` keeps only layers whose grid height is listed.
    Ask for them with token_maps(item=..., layers=..., timesteps=..., head=...): the mean over what
    is selected, upsampled to the latent size. save_maps() writes them raw, as safetensors.

    With `keep_graph=True`, the weights of each layer's latest call are kept with their autograd
    graph in `graph_probs` (see sdkit.steering, which differentiates losses on them).

    Self-attention keeps its processors (and fast path); on exit, every processor is the very
    object it was before, also when the body raises.
    """

    def __init__(
        self,
        unet,
        cfg: bool = False,
        maps: bool = False,
        map_sides: tuple[int, ...] | None = None,
        by_timestep: bool = False,
        timesteps=None,
        keep_heads: bool = False,
        keep_graph: bool = False,
        half: str = "conditional",
    ):
        # A pipeline (anything with .unet, .text_encoder and .tokenizer, as diffusers' SD pipelines):
        # its U-Net is traced, each call's guidance is read from the pipeline, and its prompts from
        # the text encoder's input, so maps can be asked for by word.
        self.pipe = unet if hasattr(unet, "unet") and hasattr(unet, "tokenizer") else None
        if half not in HALVES:
            raise SdkitError(f"half must be one of {', '.join(HALVES)}, not {half!r}")
        if self.pipe is not None and cfg:
            raise SdkitError("cfg=True is for a bare U-Net; a pipeline's trace reads its guidance from each call")
        self.half = half
        unet = self.pipe.unet if self.pipe is not None else unet
        self.unet, self.cfg, self.maps, self.map_sides = unet, cfg, maps, map_sides
        self.prompt_ids: list[list[int]] = []  # per traced item: the token ids its text encoder read
        self._encoded: list[list[list[int]]] = []  # text-encoder calls since the last U-Net call
        # keep_graph: each layer's weights of the latest call, with their autograd graph, in
        # graph_probs[layer]: (batch * heads, cells, tokens). What steering reads and differentiates.
        self.keep_graph = keep_graph
        self.graph_probs: dict[str, torch.Tensor] = {}
        self.by_timestep, self.keep_heads = by_timestep or timesteps is not None, keep_heads
        self.timesteps = None if timesteps is None else {int(t) for t in timesteps}
        self.layers: dict[str, _LayerSums] = {}
        self.map_sums: dict[tuple[str, int | None], torch.Tensor] = {}  # (layer, timestep) -> sums
        self.map_calls: dict[tuple[str, int | None], int] = {}
        self._original: dict | None = None
        self._latent_size: tuple[int, int] | None = None
        self._timestep: int | None = None
        self._hooks: list = []

    def __enter__(self) -> CrossAttentionTrace:
        original = self.unet.attn_processors
        cross = [n for n in original if n.endswith("attn2.processor")]
        if not cross:
            raise SdkitError("this U-Net has no cross-attention (attn2) layers to capture")
        for name in cross:
            kind = type(original[name]).__name__
            if not isinstance(original[name], (AttnProcessor, AttnProcessor2_0)):
                hint = _HINTS.get(kind, "capture needs diffusers' default attention processors")
                raise SdkitError(f"{name.removesuffix('.processor')} uses {kind}: {hint}")
        self._original = original
        replaced = dict(original)
        for name in cross:
            layer = name.removesuffix(".processor")
            replaced[name] = CaptureProcessor(self, layer, original[name])
            self.layers.setdefault(layer, _LayerSums())
        self.unet.set_attn_processor(replaced)
        self._hooks = []
        if isinstance(self.unet, torch.nn.Module):
            self._hooks.append(self.unet.register_forward_pre_hook(self._read_call, with_kwargs=True))
        if self.pipe is not None:
            self._hooks.append(self.pipe.text_encoder.register_forward_pre_hook(self._read_prompt, with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for hook in self._hooks:
            hook.remove()
        self.unet.set_attn_processor(dict(self._original))  # set_attn_processor consumes its dict
        self._original = None

    def _read_prompt(self, module, args, kwargs):
        """The text encoder's input ids: a pipeline encodes its prompts first, then (with guidance)
        the negative prompts; the U-Net call that follows is the first step."""
        ids = args[0] if args else kwargs["input_ids"]
        self._encoded.append(ids.tolist())

    def _read_call(self, module, args, kwargs):
        sample = args[0] if args else kwargs["sample"]
        self._latent_size = tuple(sample.shape[-2:])
        if self.pipe is not None:
            # diffusers' SD pipelines stack (unconditional, conditional) when guidance is on
            self.cfg = bool(getattr(self.pipe, "do_classifier_free_guidance", False))
            if self._encoded:
                conditional = self._encoded[0]
                unconditional = self._encoded[1] if self.cfg and len(self._encoded) > 1 else conditional
                both = [*unconditional, *conditional] if self.cfg else conditional
                traced = {"conditional": conditional, "unconditional": unconditional, "both": both}[self.half]
                if self.prompt_ids and self.prompt_ids != traced:
                    raise SdkitError("one trace holds one set of prompts: start a new trace for other prompts")
                self.prompt_ids, self._encoded = traced, []
        timestep = args[1] if len(args) > 1 else kwargs.get("timestep")
        if timestep is not None:
            self._timestep = int(torch.as_tensor(timestep).flatten()[0].item())

    def _grid(self, cells: int) -> tuple[int, int] | None:
        """The layer's grid: the latent halved until it has `cells` cells."""
        h, w = self._latent_size or (0, 0)
        while h * w > cells:
            h, w = halved(h, w, 1)
        return (h, w) if h * w == cells else None

    @torch.no_grad()
    def _record(self, name: str, heads: int, probs: torch.Tensor, mixed: torch.Tensor) -> None:
        batch_heads, cells, tokens = probs.shape
        batch = batch_heads // heads
        probs = probs.detach().view(batch, heads, cells, tokens)
        mixed = mixed.detach().view(batch, heads, cells, -1)
        if self.cfg and self.half != "both":
            if batch % 2:
                raise SdkitError(
                    f"cfg=True needs (unconditional, conditional) pairs, but {name} got a batch of {batch}"
                )
            keep = slice(batch // 2, None) if self.half == "conditional" else slice(None, batch // 2)
            probs, mixed = probs[keep], mixed[keep]
        probs, mixed = probs.float(), mixed.float()
        items = probs.shape[0]
        s = self.layers[name]
        if s.token_mass is not None and s.token_mass.shape != (items, tokens):
            raise SdkitError(
                f"{name}: the batch or the number of text tokens changed within one trace "
                f"({tuple(s.token_mass.shape)} -> {(items, tokens)} items x tokens)"
            )
        out = mixed.transpose(1, 2).flatten(2)  # (items, cells, heads * head_dim), as to_out sees it
        spread = (out - out.mean(dim=1, keepdim=True)).norm(dim=(1, 2)) / out.norm(dim=(1, 2)).clamp_min(1e-30)
        entropy = torch.special.entr(probs).sum(-1).mean(dim=(1, 2))
        mass = probs.mean(dim=(1, 2))
        for field_name, value in (("spread", spread), ("entropy", entropy), ("token_mass", mass)):
            value = value.double().cpu()
            setattr(s, field_name, value if getattr(s, field_name) is None else getattr(s, field_name) + value)
        s.calls += 1
        s.heads = heads
        s.grid = s.grid or self._grid(cells)
        wanted = self.timesteps is None or self._timestep in self.timesteps
        if self.maps and s.grid and wanted and (self.map_sides is None or s.grid[0] in self.map_sides):
            per_token = probs.transpose(2, 3).reshape(items, heads, tokens, *s.grid)  # (items, heads, tokens, h, w)
            if not self.keep_heads:
                per_token = per_token.mean(1)
            key = (name, self._timestep if self.by_timestep else None)
            total = per_token.cpu()
            self.map_sums[key] = total if key not in self.map_sums else self.map_sums[key] + total
            self.map_calls[key] = self.map_calls.get(key, 0) + 1

    def summary(self, item: int | None = None) -> dict[str, dict]:
        """Per layer: spatial_spread, entropy (nats), effective_tokens, token_mass (list), grid, items
        (calls x batch items averaged over); of one batch item with `item`, else the mean over items."""
        out = {}
        for name, s in self.layers.items():
            if not s.calls:
                raise SdkitError(f"{name}: no cross-attention call was captured (were the processors replaced?)")
            pick = (lambda t: t.mean(0)) if item is None else (lambda t: t[item])  # noqa: E731
            entropy = float(pick(s.entropy)) / s.calls
            out[name] = {
                "spatial_spread": float(pick(s.spread)) / s.calls,
                "entropy": entropy,
                "effective_tokens": math.exp(entropy),
                "token_mass": (pick(s.token_mass) / s.calls).tolist(),
                "grid": list(s.grid) if s.grid else None,
                "items": s.calls * (len(s.spread) if item is None else 1),
            }
        return out

    @property
    def items(self) -> int:
        """Batch items traced per call (the conditional half with cfg=True)."""
        first = next((s for s in self.layers.values() if s.spread is not None), None)
        return 0 if first is None else len(first.spread)

    def map_keys(self) -> list[tuple[str, int | None]]:
        """The (layer, timestep) pairs maps were kept for (timestep None: all steps together)."""
        return list(self.map_sums)

    def token_maps(
        self,
        item: int | None = None,
        layers=None,
        timesteps=None,
        head: int | None = None,
        size: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """(tokens, H, W): attention per token, the mean over the selected layers (names, or grid
        sides as ints), timesteps and heads, upsampled to `size` (default: the latent size); of one
        batch item, or the mean over items."""
        keys = [k for k in self.map_sums if _selected(k, layers, timesteps, self.layers)]
        if not keys:
            if not self.map_sums:
                raise SdkitError("no maps were captured: trace with maps=True and run the U-Net inside the trace")
            grids = sorted({self.layers[layer].grid[0] for layer, _ in self.map_sums if self.layers[layer].grid})
            steps = sorted({t for _, t in self.map_sums if t is not None})
            raise SdkitError(
                f"no maps match layers={layers} timesteps={timesteps}; captured: layers "
                f"{', '.join(sorted({layer for layer, _ in self.map_sums}))} (grid sides "
                f"{', '.join(map(str, grids))}), timesteps "
                f"{', '.join(map(str, steps)) if steps else 'all together (by_timestep=False)'}"
            )
        size = size or self._latent_size
        total = None
        for key in keys:
            mean = self.map_sums[key] / self.map_calls[key]
            heads = mean.shape[1] if self.keep_heads else 0
            if head is not None and self.keep_heads and not (isinstance(head, int) and -heads <= head < heads):
                raise SdkitError(f"head {head!r} is not a head of layer {key[0]} (it has {heads})")
            if self.keep_heads:
                mean = mean.mean(1) if head is None else mean[:, head]
            elif head is not None:
                raise SdkitError("maps per head need keep_heads=True")
            if item is not None and not (isinstance(item, int) and -len(mean) <= item < len(mean)):
                raise SdkitError(f"item {item!r} is not a batch item of this trace (it holds {len(mean)})")
            mean = mean.mean(0) if item is None else mean[item]
            up = F.interpolate(mean[None], size=size, mode="bilinear", align_corners=False)[0]
            total = up if total is None else total + up
        return total / len(keys)

    def words(self, item: int = 0) -> list[tuple[str, list[int]]]:
        """The words of a traced prompt, each with the token positions of its pieces (pipeline
        traces only: the prompts are read from the text encoder's input)."""
        from .encoders import token_roles

        if self.pipe is None:
            raise SdkitError(
                "words need the pipeline: trace CrossAttentionTrace(pipe, ...), or ask token_maps by position"
            )
        if not self.prompt_ids:
            raise SdkitError("no prompt was traced: call the pipeline inside the trace")
        if not (isinstance(item, int) and -len(self.prompt_ids) <= item < len(self.prompt_ids)):
            raise SdkitError(f"item {item!r} is not a traced prompt (the trace holds {len(self.prompt_ids)})")
        tokenizer, ids = self.pipe.tokenizer, self.prompt_ids[item]
        text = tokenizer.decode(ids, skip_special_tokens=True)
        roles = token_roles(tokenizer, text, len(ids))
        if tokenizer(text, padding="max_length", max_length=len(ids), truncation=True)["input_ids"] != ids:
            raise SdkitError(
                f"prompt {item} does not tokenize back to the ids its text encoder read; ask token_maps by position"
            )
        return roles.words

    def word_map(
        self, word: str, item: int = 0, layers=None, timesteps=None, head: int | None = None, size="image"
    ) -> torch.Tensor:
        """(H, W): the attention of `word` in prompt `item`, its sub-word pieces' maps summed; at the
        image's size by default ("latent" for the latent grid, or (H, W)). Every occurrence of the
        word counts; a word the prompt lacks is an error that lists the prompt's words."""
        words = self.words(item)
        wanted = " ".join(word.lower().split())
        positions = [p for w, ps in words if w.lower() == wanted for p in ps]
        if not positions:
            raise SdkitError(f"{word!r} is not a word of prompt {item}; its words: {', '.join(w for w, _ in words)}")
        if size == "image":
            factor = getattr(self.pipe, "vae_scale_factor", 1)
            size = tuple(side * factor for side in self._latent_size)
        elif size == "latent":
            size = None
        maps = self.token_maps(item=item, layers=layers, timesteps=timesteps, head=head, size=size)
        return maps[positions].sum(0)

    def save_maps(self, path) -> None:
        """The raw maps, one tensor per (layer, timestep): (items, [heads,] tokens, h, w), the mean over
        calls, as safetensors (atomically)."""
        from safetensors.torch import save_file

        from .common import atomic_path

        tensors = {
            f"{layer}@{'all' if t is None else t}": (
                self.map_sums[(layer, t)] / self.map_calls[(layer, t)]
            ).contiguous()
            for layer, t in self.map_sums
        }
        with atomic_path(path) as tmp:
            save_file(
                tensors,
                str(tmp),
                metadata={"latent_size": json.dumps(self._latent_size), "keep_heads": str(self.keep_heads)},
            )


def overlay(image, heat_map: torch.Tensor, alpha: float = 0.5, cmap: str = "inferno"):
    """`heat_map` (H, W) over `image` (a PIL image, or an (H, W, 3) array in [0, 1]), as a PIL image:
    the map scaled to [0, 1], coloured, resized to the image and blended in at `alpha`."""
    import numpy as np
    from matplotlib import colormaps
    from PIL import Image

    if not 0 <= alpha <= 1:
        raise SdkitError(f"alpha must lie in [0, 1], not {alpha}")
    if not isinstance(image, Image.Image):
        image = Image.fromarray((np.clip(np.asarray(image, dtype=np.float32), 0, 1) * 255).round().astype(np.uint8))
    heat = heat_map.detach().float().cpu()
    if heat.ndim != 2:
        raise SdkitError(f"a heat map is (H, W), not {list(heat.shape)}")
    heat = F.interpolate(heat[None, None], size=image.size[::-1], mode="bilinear", align_corners=False)[0, 0]
    heat = (heat - heat.min()) / (heat.max() - heat.min()).clamp_min(1e-12)
    coloured = (colormaps[cmap](heat.numpy())[..., :3] * 255).round().astype(np.uint8)
    return Image.blend(image.convert("RGB"), Image.fromarray(coloured), alpha)


def _selected(key, layers, timesteps, all_layers: dict[str, _LayerSums]) -> bool:
    layer, timestep = key
    if layers is not None:
        sides = {x for x in layers if isinstance(x, int)}
        names = {x for x in layers if isinstance(x, str)}
        grid = all_layers[layer].grid
        if layer not in names and not (grid and grid[0] in sides):
            return False
    return timesteps is None or timestep in set(timesteps)
