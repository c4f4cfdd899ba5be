"""The memory study that `sdkit memory` runs: capacities of random keys against the analytic ones,
long contexts with a fixed and a growing scale, real keys (text-encoder states, the mini SD's own),
and where SD 1.5's self-attention levels stand; its report, table and plot."""

from __future__ import annotations

import math
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

from ..common import format_table
from .capacity import (
    DIMENSIONS,
    PHIS,
    PUBLISHED,
    Curve,
    _unit,
    analytic_capacity,
    crossing,
    default_beta,
    measure_curve,
    memory_grid,
)


@dataclass
class MemoryReport:
    capacities: list[dict]  # per phi and d: analytic (exact, gaussian), measured, published
    curves: list[Curve]
    long_context: list[Curve] = field(default_factory=list)
    real_keys: list[dict] = field(default_factory=list)
    sd_levels: list[dict] = field(default_factory=list)
    seconds: float = 0.0
    peak_memory_bytes: int | None = None  # the process's peak resident set, where the OS reports it
    quick: bool = False

    def to_json(self) -> dict:
        return asdict(self)


def random_key_search(
    dimensions=DIMENSIONS, quick: bool = False, max_memories: int = 4 * 2**20, progress=None
) -> tuple[list[dict], list[Curve]]:
    """Measure SIR over M for each phi and d and find M*; beside the analytic values."""
    rows, curves = [], []
    for d in dimensions:
        for phi in PHIS:
            exact = analytic_capacity(phi, d)
            # Search a window around the prediction; softmax up to the memory budget.
            high = min(max_memories if not quick else 2**16, max(8, int(exact * 4)))
            low = max(2, int(exact / 8)) if phi != "softmax" else min(256, high)
            memories = memory_grid(low, high, per_octave=4 if phi != "softmax" else 2)
            curve = measure_curve(phi, d, memories, trials=2 if quick else 4, progress=progress)
            curves.append(curve)
            rows.append(
                {
                    "phi": phi,
                    "d": d,
                    "beta": curve.beta,
                    "analytic": exact,
                    "analytic_gaussian": analytic_capacity(phi, d, gaussian=True),
                    "measured": curve.capacity,
                    "measured_interval": curve.interval,
                    "extrapolated": curve.extrapolated,
                    "searched_to": memories[-1],
                    "published": PUBLISHED[phi] if d == 64 else None,
                }
            )
    return rows, curves


def long_context(d: int = 32, memories=None, quick: bool = False, progress=None) -> list[Curve]:
    """Softmax retrieval against M with a fixed scale (sqrt(d)) and a scale that grows with log M
    (LogN scaling: beta = sqrt(d) * log(M) / log(512))."""
    memories = memories or ([256, 1024, 4096, 16384] if quick else [256, 1024, 4096, 16384, 65536, 262144, 1048576])
    fixed = measure_curve("softmax", d, memories, trials=2, progress=progress)
    fixed.keys = "random, fixed beta = sqrt(d)"
    grown = []
    for m in memories:
        beta = default_beta(d) * math.log(m) / math.log(512)
        c = measure_curve("softmax", d, [m], beta=beta, trials=2, progress=progress)
        grown.append((c.sir[0], c.accuracy[0]))
    logn = Curve(
        "softmax",
        d,
        None,
        "random, LogN beta = sqrt(d) log(M) / log(512)",
        list(memories),
        [s for s, _ in grown],
        [a for _, a in grown],
        fixed.queries,
    )
    logn.capacity, logn.extrapolated = crossing(logn.memories, logn.sir)
    return [fixed, logn]


def real_key_capacity(
    name: str, keys: torch.Tensor, memories: list[int], progress=None, source: str = ""
) -> list[dict]:
    """Capacity with real keys, as they are and whitened, against random keys of the same size.

    `name` labels the rows (short); `source` says where the keys come from (default: name)."""
    centred = keys.double() - keys.double().mean(0)
    values, vectors = torch.linalg.eigh(centred.T @ centred / max(len(keys) - 1, 1))
    whitened = (centred @ (vectors * values.clamp_min(1e-9 * values.max()).rsqrt()) @ vectors.T).float()
    rows = []
    for phi in PHIS:
        for label, pool in (("raw", keys), ("whitened", whitened), ("random", None)):
            curve = measure_curve(
                phi,
                keys.shape[1],
                [m for m in memories if m <= len(keys)],
                keys=pool,
                key_source=f"{name} {label}" if pool is not None else "random",
                trials=2,
                progress=progress,
            )
            rows.append(
                {
                    "phi": phi,
                    "keys": curve.keys,
                    "source": source or name,
                    "d": curve.d,
                    "measured": curve.capacity,  # None: SIR below 1 already at searched_from
                    "extrapolated": curve.extrapolated,
                    "searched_from": curve.memories[0],
                    "searched_to": curve.memories[-1],
                    "analytic_random": analytic_capacity(phi, curve.d),
                    "mean_abs_cosine": _mean_abs_cosine(pool, curve.d),
                }
            )
    return rows


def _mean_abs_cosine(keys: torch.Tensor | None, d: int, sample: int = 2000) -> float:
    """Mean |cosine| between distinct keys: 1/sqrt(d) or so for random keys, more for structured ones."""
    if keys is None:
        keys = torch.randn(sample, d, generator=torch.Generator().manual_seed(0))
    keys = _unit(keys[:sample].double())
    cos = (keys @ keys.T).abs()
    n = len(keys)
    return float((cos.sum() - n) / (n * (n - 1)))


def sd_levels(image_sizes=(512, 1024, 2048)) -> list[dict]:
    """SD 1.5's attention levels: the random-key softmax capacity of each head size against the
    number of cells a self-attention row reads, at 512 px, other sizes and pixel level."""
    levels = [
        ("down0/up3 (64x64 at 512 px)", 40, 0),
        ("down1/up2 (32x32)", 80, 1),
        ("down2/up1 (16x16)", 160, 2),
        ("mid (8x8)", 160, 3),
    ]
    rows = []
    for name, head_dim, depth in levels:
        capacity = analytic_capacity("softmax", head_dim)
        cells = {size: ((size // 8) // 2**depth) ** 2 for size in image_sizes}
        # The image side where the cells this level attends over reach the capacity.
        side = 8 * 2**depth * math.sqrt(capacity)
        rows.append(
            {
                "level": name,
                "head_dim": head_dim,
                "capacity": capacity,
                "cells": cells,
                "pixel_cells": 512 * 512,
                "pixel_over_capacity": 512 * 512 / capacity,
                "passes_capacity_at_side": side,
            }
        )
    return rows


def encoder_keys(encoder, prompts: list[str], batch: int = 128) -> torch.Tensor:
    """Every real token state (no padding) of the prompts: (tokens, width). A prompt longer than the
    positions the encoder is read at is cut to them: the keys are what a model reading it sees
    (the mini SD reads 24 positions; minisd_keys' source line says how many prompts were cut)."""
    parts = []
    for start in range(0, len(prompts), batch):
        chunk = prompts[start : start + batch]
        states, real = encoder.encode(chunk, cut=True).float(), encoder.real_mask(chunk)
        parts.append(states[real])
    return torch.cat(parts)


def minisd_keys(
    pipe, prompts: list[str], layer: str = "mid_block.attentions.0.transformer_blocks.0.attn2", head: int = 0
) -> tuple[torch.Tensor, str]:
    """One head's cross-attention keys (to_k of its own encoder's token states) of a trained mini SD."""
    attention = pipe.unet.get_submodule(layer)
    states = encoder_keys(pipe.encoder, prompts)
    with torch.no_grad():
        keys = attention.to_k(states)
    head_dim = keys.shape[1] // attention.heads
    lengths = [len(ids) for ids in pipe.encoder.tokenizer(prompts)["input_ids"]]
    cut = sum(length > pipe.encoder.max_length for length in lengths)
    where = f"{layer} head {head}" + (
        f"; {cut} of {len(prompts)} prompts cut to its {pipe.encoder.max_length} positions" if cut else ""
    )
    return keys[:, head * head_dim : (head + 1) * head_dim].contiguous(), where


def run(
    quick: bool = False, encoders_dir="weights/encoders", minisd_dir="weights/minisd", progress=None
) -> MemoryReport:
    """Everything `sdkit memory` reports: random-key capacities per phi and d, long context, real
    keys (when the real encoder and the mini SD are here), and SD 1.5's levels."""
    from pathlib import Path

    start = time.perf_counter()
    encoder_dir = Path(encoders_dir) / "all-MiniLM-L6-v2"
    real = not quick and (encoder_dir / "config.json").is_file()
    pipe = None
    if real and (Path(minisd_dir) / "minisd.json").is_file():  # loaded first: a model that cannot run is said now
        from ..minisd.pipeline import MiniSDPipeline

        pipe = MiniSDPipeline.from_pretrained(minisd_dir, encoders_dir=encoders_dir)
    torch.manual_seed(0)
    capacities, curves = random_key_search(DIMENSIONS if not quick else (16, 32), quick=quick, progress=progress)
    report = MemoryReport(capacities, curves, quick=quick)
    report.long_context = long_context(quick=quick, progress=progress)
    if real:
        from ..adapter import generate_prompts
        from ..encoders import load_text_encoder
        from ..minisd.data import all_captions

        encoder = load_text_encoder(encoder_dir)
        prompts = generate_prompts(1500, seed=1) + all_captions()[::4]
        keys = encoder_keys(encoder, prompts)
        grid = memory_grid(8, min(len(keys), 32768), per_octave=2)
        report.real_keys += real_key_capacity(
            "MiniLM states", keys, grid, progress, source="all-MiniLM-L6-v2 token states (last layer)"
        )
        if pipe is not None:
            head_keys, where = minisd_keys(pipe, prompts)
            report.real_keys += real_key_capacity(
                "mini SD keys",
                head_keys,
                grid,
                progress,
                source=f"the trained mini SD's {where} keys (to_k of {pipe.spec.text_encoder} states)",
            )
    report.sd_levels = sd_levels()
    report.seconds = time.perf_counter() - start
    report.peak_memory_bytes = peak_resident_bytes()
    return report


def peak_resident_bytes() -> int | None:
    """This process's peak resident set size so far (None where the OS does not say)."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def format_report(r: MemoryReport) -> str:
    def count(v):
        return "-" if v is None else f"{v:,.0f}" if v < 1e7 else f"{v:.3g}"

    rows, inside = [], 0
    for c in r.capacities:
        measured = count(c["measured"]) + (" (extrap.)" if c["extrapolated"] else "")
        lo, hi = c.get("measured_interval") or (None, None)
        holds = lo is not None and lo <= c["analytic"] <= hi
        inside += holds
        ratio = f"{c['measured'] / c['analytic']:.2f}" if c["measured"] else "-"
        rows.append(
            [
                c["phi"],
                c["d"],
                f"{c['beta']:.2f}" if c["beta"] else "-",
                count(c["analytic"]),
                count(c["analytic_gaussian"]),
                measured,
                "-" if lo is None else f"[{count(lo)}, {count(hi)}]",
                "yes" if holds else "no",
                ratio,
                count(c["searched_to"]),
                count(c["published"]),
            ]
        )
    out = [
        format_table(
            [
                "phi",
                "d_k",
                "beta",
                "analytic",
                "gaussian approx",
                "measured",
                "95 % interval",
                "analytic in",
                "meas/an.",
                "searched to",
                "published",
            ],
            rows,
            title="Capacity M* (SIR = 1) with random unit keys and values (seed 0)",
        )
    ]
    out.append(
        f"Intervals: 95 % bootstrap over the queries of this run (one draw of keys per M): the precision of\n"
        f"the measurement, not the spread between draws. The analytic M* lies inside for {inside} of "
        f"{len(r.capacities)} rows."
    )
    out.append(
        "The published 64 / 128 / ~1.2M at d_k = 64 are d, 2d and exp(2 sqrt(d) - 2) = e^14 (the gaussian\n"
        "approximation); the exact analytic values count the target (+1) and integrate over the sphere."
    )
    if r.long_context:
        fixed, logn = r.long_context
        rows = [
            [
                count(m),
                f"{fixed.sir[i]:.3g}",
                f"{fixed.accuracy[i]:.2f}",
                f"{logn.sir[i]:.3g}",
                f"{logn.accuracy[i]:.2f}",
            ]
            for i, m in enumerate(fixed.memories)
        ]
        out += [
            "",
            format_table(
                ["memories", "SIR fixed", "acc fixed", "SIR LogN", "acc LogN"],
                rows,
                title=f"Long context, softmax, d_k = {fixed.d}: fixed beta = sqrt(d) against "
                "beta = sqrt(d) log(M) / log(512)",
            ),
        ]
    if r.real_keys:
        rows = [
            [
                k["phi"],
                k["keys"],
                k["d"],
                f"< {k['searched_from']}"
                if k["measured"] is None
                else count(k["measured"]) + (" (extrap.)" if k["extrapolated"] else ""),
                count(k["analytic_random"]),
                f"{k['mean_abs_cosine']:.3f}",
            ]
            for k in r.real_keys
        ]
        out += [
            "",
            format_table(
                ["phi", "keys", "d", "measured M*", "random analytic", "mean |cos|"],
                rows,
                title="Real keys (token states) against random keys of the same size",
            ),
        ]
        sources = {k["keys"].removesuffix(" raw"): k["source"] for k in r.real_keys if k["keys"].endswith(" raw")}
        out += [f"  {name}: {source}" for name, source in sources.items()]
    if r.sd_levels:
        sizes = list(r.sd_levels[0]["cells"])
        rows = [
            [
                s["level"],
                s["head_dim"],
                count(s["capacity"]),
                *(count(s["cells"][z]) for z in sizes),
                f"{s['pixel_over_capacity']:.3g}x",
                f"{s['passes_capacity_at_side']:,.0f} px",
            ]
            for s in r.sd_levels
        ]
        out += [
            "",
            format_table(
                [
                    "SD 1.5 level",
                    "head dim",
                    "capacity",
                    *(f"cells {z}px" for z in sizes),
                    "pixels / cap.",
                    "passes cap. at",
                ],
                rows,
                title="SD 1.5 self-attention: random-key softmax capacity (beta = sqrt(head dim)) "
                "against the cells a query reads",
            ),
        ]
    peak = f", peak memory {r.peak_memory_bytes / 2**20:,.0f} MiB (the whole process)" if r.peak_memory_bytes else ""
    out.append(f"\n{'quick run; ' if r.quick else ''}finished in {r.seconds:.0f} s{peak}")
    return "\n".join(out)


def plot(r: MemoryReport, path) -> None:
    """Log-log SIR and accuracy against M, one curve per phi (d_k = 64), capacities marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..common import save_figure

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8), dpi=110)
    d = 64 if any(c.d == 64 for c in r.curves) else r.curves[0].d
    for curve, colour in zip([c for c in r.curves if c.d == d], ("C0", "C1", "C2")):
        analytic = analytic_capacity(curve.phi, d)
        # Capacities go in the legend: written along the lines they overlapped the curves and each other.
        measured = f"\nmeasured {curve.capacity:,.0f} (star)" if curve.capacity else ""
        left.loglog(
            curve.memories,
            curve.sir,
            "o-",
            color=colour,
            markersize=3,
            label=f"{curve.phi}: M* = {analytic:,.0f} analytic (dashed){measured}",
        )
        right.semilogx(curve.memories, curve.accuracy, "o-", color=colour, markersize=3, label=curve.phi)
        left.axvline(analytic, color=colour, ls="--", lw=0.8)
        if curve.capacity:
            left.plot([curve.capacity], [1], "*", color=colour, markersize=12)
    # Distinct colours and the LogN curve on top: in grey, the two hid each other where they agree.
    for curve, style, colour, size in zip(r.long_context, ("s--", "^:"), ("C7", "C3"), (6, 4)):
        right.semilogx(
            curve.memories,
            curve.accuracy,
            style,
            color=colour,
            markersize=size,
            zorder=3,
            label=f"softmax d={curve.d}, {curve.keys.split(', ')[1]}",
        )
    left.axhline(1, color="black", lw=0.8)
    left.set(xlabel="memories M", ylabel="signal / interference", title=f"SIR against M (random keys, d_k = {d})")
    right.set(
        xlabel="memories M",
        ylabel="retrieval accuracy",
        title="Is the nearest stored value the target?",
        ylim=(-0.02, 1.02),
    )
    for ax in (left, right):  # legends below: inside, every corner of the SIR panel has a curve running through it
        ax.grid(True, which="both", alpha=0.2)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2)
    save_figure(fig, path)
