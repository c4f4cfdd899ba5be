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

    capacity.py  the analytic capacities, the key-value store and the SIR measurement
    study.py     what `sdkit memory` runs (random and real keys, long contexts, SD's levels), its report
"""

from .capacity import (
    BLOCK,
    DIMENSIONS,
    EXHAUSTIVE_LIMIT,
    PHIS,
    PUBLISHED,
    Curve,
    Store,
    analytic_capacity,
    capacity_interval,
    cosine_moment,
    crossing,
    default_beta,
    exhaustive,
    measure_curve,
    memory_grid,
    signal,
    streamed,
    weights,
)
from .study import (
    MemoryReport,
    encoder_keys,
    format_report,
    long_context,
    minisd_keys,
    peak_resident_bytes,
    plot,
    random_key_search,
    real_key_capacity,
    run,
    sd_levels,
)

__all__ = [
    "BLOCK",
    "DIMENSIONS",
    "EXHAUSTIVE_LIMIT",
    "PHIS",
    "PUBLISHED",
    "Curve",
    "MemoryReport",
    "Store",
    "analytic_capacity",
    "capacity_interval",
    "cosine_moment",
    "crossing",
    "default_beta",
    "encoder_keys",
    "exhaustive",
    "format_report",
    "long_context",
    "measure_curve",
    "memory_grid",
    "minisd_keys",
    "peak_resident_bytes",
    "plot",
    "random_key_search",
    "real_key_capacity",
    "run",
    "sd_levels",
    "signal",
    "streamed",
    "weights",
]
