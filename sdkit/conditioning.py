"""What the cross-attention reads, one conditioning against another (traced by sdkit.trace).

In cross-attention the queries come from image cells and the keys/values from text tokens. With
one token (or several identical ones) every cell receives the same vector; only distinct tokens
let cells read differently. `compare_conditionings` shows this on any U-Net.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from .common import MAPS_FOLDER, SdkitError, atomic_folder, first_line, format_table, save_figure, write_json
from .encoders import ROLES, TextEncoder, TokenRoles, token_roles
from .geometry import halved
from .trace import CrossAttentionTrace


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
    return Conditioning(
        {"single": single, "repeated": single.repeat(1, tokens, 1), "multi": multi},
        f"{tokens} synthetic token vectors (seed {seed}; no text encoder given)",
    )


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
    cases = {
        "single": single,
        "repeated": single.repeat(1, states.shape[1], 1),
        "multi": states,
        "bos_only": states[:, :1],
        "words_only": states[:, words],
    }
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
        return {
            "unet": self.unet,
            "note": self.note,
            "conditioning": self.conditioning,
            "latent_size": list(self.latent_size),
            "timestep": self.timestep,
            "cases": self.cases,
        }


def check_width(unet, conditioning: Conditioning) -> None:
    width = unet.config.cross_attention_dim
    for states in conditioning.cases.values():
        if states.shape[-1] != width:
            raise SdkitError(
                f"text states are {states.shape[-1]} wide but the U-Net's cross-attention reads "
                f"{width}; an adapter can map one to the other (sdkit adapter)"
            )


MAPS_FILE = "maps.json"  # in a maps folder: the words and their pictures
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


def preflight(
    unet,
    latent_size: tuple[int, int] | None,
    device: str,
    tokens: int = 77,
    maps: bool = False,
    budget: int | None = None,
) -> None:
    """Refuse, with one line, a traced forward pass that would not fit in the device's free memory."""
    from .common import available_memory, format_bytes

    side = unet.config.sample_size
    latent_size = tuple(latent_size or (side, side))
    need = predicted_forward_bytes(unet, latent_size, tokens, maps)
    if budget is None:
        budget = torch.cuda.mem_get_info(torch.device(device))[0] if device.startswith("cuda") else available_memory()
    if need > budget:
        raise SdkitError(
            f"a forward pass at latent {latent_size[0]}x{latent_size[1]} needs about {format_bytes(need)}; "
            f"{device} has {format_bytes(budget)} free (choose a smaller --latent-size)"
        )


def compare_conditionings(
    unet,
    conditioning: Conditioning,
    latent_size: tuple[int, int] | None = None,
    timestep: int = 500,
    seed: int = 0,
    maps: bool = False,
    map_sides: tuple[int, ...] | None = None,
    unet_name: str = "unet",
    note: str = "",
    progress=None,
) -> Comparison:
    """Run the same U-Net, latent and timestep under each conditioning and trace attn2."""
    check_width(unet, conditioning)
    side = unet.config.sample_size
    latent_size = tuple(latent_size or (side, side))
    if maps and map_sides is not None:
        heights = sorted(
            {halved(*latent_size, depth)[0] for depth in range(len(unet.config.block_out_channels))}, reverse=True
        )
        if not set(map_sides) & set(heights):
            raise SdkitError(
                f"no level of this U-Net has a grid side in {', '.join(map(str, map_sides))} at latent "
                f"{latent_size[0]}x{latent_size[1]}; its levels are {', '.join(map(str, heights))} high"
            )
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
                raise SdkitError(
                    f"{unet_name}: the U-Net fails on a forward pass ({first_line(e)[:160]}); check its config"
                ) from None
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
    return {
        "spatial_spread": sum(spreads) / n,
        "spatial_spread_min": min(spreads),
        "spatial_spread_max": max(spreads),
        "entropy": entropy,
        "effective_tokens": math.exp(entropy),
        "token_mass": mass.tolist(),
    }


def _mass_by_role(mass: list[float], conditioning: Conditioning, case: str) -> dict:
    """Attention mass per role (bos / word / eos / padding) and per word, for a real prompt."""
    roles = conditioning.roles
    positions = conditioning.positions[case]  # position in the prompt of each token in this case
    by_role: dict[str, float] = {}
    by_position = dict(zip(positions, mass))
    for position, m in by_position.items():
        by_role[roles.roles[position]] = by_role.get(roles.roles[position], 0.0) + m
    words = [
        {"word": word, "positions": ps, "mass": sum(by_position.get(p, 0.0) for p in ps)} for word, ps in roles.words
    ]
    return {"mass_by_role": by_role, "mass_by_word": words}


# --- output ---------------------------------------------------------------------------------------


FLOAT_NOISE = 1e-5  # spreads below this are rounding, not cells reading different things


def _spread(value: float) -> str:
    return "≈0" if abs(value) < FLOAT_NOISE else f"{value:.4g}"


def format_comparison(c: Comparison) -> str:
    names = list(c.cases)
    layers = list(next(iter(c.cases.values()))["layers"])
    rows = [
        [
            layer,
            "x".join(map(str, c.cases[names[0]]["layers"][layer]["grid"] or ["?"])),
            *(_spread(c.cases[n]["layers"][layer]["spatial_spread"]) for n in names),
        ]
        for layer in layers
    ]
    out = [
        f"U-Net: {c.unet}; latent {c.latent_size[0]}x{c.latent_size[1]}, timestep {c.timestep}",
        *([f"  ({c.note})"] if c.note else []),
        f"Text: {c.conditioning}",
        "",
    ]
    out.append(
        format_table(
            ["layer (as in the API)", "grid", *names],
            rows,
            title="Spatial spread of the cross-attention output, ||O - mean_cells O|| / ||O||\n"
            f"(0: every cell receives the same vector; ≈0: below {FLOAT_NOISE:g}, rounding)",
        )
    )
    rows = [
        [
            n,
            v["tokens"],
            _spread(v["overall"]["spatial_spread"]),
            _spread(v["overall"]["spatial_spread_min"]),
            _spread(v["overall"]["spatial_spread_max"]),
            v["overall"]["entropy"],
            v["overall"]["effective_tokens"],
        ]
        for n, v in c.cases.items()
    ]
    out += [
        "",
        format_table(
            ["case", "tokens", "spread", "min", "max", "entropy", "eff. tokens"],
            rows,
            title="Overall (mean over layers; entropy in nats per cell, eff. tokens = exp(entropy))",
        ),
    ]
    with_roles = [n for n, v in c.cases.items() if "mass_by_role" in v]
    if with_roles:
        rows = [[n, *(f"{100 * c.cases[n]['mass_by_role'].get(r, 0.0):.1f} %" for r in ROLES)] for n in with_roles]
        out += [
            "",
            format_table(["case", *ROLES], rows, title="Attention mass by token role (mean over cells, heads, layers)"),
        ]
        words = c.cases["multi"]["mass_by_word"]
        rows = [[w["word"], len(w["positions"]), f"{100 * w['mass']:.2f} %"] for w in words]
        out += ["", format_table(["word", "pieces", "mass"], rows, title="Attention mass per word (multi)")]
    out.append("\n" + conclusion(c))
    return "\n".join(out)


def conclusion(c: Comparison) -> str:
    """One line: does one token (or one repeated) give every cell the same vector, and many not?"""
    flat = [n for n, v in c.cases.items() if v["overall"]["spatial_spread_max"] < FLOAT_NOISE]
    varied = [n for n, v in c.cases.items() if v["overall"]["spatial_spread_min"] >= FLOAT_NOISE]
    return (
        f"Every cell receives the same vector under {', '.join(flat) or 'no case'};\n"
        f"cells read different things under {', '.join(varied) or 'no case'}."
    )


def write_maps(
    c: Comparison, conditioning: Conditioning, folder, shared_scale: bool = False, vae_factor: int = 8
) -> list[Path]:
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
    images = [
        F.interpolate(c.maps[ps].sum(0)[None, None], size=size, mode="bilinear", align_corners=False)[0, 0]
        for _, ps in named
    ]
    # A shared scale starts at 0 so maps compare; an own scale stretches each map to show its shape.
    vmin, vmax = (0.0, max(float(im.max()) for im in images)) if shared_scale else (None, None)
    folder = Path(folder)
    names = []
    with atomic_folder(folder, MAPS_FOLDER) as tmp:
        for i, ((word, _), image) in enumerate(zip(named, images)):
            fig, ax = plt.subplots(figsize=(4, 4 * size[0] / size[1] + 0.4), dpi=100)
            shown = ax.imshow(image.numpy(), cmap="inferno", vmin=vmin, vmax=vmax)
            ax.set_title(f"{word!r}: {100 * float(c.maps[named[i][1]].sum(0).mean()):.1f} % of attention")
            ax.axis("off")
            fig.colorbar(shown, ax=ax, fraction=0.046)
            names.append(save_figure(fig, tmp / f"{i:02d}_{_file_name(word)}.png").name)
        cols = min(6, len(images))
        rows = -(-len(images) // cols)
        fig, axes = plt.subplots(rows, cols, figsize=(2.2 * cols, 2.4 * rows), dpi=100, squeeze=False)
        for ax in axes.flat:
            ax.axis("off")
        for ax, (word, _), image in zip(axes.flat, named, images):
            shown = ax.imshow(image.numpy(), cmap="inferno", vmin=vmin, vmax=vmax)
            ax.set_title(word, fontsize=9)
            fig.colorbar(shown, ax=ax, fraction=0.046, pad=0.02).ax.tick_params(labelsize=6)
        fig.suptitle(
            f"Cross-attention per word ({c.unet}, {'shared' if shared_scale else 'own'} colour scale)", fontsize=10
        )
        names.append(save_figure(fig, tmp / "overview.png").name)
        # the list of the pictures, by word
        write_json(
            tmp / MAPS_FILE,
            {"unet": c.unet, "words": [word for word, _ in named], "files": names, "shared_scale": shared_scale},
        )
    return [folder / name for name in names]


def _file_name(word: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", word).strip("_")[:40] or "token"
