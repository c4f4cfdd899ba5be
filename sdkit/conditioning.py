"""What the cross-attention reads: capture attn2 through diffusers' attention-processor API.

    with CrossAttentionTrace(unet) as trace:
        unet(latent, t, encoder_hidden_states=states)
    trace.summary()        # per layer: spatial spread, entropy, effective tokens, mass per token

In cross-attention the queries come from image cells and the keys/values from text tokens. With
one token (or several identical ones) every cell receives the same vector; only distinct tokens
let cells read differently. `compare_conditionings` shows this on any U-Net.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from diffusers.models.attention_processor import Attention, AttnProcessor, AttnProcessor2_0

from .common import SdkitError, first_line, format_table, save_figure, write_json
from .encoders import ROLES, TextEncoder, TokenRoles, token_roles
from .geometry import halved

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

    def __call__(self, attn: Attention, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None,
                 *args, **kwargs):  # fmt: skip
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

    def __init__(self, unet, cfg: bool = False, maps: bool = False, map_sides: tuple[int, ...] | None = None,
                 by_timestep: bool = False, timesteps=None, keep_heads: bool = False, keep_graph: bool = False):  # fmt: skip
        self.unet, self.cfg, self.maps, self.map_sides = unet, cfg, maps, map_sides
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
        self._hook = None

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
        if isinstance(self.unet, torch.nn.Module):
            self._hook = self.unet.register_forward_pre_hook(self._read_call, with_kwargs=True)
        return self

    def __exit__(self, *exc) -> None:
        if self._hook is not None:
            self._hook.remove()
        self.unet.set_attn_processor(dict(self._original))  # set_attn_processor consumes its dict
        self._original = None

    def _read_call(self, module, args, kwargs):
        sample = args[0] if args else kwargs["sample"]
        self._latent_size = tuple(sample.shape[-2:])
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
        if self.cfg:
            if batch % 2:
                raise SdkitError(f"cfg=True needs (unconditional, conditional) pairs, but {name} got a batch of {batch}")
            probs, mixed = probs[batch // 2 :], mixed[batch // 2 :]
        probs, mixed = probs.float(), mixed.float()
        items = probs.shape[0]
        s = self.layers[name]
        if s.token_mass is not None and s.token_mass.shape != (items, tokens):
            raise SdkitError(f"{name}: the batch or the number of text tokens changed within one trace "
                             f"({tuple(s.token_mass.shape)} -> {(items, tokens)} items x tokens)")  # fmt: skip
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

    def token_maps(self, item: int | None = None, layers=None, timesteps=None, head: int | None = None,
                   size: tuple[int, int] | None = None) -> torch.Tensor:  # fmt: skip
        """(tokens, H, W): attention per token, the mean over the selected layers (names, or grid
        sides as ints), timesteps and heads, upsampled to `size` (default: the latent size); of one
        batch item, or the mean over items."""
        keys = [k for k in self.map_sums if _selected(k, layers, timesteps, self.layers)]
        if not keys:
            raise SdkitError("no maps were captured for this selection (maps=False, or no layer / timestep matches)")
        size = size or self._latent_size
        total = None
        for key in keys:
            mean = self.map_sums[key] / self.map_calls[key]
            if self.keep_heads:
                mean = mean.mean(1) if head is None else mean[:, head]
            elif head is not None:
                raise SdkitError("maps per head need keep_heads=True")
            mean = mean.mean(0) if item is None else mean[item]
            up = F.interpolate(mean[None], size=size, mode="bilinear", align_corners=False)[0]
            total = up if total is None else total + up
        return total / len(keys)

    def save_maps(self, path) -> None:
        """The raw maps, one tensor per (layer, timestep): (items, [heads,] tokens, h, w), the mean over
        calls, as safetensors (atomically)."""
        from safetensors.torch import save_file

        from .common import atomic_path

        tensors = {f"{layer}@{'all' if t is None else t}": (self.map_sums[(layer, t)] / self.map_calls[(layer, t)]).contiguous()
                   for layer, t in self.map_sums}  # fmt: skip
        with atomic_path(path) as tmp:
            save_file(tensors, str(tmp), metadata={"latent_size": json.dumps(self._latent_size),
                                                   "keep_heads": str(self.keep_heads)})  # fmt: skip


def _selected(key, layers, timesteps, all_layers: dict[str, _LayerSums]) -> bool:
    layer, timestep = key
    if layers is not None:
        sides = {x for x in layers if isinstance(x, int)}
        names = {x for x in layers if isinstance(x, str)}
        grid = all_layers[layer].grid
        if layer not in names and not (grid and grid[0] in sides):
            return False
    return timesteps is None or timestep in set(timesteps)


# --- comparing conditionings ----------------------------------------------------------------------


@dataclass
class Conditioning:
    """The conditionings to compare, built from one source of token states."""

    cases: dict[str, torch.Tensor]  # name -> (1, tokens, width)
    source: str
    roles: TokenRoles | None = None
    positions: dict[str, list[int]] = field(default_factory=dict)  # case -> positions of multi it keeps


def synthetic_conditionings(width: int, tokens: int = 77, seed: int = 0) -> Conditioning:
    """Distinct random token vectors (unit variance per coordinate, like CLIP's states)."""
    generator = torch.Generator().manual_seed(seed)
    multi = torch.randn(1, tokens, width, generator=generator)
    single = multi[:, :1]
    return Conditioning({"single": single, "repeated": single.repeat(1, tokens, 1), "multi": multi},
                        f"{tokens} synthetic token vectors (seed {seed}; no text encoder given)")  # fmt: skip


def prompt_conditionings(encoder: TextEncoder, prompt: str) -> Conditioning:
    """Cases from a real encoder: multi (all positions), single / repeated (the EOS state, which
    CLIP pools as the prompt's summary), bos_only and words_only."""
    states = encoder.encode([prompt])
    roles = token_roles(encoder.tokenizer, prompt, encoder.max_length)
    eos = roles.roles.index("eos")
    words = [p for p, r in enumerate(roles.roles) if r == "word"]
    if not words:
        raise SdkitError("the prompt has no words to compare (it is empty)")
    single = states[:, eos : eos + 1]
    cases = {"single": single, "repeated": single.repeat(1, states.shape[1], 1), "multi": states,
             "bos_only": states[:, :1], "words_only": states[:, words]}  # fmt: skip
    positions = {"multi": list(range(states.shape[1])), "bos_only": [0], "words_only": words}
    return Conditioning(cases, f"{encoder.source} ({encoder.layer} layer) for {prompt!r}", roles, positions)


@dataclass
class Comparison:
    unet: str
    conditioning: str
    latent_size: tuple[int, int]
    timestep: int
    cases: dict[str, dict]  # name -> {"tokens", "layers": {layer: stats}, "overall": {...}, roles / words}
    maps: torch.Tensor | None = None  # multi case, (tokens, H, W)
    note: str = ""  # e.g. that the weights are random

    def to_json(self) -> dict:
        return {"unet": self.unet, "note": self.note, "conditioning": self.conditioning,
                "latent_size": list(self.latent_size), "timestep": self.timestep, "cases": self.cases}  # fmt: skip


def check_width(unet, conditioning: Conditioning) -> None:
    width = unet.config.cross_attention_dim
    for states in conditioning.cases.values():
        if states.shape[-1] != width:
            raise SdkitError(f"text states are {states.shape[-1]} wide but the U-Net's cross-attention reads "
                             f"{width}; an adapter can map one to the other (sdkit adapter)")  # fmt: skip


MAPS_FILE = "maps.json"  # written last into a maps folder: it marks the folder as sdkit's
RUNTIME_BYTES = 64 * 2**20  # thread pools, kernels' workspaces and allocator slack, whatever the size


def predicted_forward_bytes(unet, latent_size: tuple[int, int], tokens: int = 77, maps: bool = False) -> int:
    """A generous prediction of the peak memory of one traced forward pass: the weights, and twice
    (for the copies the kernels make) the feature maps kept for the skip connections, the working
    tensors at the busiest level (GEGLU's 8x-wide projection and its halves), the attention tables
    the trace computes beside each attn2 (heads x cells x tokens) and, with maps, the per-token maps
    at the latent size. Checked against measured peaks in tests/test_reliability.py."""
    config = unet.config
    element = next(unet.parameters()).element_size()
    weights = sum(p.numel() * p.element_size() for p in unet.parameters())
    skips, working, tables = 0, 0, 0
    heads = config.attention_head_dim if isinstance(config.attention_head_dim, int) else max(config.attention_head_dim)
    for depth, channels in enumerate(config.block_out_channels):
        cells = math.prod(halved(*latent_size, depth))
        skips += (config.layers_per_block + 1) * channels * cells * element
        working = max(working, 20 * channels * cells * element)
        tables = max(tables, 3 * heads * cells * tokens * 4)
    map_bytes = 2 * tokens * math.prod(latent_size) * 4 if maps else 0
    return weights + 2 * (skips + working + tables + map_bytes) + RUNTIME_BYTES


def preflight(unet, latent_size: tuple[int, int] | None, device: str, tokens: int = 77, maps: bool = False,
              budget: int | None = None) -> None:  # fmt: skip
    """Refuse, with one line, a traced forward pass that would not fit in the device's free memory."""
    from .common import available_memory, format_bytes

    side = unet.config.sample_size
    latent_size = tuple(latent_size or (side, side))
    need = predicted_forward_bytes(unet, latent_size, tokens, maps)
    if budget is None:
        budget = torch.cuda.mem_get_info(torch.device(device))[0] if device.startswith("cuda") else available_memory()
    if need > budget:
        raise SdkitError(f"a forward pass at latent {latent_size[0]}x{latent_size[1]} needs about {format_bytes(need)}; "
                         f"{device} has {format_bytes(budget)} free (choose a smaller --latent-size)")  # fmt: skip


def compare_conditionings(unet, conditioning: Conditioning, latent_size: tuple[int, int] | None = None,
                          timestep: int = 500, seed: int = 0, maps: bool = False,
                          map_sides: tuple[int, ...] | None = None, unet_name: str = "unet", note: str = "",
                          progress=None) -> Comparison:  # fmt: skip
    """Run the same U-Net, latent and timestep under each conditioning and trace attn2."""
    check_width(unet, conditioning)
    side = unet.config.sample_size
    latent_size = tuple(latent_size or (side, side))
    param = next(unet.parameters())
    generator = torch.Generator().manual_seed(seed)
    latent = torch.randn(1, unet.config.in_channels, *latent_size, generator=generator).to(param.device, param.dtype)
    cases, token_maps = {}, None
    for name, states in conditioning.cases.items():
        want_maps = maps and name == "multi"
        with torch.no_grad(), CrossAttentionTrace(unet, maps=want_maps, map_sides=map_sides) as trace:
            try:
                unet(latent, timestep, encoder_hidden_states=states.to(param.device, param.dtype))
            except (RuntimeError, ValueError, TypeError, IndexError) as e:  # a config diffusers built but cannot run
                raise SdkitError(f"{unet_name}: the U-Net fails on a forward pass ({first_line(e)[:160]}); "
                                 "check its config") from None  # fmt: skip
        layers = trace.summary()
        cases[name] = {"tokens": states.shape[1], "layers": layers, "overall": _overall(layers)}
        if conditioning.roles is not None and name in conditioning.positions:
            cases[name].update(_mass_by_role(cases[name]["overall"]["token_mass"], conditioning, name))
        if want_maps:
            token_maps = trace.token_maps()
        if progress:
            progress.update(1)
    return Comparison(unet_name, conditioning.source, latent_size, timestep, cases, token_maps, note)


def _overall(layers: dict[str, dict]) -> dict:
    spreads = [v["spatial_spread"] for v in layers.values()]
    n = len(layers)
    mass = torch.tensor([v["token_mass"] for v in layers.values()]).mean(0)
    entropy = sum(v["entropy"] for v in layers.values()) / n
    return {"spatial_spread": sum(spreads) / n, "spatial_spread_min": min(spreads),
            "spatial_spread_max": max(spreads), "entropy": entropy, "effective_tokens": math.exp(entropy),
            "token_mass": mass.tolist()}  # fmt: skip


def _mass_by_role(mass: list[float], conditioning: Conditioning, case: str) -> dict:
    """Attention mass per role (bos / word / eos / padding) and per word, for a real prompt."""
    roles = conditioning.roles
    positions = conditioning.positions[case]  # position in the prompt of each token in this case
    by_role: dict[str, float] = {}
    by_position = dict(zip(positions, mass))
    for position, m in by_position.items():
        by_role[roles.roles[position]] = by_role.get(roles.roles[position], 0.0) + m
    words = [{"word": word, "positions": ps, "mass": sum(by_position.get(p, 0.0) for p in ps)}
             for word, ps in roles.words]  # fmt: skip
    return {"mass_by_role": by_role, "mass_by_word": words}


# --- output ---------------------------------------------------------------------------------------


FLOAT_NOISE = 1e-5  # spreads below this are rounding, not cells reading different things


def _spread(value: float) -> str:
    return "≈0" if abs(value) < FLOAT_NOISE else f"{value:.4g}"


def format_comparison(c: Comparison) -> str:
    names = list(c.cases)
    layers = list(next(iter(c.cases.values()))["layers"])
    rows = [[layer, "x".join(map(str, c.cases[names[0]]["layers"][layer]["grid"] or ["?"])),
             *(_spread(c.cases[n]["layers"][layer]["spatial_spread"]) for n in names)] for layer in layers]  # fmt: skip
    out = [f"U-Net: {c.unet}; latent {c.latent_size[0]}x{c.latent_size[1]}, timestep {c.timestep}",
           *([f"  ({c.note})"] if c.note else []), f"Text: {c.conditioning}", ""]  # fmt: skip
    out.append(format_table(["layer (as in the API)", "grid", *names], rows,
                            title="Spatial spread of the cross-attention output, ||O - mean_cells O|| / ||O||\n"
                                  f"(0: every cell receives the same vector; ≈0: below {FLOAT_NOISE:g}, rounding)"))  # fmt: skip
    rows = [[n, v["tokens"], _spread(v["overall"]["spatial_spread"]), _spread(v["overall"]["spatial_spread_min"]),
             _spread(v["overall"]["spatial_spread_max"]), v["overall"]["entropy"], v["overall"]["effective_tokens"]]
            for n, v in c.cases.items()]  # fmt: skip
    out += ["", format_table(["case", "tokens", "spread", "min", "max", "entropy", "eff. tokens"], rows,
                             title="Overall (mean over layers; entropy in nats per cell, eff. tokens = exp(entropy))")]  # fmt: skip
    with_roles = [n for n, v in c.cases.items() if "mass_by_role" in v]
    if with_roles:
        rows = [[n, *(f"{100 * c.cases[n]['mass_by_role'].get(r, 0.0):.1f} %" for r in ROLES)] for n in with_roles]
        out += ["", format_table(["case", *ROLES], rows, title="Attention mass by token role (mean over cells, heads, layers)")]
        words = c.cases["multi"]["mass_by_word"]
        rows = [[w["word"], len(w["positions"]), f"{100 * w['mass']:.2f} %"] for w in words]
        out += ["", format_table(["word", "pieces", "mass"], rows, title="Attention mass per word (multi)")]
    out.append("\n" + conclusion(c))
    return "\n".join(out)


def conclusion(c: Comparison) -> str:
    """One line: does one token (or one repeated) give every cell the same vector, and many not?"""
    flat = [n for n, v in c.cases.items() if v["overall"]["spatial_spread_max"] < FLOAT_NOISE]
    varied = [n for n, v in c.cases.items() if v["overall"]["spatial_spread_min"] >= FLOAT_NOISE]
    return (f"Every cell receives the same vector under {', '.join(flat) or 'no case'};\n"
            f"cells read different things under {', '.join(varied) or 'no case'}.")


def write_maps(c: Comparison, conditioning: Conditioning, folder, shared_scale: bool = False,
               vae_factor: int = 8) -> list[Path]:  # fmt: skip
    """One PNG heatmap per word (upsampled to the image) and an overview grid; returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if c.maps is None:
        raise SdkitError("no maps were captured; run the comparison with maps=True")
    roles = conditioning.roles
    if roles is not None:
        named = [("<bos>", [0])] + roles.words + [("<eos>", [roles.roles.index("eos")])]
    else:  # synthetic tokens have no words: show the first positions
        named = [(f"token {p}", [p]) for p in range(min(8, c.maps.shape[0]))]
    size = (c.latent_size[0] * vae_factor, c.latent_size[1] * vae_factor)
    images = [F.interpolate(c.maps[ps].sum(0)[None, None], size=size, mode="bilinear", align_corners=False)[0, 0]
              for _, ps in named]  # fmt: skip
    # A shared scale starts at 0 so maps compare; an own scale stretches each map to show its shape.
    vmin, vmax = (0.0, max(float(im.max()) for im in images)) if shared_scale else (None, None)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, ((word, _), image) in enumerate(zip(named, images)):
        fig, ax = plt.subplots(figsize=(4, 4 * size[0] / size[1] + 0.4), dpi=100)
        shown = ax.imshow(image.numpy(), cmap="inferno", vmin=vmin, vmax=vmax)
        ax.set_title(f"{word!r}: {100 * float(c.maps[named[i][1]].sum(0).mean()):.1f} % of attention")
        ax.axis("off")
        fig.colorbar(shown, ax=ax, fraction=0.046)
        paths.append(save_figure(fig, folder / f"{i:02d}_{_file_name(word)}.png"))
    cols = min(6, len(images))
    rows = -(-len(images) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(2.2 * cols, 2.4 * rows), dpi=100, squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for ax, (word, _), image in zip(axes.flat, named, images):
        shown = ax.imshow(image.numpy(), cmap="inferno", vmin=vmin, vmax=vmax)
        ax.set_title(word, fontsize=9)
        fig.colorbar(shown, ax=ax, fraction=0.046, pad=0.02).ax.tick_params(labelsize=6)
    fig.suptitle(f"Cross-attention per word ({c.unet}, {'shared' if shared_scale else 'own'} colour scale)", fontsize=10)
    paths.append(save_figure(fig, folder / "overview.png"))
    # Last: the list of what was written, which marks the folder as sdkit's maps
    write_json(folder / MAPS_FILE, {"unet": c.unet, "words": [word for word, _ in named],
                                    "files": [p.name for p in paths], "shared_scale": shared_scale})  # fmt: skip
    return paths


def _file_name(word: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", word).strip("_")[:40] or "token"
