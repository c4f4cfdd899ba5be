"""Capacities of a key-value store, analytic and measured (the method: the package docstring)."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

from ..common import SdkitError

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


def streamed(
    phi: str,
    store: Store,
    memories: list[int],
    beta: float,
    queries: int = 256,
    accuracy_queries: int = 64,
    chunk: int = 65536,
    progress=None,
) -> tuple[list[float], list[float], list[torch.Tensor]]:
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


def measure_curve(
    phi: str,
    d: int,
    memories: list[int],
    beta: float | None = None,
    keys: torch.Tensor | None = None,
    key_source: str = "random",
    trials: int = 4,
    queries: int = 256,
    seed: int = 0,
    chunk: int = 65536,
    progress=None,
) -> Curve:
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
        s, a, p = streamed(
            phi, Store(d, seed, keys), large, beta, min(queries, large[0]), chunk=chunk, progress=progress
        )
        sirs, accs, powers = sirs + s, accs + a, powers + p
    dim = d if keys is None else keys.shape[1]
    capacity, extrapolated = crossing(memories, sirs)
    return Curve(
        phi,
        dim,
        beta if phi == "softmax" else None,
        key_source,
        list(memories),
        sirs,
        accs,
        min(queries, large[0]) if large else -1,
        capacity,
        extrapolated,
        capacity_interval(memories, powers, phi, seed=seed) if capacity is not None else None,
    )


def capacity_interval(
    memories: list[int], powers: list[torch.Tensor], phi: str, samples: int = 400, seed: int = 0, level: float = 0.95
) -> list[float] | None:
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
