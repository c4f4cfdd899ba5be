"""Attention as key-value memory: how many memories a linear, ReLU or softmax store holds.

A linear layer, a two-layer MLP and attention all read a store of M (key, value) pairs as

    f(q) = sum_i v_i * phi(k_i . q)

with phi(x) = x, max(0, x), or exp(beta x) normalised (softmax). Query with a stored key k_t: the
target's value arrives with weight phi(k_t . k_t) = phi(1) (the signal), every other value with
weight phi(k_i . k_t) (the interference). The signal-to-interference ratio (SIR) is

    SIR(M) = sqrt( mean_t phi(1)^2 / mean_t || sum_{i != t} phi(k_i . k_t) v_i ||^2 )

(a power ratio over queries), and the capacity M* is where SIR = 1: past it, the other memories
blur the target as much as it shows. With keys uniform on the unit sphere of R^d and independent
unit values (so E[v_i . v_j] = 0), E||sum w_i v_i||^2 = (M - 1) E[w^2], which gives

    linear:   E[x^2] = 1/d              ->  M* = d + 1
    relu:     E[max(0, x)^2] = 1/(2d)   ->  M* = 2d + 1
    softmax:  weights exp(beta (x - 1)) ->  M* = 1 + exp(2 beta) / E[exp(2 beta x)]

where x = k_i . k_t is the cosine of two random unit vectors. Taking x ~ N(0, 1/d) gives the
closed form M* ~ exp(2 beta - 2 beta^2 / d), which at beta = sqrt(d) is exp(2 sqrt(d) - 2): at
d = 64, e^14 = 1.2 million, the published figure; the published 64 and 128 are d and 2d (the
"+1", the target itself, dropped). `analytic_capacity` also integrates E[exp(2 beta x)] exactly over
the sphere's cosine density, proportional to (1 - x^2)^((d - 3) / 2).

Measurement: for M up to EXHAUSTIVE_LIMIT every stored key is a query (all pairs, averaged over
trials); beyond it, a fixed set of stored keys is queried while keys and values stream past in
blocks, so the interference at every M on the way is a prefix sum and memory stays bounded (the
softmax search at d = 64 reaches millions of memories in a few hundred MB).
"""

from __future__ import annotations

import hashlib
import math
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

from .common import SdkitError, format_table

PHIS = ("linear", "relu", "softmax")
DIMENSIONS = (16, 32, 64, 128)
PUBLISHED = {"linear": 64, "relu": 128, "softmax": 1.2e6}  # at d_k = 64, random keys
BLOCK = 4096  # keys and values are drawn in blocks of this many rows, each from its own seed
EXHAUSTIVE_LIMIT = 4096


def default_beta(d: int) -> float:
    """sqrt(d): scaled dot-product attention's logits q.k / sqrt(d) for unit-variance entries, written
    for unit-norm keys (|q| |k| = d)."""
    return math.sqrt(d)


def cosine_moment(d: int, s: float) -> float:
    """E[exp(s x)] for x the cosine between two independent uniform unit vectors in R^d (d >= 2).

    Integrated over x's density, proportional to (1 - x^2)^((d - 3) / 2), in float64.
    """
    x = torch.linspace(-1, 1, 200_001, dtype=torch.float64)[1:-1]
    log_density = (d - 3) / 2 * torch.log1p(-x * x)
    log_weight = log_density + s * x
    peak = log_weight.max()
    num = torch.trapezoid(torch.exp(log_weight - peak), x)
    den = torch.trapezoid(torch.exp(log_density - log_density.max()), x)
    return float(num / den) * math.exp(float(peak - log_density.max()))


def analytic_capacity(phi: str, d: int, beta: float | None = None, gaussian: bool = False) -> float:
    """M* for random unit keys in R^d (see the module docstring for the assumptions).

    gaussian=True takes the cosine as N(0, 1/d), the closed form behind the published 1.2 million.
    """
    if phi == "linear":
        return d + 1
    if phi == "relu":
        return 2 * d + 1
    if phi == "softmax":
        beta = default_beta(d) if beta is None else beta
        if gaussian:
            return 1 + math.exp(2 * beta - 2 * beta * beta / d)
        return 1 + math.exp(2 * beta) / cosine_moment(d, 2 * beta)
    raise SdkitError(f"unknown phi {phi!r}; choose from {', '.join(PHIS)}")


# --- stores ----------------------------------------------------------------------------------------


def _unit(rows: torch.Tensor) -> torch.Tensor:
    return rows / rows.norm(dim=-1, keepdim=True).clamp_min(1e-12)


class Store:
    """M (key, value) pairs in R^d, drawn block by block, so any prefix is the same whatever the
    chunking. Keys are random unit vectors, or rows of `keys` (real states) in a seeded order."""

    def __init__(self, d: int, seed: int = 0, keys: torch.Tensor | None = None):
        self.d, self.seed = d, seed
        self.pool = None
        if keys is not None:
            order = torch.randperm(len(keys), generator=torch.Generator().manual_seed(seed))
            self.pool = _unit(keys.double()[order]).float()
            self.d = keys.shape[1]
        self._cache: dict[tuple[str, int], torch.Tensor] = {}

    @property
    def limit(self) -> int | None:
        return None if self.pool is None else len(self.pool)

    def _block(self, kind: str, index: int) -> torch.Tensor:
        key = (kind, index)
        if key not in self._cache:
            if len(self._cache) > 4:
                self._cache.clear()
            if kind == "keys" and self.pool is not None:
                block = self.pool[index * BLOCK : (index + 1) * BLOCK]
            else:
                # A stable hash: Python's hash() of a str changes from process to process, which made
                # every run draw other keys (the same command gave other capacities).
                digest = hashlib.sha256(repr((self.seed, kind, index)).encode()).digest()
                generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
                block = _unit(torch.randn(BLOCK, self.d, generator=generator))
            self._cache[key] = block
        return self._cache[key]

    def rows(self, kind: str, start: int, stop: int) -> torch.Tensor:
        """Keys or values start..stop (stop exclusive)."""
        if self.limit is not None and stop > self.limit and kind == "keys":
            raise SdkitError(f"only {self.limit:,} real keys; asked for {stop:,}")
        parts = []
        while start < stop:
            index, offset = divmod(start, BLOCK)
            take = min(stop - start, BLOCK - offset)
            parts.append(self._block(kind, index)[offset : offset + take])
            start += take
        return torch.cat(parts) if parts else torch.empty(0, self.d)


def weights(phi: str, scores: torch.Tensor, beta: float) -> torch.Tensor:
    """phi of the key-query cosines; softmax as exp(beta (x - 1)), so the target's weight is 1 (the
    normaliser cancels in the SIR) and nothing overflows."""
    if phi == "linear":
        return scores
    if phi == "relu":
        return scores.clamp_min(0)
    if phi == "softmax":
        return torch.exp(beta * (scores - 1))
    raise SdkitError(f"unknown phi {phi!r}; choose from {', '.join(PHIS)}")


def signal(phi: str) -> float:
    return 1.0  # phi(1) for linear and relu; exp(beta (1 - 1)) for softmax


@dataclass
class Curve:
    """SIR (and retrieval accuracy) against the number of memories, for one store."""

    phi: str
    d: int
    beta: float | None
    keys: str  # "random", or where real keys came from
    memories: list[int]
    sir: list[float]
    accuracy: list[float | None]
    queries: int
    capacity: float | None = None  # measured: where SIR crosses 1 (log-log interpolation)
    extrapolated: bool = False  # capacity past the last M, from SIR ~ M^(-1/2)
    interval: list[float] | None = None  # 95 % bootstrap interval of the capacity over the queries


def exhaustive(phi: str, store: Store, m: int, beta: float) -> tuple[float, float]:
    """(SIR, accuracy) of a store of m memories, every stored key a query."""
    keys, values = store.rows("keys", 0, m), store.rows("values", 0, m)
    w = weights(phi, keys @ keys.T, beta)
    w.fill_diagonal_(0)
    interference = w @ values
    powers = interference.pow(2).sum(1).double()
    sir = math.sqrt(signal(phi) ** 2 / max(float(powers.mean()), 1e-300))
    retrieved = interference + signal(phi) * values
    accuracy = float((torch.argmax(retrieved @ values.T, dim=1) == torch.arange(m)).float().mean())
    return sir, accuracy, powers


def streamed(phi: str, store: Store, memories: list[int], beta: float, queries: int = 256, accuracy_queries: int = 64,
             chunk: int = 65536, progress=None) -> tuple[list[float], list[float], list[torch.Tensor]]:  # fmt: skip
    """SIR, accuracy and each query's interference power at each M in `memories` (sorted, each >=
    queries), in one pass over the keys.

    The queries are the first `queries` stored keys; the interference on them at M is a prefix
    sum, so one pass gives every M. Accuracy (is the target's value the nearest to what came back?)
    takes a second pass over the values, for the first `accuracy_queries` queries.
    """
    if memories != sorted(memories) or memories[0] < queries:
        raise SdkitError(f"memory counts must be sorted and at least the {queries} queries")
    targets = store.rows("keys", 0, queries)
    target_values = store.rows("values", 0, queries)
    total = torch.zeros(queries, store.d, dtype=torch.float64)
    sirs, retrieved, powers, start = [], [], [], 0
    for m in memories:
        while start < m:
            stop = min(m, start + chunk)
            w = weights(phi, targets @ store.rows("keys", start, stop).T, beta)
            if start < queries:  # the targets themselves: not interference
                own = torch.arange(start, min(stop, queries))
                w[own, own - start] = 0
            total += (w @ store.rows("values", start, stop)).double()
            if progress is not None:
                progress.update(stop - start)
            start = stop
        powers.append(total.pow(2).sum(1))
        sirs.append(math.sqrt(signal(phi) ** 2 / max(float(powers[-1].mean()), 1e-300)))
        retrieved.append((total[:accuracy_queries] + signal(phi) * target_values[:accuracy_queries].double()).float())
    # Second pass: the best competitor of each retrieved vector among the other stored values.
    best = torch.full((len(memories), accuracy_queries), -math.inf)
    own = torch.stack([(r * target_values[:accuracy_queries]).sum(1) for r in retrieved])
    stacked = torch.stack(retrieved)  # (checkpoints, queries, d)
    start, step = 0, max(1, chunk // 4)  # the dots hold every checkpoint at once: smaller chunks
    while start < memories[-1]:
        stop = min(memories[-1], start + step)
        values = store.rows("values", start, stop)
        live = [i for i, m in enumerate(memories) if m > start]
        dots = torch.einsum("cqd,nd->cqn", stacked[live], values)
        for j, i in enumerate(live):
            cut = min(stop, memories[i]) - start
            block = dots[j, :, :cut]
            if start < accuracy_queries:
                mine = torch.arange(start, min(start + cut, accuracy_queries))
                block[mine, mine - start] = -math.inf
            best[i] = torch.maximum(best[i], block.max(1).values)
        start = stop
    accuracies = [float((own[i] > best[i]).float().mean()) for i in range(len(memories))]
    return sirs, accuracies, powers


def crossing(memories: list[int], sirs: list[float]) -> tuple[float | None, bool]:
    """Where SIR falls through 1, interpolated in log-log; past the end, extrapolated as M^(-1/2)."""
    pairs = list(zip(memories, sirs))
    for (m0, s0), (m1, s1) in zip(pairs, pairs[1:]):
        if s0 >= 1 > s1:
            t = math.log(s0) / (math.log(s0) - math.log(s1))
            return math.exp(math.log(m0) + t * (math.log(m1) - math.log(m0))), False
    if pairs and pairs[-1][1] >= 1 and pairs[-1][1] > 0:
        m, s = pairs[-1]
        return m * s * s, True
    return None, False


def measure_curve(phi: str, d: int, memories: list[int], beta: float | None = None, keys: torch.Tensor | None = None,
                  key_source: str = "random", trials: int = 4, queries: int = 256, seed: int = 0,
                  chunk: int = 65536, progress=None) -> Curve:  # fmt: skip
    """SIR and accuracy at each M: exhaustively up to EXHAUSTIVE_LIMIT (mean over trials), streamed beyond."""
    beta = default_beta(d if keys is None else keys.shape[1]) if beta is None else beta
    small = [m for m in memories if m <= EXHAUSTIVE_LIMIT]
    large = [m for m in memories if m > EXHAUSTIVE_LIMIT]
    sirs, accs, powers = [], [], []
    for m in small:
        results = [exhaustive(phi, Store(d, seed + t, keys), m, beta) for t in range(trials)]
        # Power ratio over all trials: the mean interference power, not the mean of ratios.
        powers.append(torch.cat([p for _, _, p in results]))
        sirs.append(signal(phi) / math.sqrt(max(float(powers[-1].mean()), 1e-300)))
        accs.append(sum(a for _, a, _ in results) / trials)
        if progress is not None:
            progress.update(m * trials)
    if large:
        s, a, p = streamed(phi, Store(d, seed, keys), large, beta, min(queries, large[0]), chunk=chunk, progress=progress)
        sirs, accs, powers = sirs + s, accs + a, powers + p
    dim = d if keys is None else keys.shape[1]
    capacity, extrapolated = crossing(memories, sirs)
    return Curve(phi, dim, beta if phi == "softmax" else None, key_source, list(memories), sirs, accs,
                 min(queries, large[0]) if large else -1, capacity, extrapolated,
                 capacity_interval(memories, powers, phi, seed=seed) if capacity is not None else None)  # fmt: skip


def capacity_interval(memories: list[int], powers: list[torch.Tensor], phi: str, samples: int = 400, seed: int = 0,
                      level: float = 0.95) -> list[float] | None:  # fmt: skip
    """A percentile bootstrap interval of M* over the queries: each draw resamples every M's queries
    (the streamed M share one set of queries, and are resampled together), recomputes the SIR
    curve and finds where it crosses 1. None when fewer than half the draws cross within the search."""
    generator = torch.Generator().manual_seed(seed)
    shared = {len(p) for p in powers}
    draws = []
    for _ in range(samples):
        picks = {n: torch.randint(0, n, (n,), generator=generator) for n in shared}
        sirs = [signal(phi) / math.sqrt(max(float(p[picks[len(p)]].mean()), 1e-300)) for p in powers]
        capacity, _ = crossing(memories, sirs)
        if capacity is not None:
            draws.append(capacity)
    if len(draws) < samples / 2:
        return None
    tail = (1 - level) / 2
    ordered = torch.tensor(draws, dtype=torch.float64)
    return [float(ordered.quantile(tail)), float(ordered.quantile(1 - tail))]


def memory_grid(low: int, high: int, per_octave: int = 2) -> list[int]:
    """Memory counts from low to high, `per_octave` per doubling."""
    count = int(math.log2(high / low) * per_octave) + 1
    return sorted({round(low * 2 ** (i / per_octave)) for i in range(count)} | {high})


# --- the report --------------------------------------------------------------------------------------


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


def random_key_search(dimensions=DIMENSIONS, quick: bool = False, max_memories: int = 4 * 2**20,
                      progress=None) -> tuple[list[dict], list[Curve]]:  # fmt: skip
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
            rows.append({"phi": phi, "d": d, "beta": curve.beta, "analytic": exact,
                         "analytic_gaussian": analytic_capacity(phi, d, gaussian=True),
                         "measured": curve.capacity, "measured_interval": curve.interval,
                         "extrapolated": curve.extrapolated,
                         "searched_to": memories[-1], "published": PUBLISHED[phi] if d == 64 else None})  # fmt: skip
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
    logn = Curve("softmax", d, None, "random, LogN beta = sqrt(d) log(M) / log(512)", list(memories),
                 [s for s, _ in grown], [a for _, a in grown], fixed.queries)  # fmt: skip
    logn.capacity, logn.extrapolated = crossing(logn.memories, logn.sir)
    return [fixed, logn]


def real_key_capacity(name: str, keys: torch.Tensor, memories: list[int], progress=None,
                      source: str = "") -> list[dict]:  # fmt: skip
    """Capacity with real keys, as they are and whitened, against random keys of the same size.

    `name` labels the rows (short); `source` says where the keys come from (default: name)."""
    centred = keys.double() - keys.double().mean(0)
    values, vectors = torch.linalg.eigh(centred.T @ centred / max(len(keys) - 1, 1))
    whitened = (centred @ (vectors * values.clamp_min(1e-9 * values.max()).rsqrt()) @ vectors.T).float()
    rows = []
    for phi in PHIS:
        for label, pool in (("raw", keys), ("whitened", whitened), ("random", None)):
            curve = measure_curve(phi, keys.shape[1], [m for m in memories if m <= len(keys)], keys=pool,
                                  key_source=f"{name} {label}" if pool is not None else "random", trials=2,
                                  progress=progress)  # fmt: skip
            rows.append({"phi": phi, "keys": curve.keys, "source": source or name, "d": curve.d,
                         "measured": curve.capacity,
                         "extrapolated": curve.extrapolated, "searched_to": curve.memories[-1],
                         "analytic_random": analytic_capacity(phi, curve.d),
                         "mean_abs_cosine": _mean_abs_cosine(pool, curve.d)})  # fmt: skip
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
    levels = [("down0/up3 (64x64 at 512 px)", 40, 0), ("down1/up2 (32x32)", 80, 1), ("down2/up1 (16x16)", 160, 2),
              ("mid (8x8)", 160, 3)]  # fmt: skip
    rows = []
    for name, head_dim, depth in levels:
        capacity = analytic_capacity("softmax", head_dim)
        cells = {size: ((size // 8) // 2**depth) ** 2 for size in image_sizes}
        # The image side where the cells this level attends over reach the capacity.
        side = 8 * 2**depth * math.sqrt(capacity)
        rows.append({"level": name, "head_dim": head_dim, "capacity": capacity, "cells": cells,
                     "pixel_cells": 512 * 512, "pixel_over_capacity": 512 * 512 / capacity,
                     "passes_capacity_at_side": side})  # fmt: skip
    return rows


def encoder_keys(encoder, prompts: list[str], batch: int = 128) -> torch.Tensor:
    """Every real token state (no padding) of the prompts: (tokens, width)."""
    parts = []
    for start in range(0, len(prompts), batch):
        chunk = prompts[start : start + batch]
        states, real = encoder.encode(chunk).float(), encoder.real_mask(chunk)
        parts.append(states[real])
    return torch.cat(parts)


def minisd_keys(pipe, prompts: list[str], layer: str = "mid_block.attentions.0.transformer_blocks.0.attn2",
                head: int = 0) -> tuple[torch.Tensor, str]:  # fmt: skip
    """One head's cross-attention keys (to_k of its own encoder's token states) of a trained mini SD."""
    attention = pipe.unet.get_submodule(layer)
    states = encoder_keys(pipe.encoder, prompts)
    with torch.no_grad():
        keys = attention.to_k(states)
    head_dim = keys.shape[1] // attention.heads
    return keys[:, head * head_dim : (head + 1) * head_dim].contiguous(), f"{layer} head {head}"


def run(quick: bool = False, encoders_dir="weights/encoders", minisd_dir="weights/minisd", progress=None) -> MemoryReport:
    """Everything `sdkit memory` reports: random-key capacities per phi and d, long context, real
    keys (when the real encoder and the mini SD are here), and SD 1.5's levels."""
    from pathlib import Path

    start = time.perf_counter()
    encoder_dir = Path(encoders_dir) / "all-MiniLM-L6-v2"
    real = not quick and (encoder_dir / "config.json").is_file()
    pipe = None
    if real and (Path(minisd_dir) / "minisd.json").is_file():  # loaded first: a model that cannot run is said now
        from .minisd.pipeline import MiniSDPipeline

        pipe = MiniSDPipeline.from_pretrained(minisd_dir, encoders_dir=encoders_dir)
    torch.manual_seed(0)
    capacities, curves = random_key_search(DIMENSIONS if not quick else (16, 32), quick=quick, progress=progress)
    report = MemoryReport(capacities, curves, quick=quick)
    report.long_context = long_context(quick=quick, progress=progress)
    if real:
        from .adapter import generate_prompts
        from .encoders import load_text_encoder
        from .minisd.data import all_captions

        encoder = load_text_encoder(encoder_dir)
        prompts = generate_prompts(1500, seed=1) + all_captions()[::4]
        keys = encoder_keys(encoder, prompts)
        grid = memory_grid(8, min(len(keys), 32768), per_octave=2)
        report.real_keys += real_key_capacity("MiniLM states", keys, grid, progress,
                                              source="all-MiniLM-L6-v2 token states (last layer)")
        if pipe is not None:
            head_keys, where = minisd_keys(pipe, prompts)
            report.real_keys += real_key_capacity("mini SD keys", head_keys, grid, progress,
                                                  source=f"the trained mini SD's {where} keys (to_k of "
                                                         f"{pipe.spec.text_encoder} states)")  # fmt: skip
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
        rows.append([c["phi"], c["d"], f"{c['beta']:.2f}" if c["beta"] else "-", count(c["analytic"]),
                     count(c["analytic_gaussian"]), measured, "-" if lo is None else f"[{count(lo)}, {count(hi)}]",
                     "yes" if holds else "no", ratio, count(c["searched_to"]), count(c["published"])])  # fmt: skip
    out = [format_table(["phi", "d_k", "beta", "analytic", "gaussian approx", "measured", "95 % interval",
                         "analytic in", "meas/an.", "searched to", "published"], rows,
                        title="Capacity M* (SIR = 1) with random unit keys and values (seed 0)")]  # fmt: skip
    out.append(f"Intervals: 95 % bootstrap over the queries of this run (one draw of keys per M): the precision of\n"
               f"the measurement, not the spread between draws. The analytic M* lies inside for {inside} of "
               f"{len(r.capacities)} rows.")  # fmt: skip
    out.append("The published 64 / 128 / ~1.2M at d_k = 64 are d, 2d and exp(2 sqrt(d) - 2) = e^14 (the gaussian\n"
               "approximation); the exact analytic values count the target (+1) and integrate over the sphere.")
    if r.long_context:
        fixed, logn = r.long_context
        rows = [[count(m), f"{fixed.sir[i]:.3g}", f"{fixed.accuracy[i]:.2f}", f"{logn.sir[i]:.3g}",
                 f"{logn.accuracy[i]:.2f}"] for i, m in enumerate(fixed.memories)]  # fmt: skip
        out += ["", format_table(["memories", "SIR fixed", "acc fixed", "SIR LogN", "acc LogN"], rows,
                                 title=f"Long context, softmax, d_k = {fixed.d}: fixed beta = sqrt(d) against "
                                       "beta = sqrt(d) log(M) / log(512)")]  # fmt: skip
    if r.real_keys:
        rows = [[k["phi"], k["keys"], k["d"], count(k["measured"]) + (" (extrap.)" if k["extrapolated"] else ""),
                 count(k["analytic_random"]), f"{k['mean_abs_cosine']:.3f}"] for k in r.real_keys]  # fmt: skip
        out += ["", format_table(["phi", "keys", "d", "measured M*", "random analytic", "mean |cos|"], rows,
                                 title="Real keys (token states) against random keys of the same size")]  # fmt: skip
        sources = {k["keys"].removesuffix(" raw"): k["source"] for k in r.real_keys if k["keys"].endswith(" raw")}
        out += [f"  {name}: {source}" for name, source in sources.items()]
    if r.sd_levels:
        sizes = list(r.sd_levels[0]["cells"])
        rows = [[s["level"], s["head_dim"], count(s["capacity"]), *(count(s["cells"][z]) for z in sizes),
                 f"{s['pixel_over_capacity']:.3g}x", f"{s['passes_capacity_at_side']:,.0f} px"] for s in r.sd_levels]  # fmt: skip
        out += ["", format_table(["SD 1.5 level", "head dim", "capacity", *(f"cells {z}px" for z in sizes),
                                  "pixels / cap.", "passes cap. at"], rows,
                                 title="SD 1.5 self-attention: random-key softmax capacity (beta = sqrt(head dim)) "
                                       "against the cells a query reads")]  # fmt: skip
    peak = f", peak memory {r.peak_memory_bytes / 2**20:,.0f} MiB (the whole process)" if r.peak_memory_bytes else ""
    out.append(f"\n{'quick run; ' if r.quick else ''}finished in {r.seconds:.0f} s{peak}")
    return "\n".join(out)


def plot(r: MemoryReport, path) -> None:
    """Log-log SIR and accuracy against M, one curve per phi (d_k = 64), capacities marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .common import save_figure

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8), dpi=110)
    d = 64 if any(c.d == 64 for c in r.curves) else r.curves[0].d
    for curve, colour in zip([c for c in r.curves if c.d == d], ("C0", "C1", "C2")):
        left.loglog(curve.memories, curve.sir, "o-", color=colour, markersize=3, label=f"{curve.phi}")
        right.semilogx(curve.memories, curve.accuracy, "o-", color=colour, markersize=3, label=curve.phi)
        analytic = analytic_capacity(curve.phi, d)
        left.axvline(analytic, color=colour, ls="--", lw=0.8)
        label = f"{curve.phi} M* = {analytic:,.0f} (analytic)"
        if curve.capacity:
            left.plot([curve.capacity], [1], "*", color=colour, markersize=12)
            label += f"\n  measured {curve.capacity:,.0f}"
        left.text(analytic, 0.02, label, rotation=90, fontsize=7, color=colour, transform=left.get_xaxis_transform(),
                  va="bottom", ha="right")  # fmt: skip
    for curve, style in zip(r.long_context, ("s--", "^:")):
        right.semilogx(curve.memories, curve.accuracy, style, color="grey", markersize=4,
                       label=f"softmax d={curve.d}, {curve.keys.split(', ')[1]}")  # fmt: skip
    left.axhline(1, color="black", lw=0.8)
    left.set(xlabel="memories M", ylabel="signal / interference", title=f"SIR against M (random keys, d_k = {d})")
    right.set(xlabel="memories M", ylabel="retrieval accuracy", title="Is the nearest stored value the target?",
              ylim=(-0.02, 1.02))  # fmt: skip
    for ax in (left, right):
        ax.grid(True, which="both", alpha=0.2)
        ax.legend(fontsize=7)
    save_figure(fig, path)

