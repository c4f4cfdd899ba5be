"""Score-table sizes: the latent grid against pixel-level attention, computed and measured.

Self-attention over n cells builds an n x n table of scores per head. SD 1.x attends over a
64x64 latent for a 512x512 image (4,096 cells); a model on pixels would attend over 262,144 cells.
The analytic part reads heads and head sizes from a preset, model folder or checkpoint built on the
meta device (shapes only); the measured
part runs one self-attention three ways (naive, query-chunked, PyTorch SDPA) and records time,
peak memory and agreement.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from .common import SdkitError, available_memory, format_bytes, format_table, peak_rss, synchronize
from .geometry import VAE_FACTOR, halved, image_factor

SWEEP_SCALES = (0.5, 1, 1.5, 2, 4)  # of the requested sides, so the sweep keeps its aspect ratio
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
IMPLEMENTATIONS = ("naive", "chunked", "sdpa")
DEFAULT_CHUNK_BUDGET = 64 * 2**20  # bytes of scores per chunk


@dataclass
class Level:
    """One resolution of the U-Net's self-attention (or the pixel grid)."""

    name: str
    grid: tuple[int, int]
    tokens: int
    heads: int
    head_dim: int
    layers: int  # self-attention layers that run at this resolution
    entries_per_head: int
    bytes_per_head: int
    bytes_all_heads: int  # one layer: heads x effective batch


@dataclass
class ScoreTables:
    height: int
    width: int
    model: str  # a preset's name, or the folder or file the shapes were read from
    dtype: str
    batch: int
    cfg: bool
    levels: list[Level]
    pixel: Level
    cross: list[Level]  # cross-attention per level, then pixels: cells x text tokens
    text_tokens: int
    sweep: list[dict]

    @property
    def effective_batch(self) -> int:
        return self.batch * (2 if self.cfg else 1)

    def to_json(self) -> dict:
        data = asdict(self)
        data["effective_batch"] = self.effective_batch
        finest = self.levels[0]
        data["pixel_over_latent"] = {
            "tokens": self.pixel.tokens / finest.tokens,
            "entries": self.pixel.entries_per_head / finest.entries_per_head,
        }
        return data


def element_size(dtype: str) -> int:
    return torch.empty((), dtype=DTYPES[dtype]).element_size()


def table_bytes(tokens: int, dtype: str, heads: int = 1, batch: int = 1, query_tokens: int | None = None) -> int:
    """Bytes of a materialised score table: batch x heads x query_tokens x tokens elements."""
    return batch * heads * (tokens if query_tokens is None else query_tokens) * tokens * element_size(dtype)


def attention_levels(model) -> tuple[list[dict], int, int | None, int]:
    """Per U-Net depth of a preset, model folder or checkpoint file (built on the meta device):
    heads, head size and how many self- and cross-attention layers run there; the pixels per grid
    cell at the input (8 through SD's VAE, 1 for a pixel-space U-Net); the image side the model was
    made for, when its config says; and the text tokens its cross-attention reads."""
    # Imported here: the CPU measurement children import this module and need only torch.
    from .audit import parameter_level
    from .compute import default_text_tokens, meta_unet
    from .geometry import level_depth, native_image_size

    unet = meta_unet(model)
    config = dict(unet.config)
    by_depth: dict[int, dict] = {}
    for name, module in unet.named_modules():
        if not name.endswith((".attn1", ".attn2")):
            continue
        depth = level_depth(parameter_level(name), len(config["block_out_channels"]))
        entry = by_depth.setdefault(
            depth,
            {
                "depth": depth,
                "heads": module.heads,
                "head_dim": module.inner_dim // module.heads,
                "layers": 0,
                "cross_layers": 0,
            },
        )
        entry["cross_layers" if name.endswith(".attn2") else "layers"] += 1
    levels = [by_depth[d] for d in sorted(by_depth)]
    return levels, image_factor(config), native_image_size(config), default_text_tokens(model, config)


def latent_grid(height: int, width: int, depth: int, factor: int = VAE_FACTOR) -> tuple[int, int]:
    """The grid at a U-Net depth for an image of height x width pixels (factor: pixels per input cell)."""
    return halved(height // factor, width // factor, depth)


def score_tables(
    height: int | None = None,
    width: int | None = None,
    model: str = "sd15",
    dtype: str = "float16",
    batch: int = 1,
    cfg: bool = False,
    text_tokens: int | None = None,
) -> ScoreTables:
    """Exact score-table sizes per self-attention level, for pixels, for cross-attention (cells x
    text tokens), and over a sweep of sizes with the requested aspect ratio. `model`: a preset, a
    diffusers U-Net or pipeline folder, or a checkpoint file (its shapes only: nothing is loaded);
    `height` defaults to the side it was made for (else 512), `text_tokens` to what its tokenizer
    reads (SD's 77 unless the folder says otherwise)."""
    depths, factor, native, tokens = attention_levels(model)
    height = height if height is not None else native or 512
    text_tokens = tokens if text_tokens is None else text_tokens
    width = height if width is None else width
    if dtype not in DTYPES:
        raise SdkitError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if batch < 1:
        raise SdkitError(f"batch must be at least 1, not {batch}")
    if text_tokens < 1:
        raise SdkitError(f"text tokens must be at least 1, not {text_tokens}")
    if not depths:
        raise SdkitError(f"{model} has no self-attention layers")
    if height <= 0 or width <= 0 or height % factor or width % factor:
        raise SdkitError(f"image size {height}x{width}: both sides must be positive multiples of {factor}")
    effective = batch * (2 if cfg else 1)
    grid_name = "latent" if factor > 1 else "grid"

    def level(name, grid, heads, head_dim, layers, keys=None) -> Level:
        tokens = grid[0] * grid[1]
        keys = tokens if keys is None else keys
        per_head = table_bytes(keys, dtype, query_tokens=tokens)
        return Level(name, grid, tokens, heads, head_dim, layers, tokens * keys, per_head, per_head * heads * effective)

    levels, cross = [], []
    for info in depths:
        grid = latent_grid(height, width, info["depth"], factor)
        name = f"{grid_name} {grid[0]}x{grid[1]}"
        levels.append(level(name, grid, info["heads"], info["head_dim"], info["layers"]))
        if info["cross_layers"]:
            cross.append(level(name, grid, info["heads"], info["head_dim"], info["cross_layers"], text_tokens))
    finest = levels[0]
    pixel = level(f"pixel {height}x{width}", (height, width), finest.heads, finest.head_dim, 0)
    if cross:
        cross.append(level(pixel.name, pixel.grid, finest.heads, finest.head_dim, 0, text_tokens))

    sweep = []
    finest_depth = depths[0]["depth"]
    requested = finest.tokens
    for scale in SWEEP_SCALES:
        h, w = (max(factor, round(side * scale / factor) * factor) for side in (height, width))
        tokens = math.prod(latent_grid(h, w, finest_depth, factor))
        sweep.append(
            {
                "scale": scale,
                "height": h,
                "width": w,
                "tokens": tokens,
                "entries_per_head": tokens**2,
                "bytes_per_head": table_bytes(tokens, dtype),
                "pixel_tokens": h * w,
                "pixel_bytes_per_head": table_bytes(h * w, dtype),
                "cells_vs_requested": tokens / requested,
                "table_vs_requested": tokens**2 / requested**2,
            }
        )
    return ScoreTables(height, width, str(model), dtype, batch, cfg, levels, pixel, cross, text_tokens, sweep)


def format_score_tables(t: ScoreTables) -> str:
    rows = [
        [
            lv.name,
            lv.tokens,
            lv.heads,
            lv.head_dim,
            lv.layers or "-",
            lv.entries_per_head,
            format_bytes(lv.bytes_per_head),
            format_bytes(lv.bytes_all_heads),
        ]
        for lv in [*t.levels, t.pixel]
    ]
    batch = f"batch {t.batch}" + (" x2 for classifier-free guidance" if t.cfg else "")
    out = [
        format_table(
            ["level", "tokens", "heads", "head dim", "layers", "scores per head", "per head", "all heads"],
            rows,
            title=f"Self-attention score tables for a {t.height}x{t.width} image ({t.model}, {t.dtype}, {batch};\n"
            f"one layer; 'all heads' = heads x batch)",
        )
    ]
    finest = t.levels[0]
    out.append(
        f"\nPixel level vs the finest attention level: {t.pixel.tokens / finest.tokens:,.0f}x the cells, "
        f"{t.pixel.entries_per_head / finest.entries_per_head:,.0f}x the scores per head "
        f"({t.pixel.entries_per_head:,} vs {finest.entries_per_head:,})."
    )
    if t.cross:
        rows = [
            [
                lv.name,
                lv.tokens,
                t.text_tokens,
                lv.heads,
                lv.layers or "-",
                lv.entries_per_head,
                format_bytes(lv.bytes_per_head),
                format_bytes(lv.bytes_all_heads),
            ]
            for lv in t.cross
        ]
        out.append(
            "\n"
            + format_table(
                ["level", "cells", "text tokens", "heads", "layers", "scores per head", "per head", "all heads"],
                rows,
                title=f"Cross-attention score tables (cells x {t.text_tokens} text tokens: linear in the cells,\nso "
                f"the pixel level costs {t.cross[-1].tokens // t.cross[0].tokens:,}x the latent, not "
                f"{t.pixel.entries_per_head // finest.entries_per_head:,}x)",
            )
        )
    rows = [
        [
            f"{s['height']}x{s['width']}",
            f"{s['scale']:g}x",
            s["tokens"],
            s["entries_per_head"],
            format_bytes(s["bytes_per_head"]),
            f"{s['cells_vs_requested']:g}x",
            f"{s['table_vs_requested']:g}x",
            format_bytes(s["pixel_bytes_per_head"]),
        ]
        for s in t.sweep
    ]
    out.append(
        "\n"
        + format_table(
            ["image", "sides", "tokens", "scores per head", "per head", "cells", "table", "pixel per head"],
            rows,
            title=f"Size sweep at the requested aspect ratio (finest self-attention level; 'cells' and 'table' against "
            f"{t.height}x{t.width}:\ndoubling the sides gives 4x the cells and 16x the table)",
        )
    )
    return "\n".join(out)


# --- the three implementations ----------------------------------------------------------------


def attention_scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The score table softmax(q k^T / sqrt(d)) for q, k of shape (..., tokens, head_dim).

    Softmax is done in place, so exactly one table of q.shape[-2] x k.shape[-2] per head exists.
    """
    scores = q @ k.transpose(-1, -2)
    scores.mul_(q.shape[-1] ** -0.5)
    scores.sub_(scores.amax(dim=-1, keepdim=True))
    scores.exp_()
    scores.div_(scores.sum(dim=-1, keepdim=True))
    return scores


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return attention_scores(q, k) @ v


def chunk_rows(tokens: int, heads: int, dtype: str, budget_bytes: int) -> int:
    """Query rows per chunk so that one chunk's scores fit in budget_bytes."""
    return max(1, min(tokens, budget_bytes // table_bytes(tokens, dtype, heads=heads, query_tokens=1)))


def chunked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: int) -> torch.Tensor:
    """Attention over blocks of query rows: each row's softmax only needs its own scores."""
    out = torch.empty_like(q)
    for start in range(0, q.shape[-2], rows):
        out[..., start : start + rows, :] = attention_scores(q[..., start : start + rows, :], k) @ v
    return out


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v)


def run_implementation(name: str, q, k, v, rows: int) -> torch.Tensor:
    if name == "naive":
        return naive_attention(q, k, v)
    if name == "chunked":
        return chunked_attention(q, k, v, rows)
    if name == "sdpa":
        return sdpa_attention(q, k, v)
    raise ValueError(f"unknown implementation {name!r}")


def sdpa_backend(q, k, v) -> str:
    """The kernel scaled_dot_product_attention picks for these inputs (flash, efficient, math, ...).

    torch._fused_sdp_choice is the function SDPA's own dispatch calls to choose.
    """
    from torch.nn.attention import SDPBackend

    return SDPBackend(torch._fused_sdp_choice(q, k, v)).name.lower()


# --- measuring ----------------------------------------------------------------------------------


@dataclass
class Measurement:
    implementation: str
    tokens: int
    heads: int
    head_dim: int
    dtype: str
    device: str
    predicted_bytes: int  # peak above the baseline: inputs, output and the largest score block
    peak_bytes: int | None = None
    median_seconds: float | None = None
    max_rel_diff: float | None = None  # against the reference (naive when it ran); see relative_difference
    reference: bool = False  # the output the others are compared with
    chunk_rows: int | None = None
    backend: str | None = None
    skipped: str | None = None
    memory_method: str = ""


def relative_difference(out: torch.Tensor, reference: torch.Tensor) -> float:
    """max |out - reference| / max |reference|: rounding-sized when two attentions agree."""
    return float((out.float() - reference.float()).abs().max() / reference.float().abs().max())


def largest_naive_tokens(heads: int, head_dim: int, dtype: str, available: int, multiple: int = 1024) -> int:
    """The most tokens (a multiple of `multiple`) whose naive attention fits in `available` bytes."""
    low, high = 0, 1
    fits = lambda n: predicted_peak("naive", n * multiple, heads, head_dim, dtype, n * multiple) <= available  # noqa: E731
    while fits(high):
        low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low * multiple


def predicted_peak(implementation: str, tokens: int, heads: int, head_dim: int, dtype: str, rows: int) -> int:
    """Bytes an implementation holds at its peak: q, k, v and output, plus its score blocks.

    SDPA's fused kernels keep O(tokens) statistics, not a table; we count only its tensors.
    """
    tensors = 4 * heads * tokens * head_dim * element_size(dtype)
    if implementation == "naive":
        return tensors + table_bytes(tokens, dtype, heads=heads)
    if implementation == "chunked":
        return tensors + table_bytes(tokens, dtype, heads=heads, query_tokens=rows)
    return tensors


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SdkitError(f"device {device!r} asked for, but this machine has no CUDA device")
    if device != "cpu" and not device.startswith("cuda"):
        raise SdkitError(f"unknown device {device!r}; use auto, cpu or cuda")
    return device


def free_bytes(device: str) -> int:
    if device.startswith("cuda"):
        return torch.cuda.mem_get_info(torch.device(device))[0]
    return available_memory()


def _inputs(tokens: int, heads: int, head_dim: int, dtype: str, device: str, seed: int = 0):
    generator = torch.Generator(device="cpu").manual_seed(seed)
    qkv = [
        torch.randn(1, heads, tokens, head_dim, generator=generator).to(device=device, dtype=DTYPES[dtype])
        for _ in range(3)
    ]
    return qkv


def _measure_here(
    implementation: str, tokens: int, heads: int, head_dim: int, dtype: str, device: str, rows: int, repeats: int
) -> tuple[torch.Tensor, int, float]:
    """Run one implementation in this process: (output, peak bytes above baseline, median seconds).

    On CUDA the peak comes from the caching allocator's statistics; on the CPU it is the peak
    resident set above the one before the inputs were made (see common.peak_rss), so inputs and
    output count as the prediction counts them.
    """

    # Libraries set up thread pools, workspaces and scratch buffers on first use; do that at a
    # small size first, so the peak is the attention's own.
    warm = _inputs(min(tokens, 64), heads, head_dim, dtype, device)
    run_implementation(implementation, *warm, rows)
    del warm

    def first_run():
        q, k, v = _inputs(tokens, heads, head_dim, dtype, device)
        out = run_implementation(implementation, q, k, v, rows)
        synchronize(device)
        return q, k, v, out

    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        baseline = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        q, k, v, out = first_run()
        peak = torch.cuda.max_memory_allocated(device) - baseline
    else:
        (q, k, v, out), peak = peak_rss(first_run)
    times = []
    for _ in range(repeats):
        del out
        start = time.perf_counter()
        out = run_implementation(implementation, q, k, v, rows)
        synchronize(device)
        times.append(time.perf_counter() - start)
    return out, peak, statistics.median(times)


def _measure_in_child(args: dict, out_path: str) -> dict:
    """Measure on the CPU in a fresh interpreter, so the peak RSS is this run's alone."""
    code = "import sys, json; from sdkit.scoretable import _child; _child(json.loads(sys.argv[1]), sys.argv[2])"
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(args), out_path], capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
        raise SdkitError(f"measuring {args['implementation']} at {args['tokens']:,} tokens failed: {tail}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _child(args: dict, out_path: str) -> None:
    from safetensors.torch import save_file

    out, peak, seconds = _measure_here(**args)
    save_file({"out": out.float().cpu().contiguous()}, out_path)
    print(json.dumps({"peak": peak, "seconds": seconds}))


def measure(
    tokens: int,
    heads: int = 1,
    head_dim: int = 40,
    dtype: str = "float32",
    device: str = "auto",
    implementations=IMPLEMENTATIONS,
    chunk_budget: int = DEFAULT_CHUNK_BUDGET,
    budget: int | None = None,
    repeats: int = 3,
    progress=None,
) -> list[Measurement]:
    """Measure each implementation of one self-attention at `tokens` cells.

    Implementations whose predicted peak exceeds the free memory (or `budget`) are skipped with a
    reason, never run into an out-of-memory kill. Differences are against naive when it ran,
    else against the first implementation that ran.
    """
    device = resolve_device(device)
    if dtype not in DTYPES:
        raise SdkitError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    unknown = set(implementations) - set(IMPLEMENTATIONS)
    if unknown:
        raise SdkitError(f"unknown implementation {sorted(unknown)[0]!r}; choose from {', '.join(IMPLEMENTATIONS)}")
    for name, value in (("tokens", tokens), ("heads", heads), ("head_dim", head_dim), ("repeats", repeats)):
        if value <= 0:
            raise SdkitError(f"{name} must be positive, not {value}")
    # Naive first when asked for: it is the reference every other result is compared with.
    implementations = sorted(implementations, key=lambda name: name != "naive")
    rows = chunk_rows(tokens, heads, dtype, chunk_budget)
    cuda = device.startswith("cuda")
    method = (
        "CUDA caching allocator: max_memory_allocated above the baseline"
        if cuda
        else "peak resident set (VmHWM) of a fresh child process above its resident set before the inputs"
    )
    results, reference = [], None
    with tempfile.TemporaryDirectory(prefix="sdkit-scoretable-") as tmp:
        for name in implementations:
            m = Measurement(
                name,
                tokens,
                heads,
                head_dim,
                dtype,
                device,
                predicted_peak(name, tokens, heads, head_dim, dtype, rows),
                chunk_rows=rows if name == "chunked" else None,
                memory_method=method,
            )
            available = free_bytes(device) if budget is None else budget
            if m.predicted_bytes > available:
                where = (
                    f"this device has {format_bytes(available)} free"
                    if budget is None
                    else f"the budget is {format_bytes(available)}"
                )
                m.skipped = (
                    f"{name} attention at {tokens:,} tokens needs {format_bytes(m.predicted_bytes)} for "
                    f"{heads} {dtype} head{'s' if heads > 1 else ''}; {where}"
                )
                results.append(m)
                if progress:
                    progress.update(1)
                continue
            args = dict(
                implementation=name,
                tokens=tokens,
                heads=heads,
                head_dim=head_dim,
                dtype=dtype,
                device=device,
                rows=rows,
                repeats=repeats,
            )
            if cuda:
                try:
                    out, m.peak_bytes, m.median_seconds = _measure_here(**args)
                except torch.cuda.OutOfMemoryError:
                    torch.cuda.empty_cache()
                    m.skipped = f"{name} attention at {tokens:,} tokens ran out of CUDA memory despite the preflight"
                    results.append(m)
                    continue
                out = out.float().cpu()
            else:
                path = os.path.join(tmp, f"{name}.safetensors")
                got = _measure_in_child(args, path)
                m.peak_bytes, m.median_seconds = got["peak"], got["seconds"]
                from safetensors.torch import load_file

                out = load_file(path)["out"]
            if name == "sdpa":
                q, k, v = _inputs(min(tokens, 256), heads, head_dim, dtype, device)  # same kernel choice, cheap
                m.backend = sdpa_backend(q, k, v)
            if reference is None:
                reference, m.reference = out, True
            else:
                m.max_rel_diff = relative_difference(out, reference)
            del out
            results.append(m)
            if progress:
                progress.update(1)
    return results


def format_measurements(ms: list[Measurement]) -> str:
    rows = []
    for m in ms:
        if m.skipped:
            rows.append([m.implementation, m.tokens, format_bytes(m.predicted_bytes), "skipped", "-", "-", "-"])
            continue
        ratio = m.peak_bytes / m.predicted_bytes if m.predicted_bytes else math.nan
        rows.append(
            [
                m.implementation + (f" ({m.chunk_rows} rows)" if m.chunk_rows else ""),
                m.tokens,
                format_bytes(m.predicted_bytes),
                format_bytes(m.peak_bytes),
                f"{ratio:.2f}",
                f"{m.median_seconds * 1e3:.1f}",
                "reference" if m.reference else f"{m.max_rel_diff:.1e}",
            ]
        )
    first = ms[0]
    title = (
        f"Measured: one self-attention, {first.heads} head{'s' if first.heads > 1 else ''} of {first.head_dim}, "
        f"{first.dtype}, on {first.device}"
    )
    out = [
        format_table(
            ["implementation", "tokens", "predicted", "peak", "peak/pred", "median ms", "rel diff"], rows, title=title
        )
    ]
    out += [f"  skipped: {m.skipped}" for m in ms if m.skipped]
    out += [f"  sdpa ran {m.backend}" for m in ms if m.backend]
    out.append(f"  peak memory: {first.memory_method}")
    return "\n".join(out)


def plot(
    tables: ScoreTables,
    measurements: list[Measurement],
    path: str | os.PathLike,
    chunk_budget: int = DEFAULT_CHUNK_BUDGET,
) -> None:
    """Tokens against bytes, log-log: analytic lines, measured points on them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .common import save_figure

    tokens = [2**e for e in range(8, 19)]
    fig, ax = plt.subplots(figsize=(7, 5), dpi=120)
    ax.loglog(
        tokens,
        [table_bytes(n, tables.dtype) for n in tokens],
        color="black",
        label=f"score table, one {tables.dtype} head",
    )
    ran = [m for m in measurements if m.peak_bytes is not None]
    if measurements:
        m0 = measurements[0]
        for (name, marker), color in zip((("naive", "o"), ("chunked", "s"), ("sdpa", "^")), ("C0", "C1", "C2")):
            rows = [chunk_rows(n, m0.heads, m0.dtype, chunk_budget) for n in tokens]
            ys = [predicted_peak(name, n, m0.heads, m0.head_dim, m0.dtype, r) for n, r in zip(tokens, rows)]
            ax.loglog(
                tokens,
                ys,
                "--",
                color=color,
                alpha=0.7,
                label=f"{name}: predicted peak ({m0.heads}x{m0.head_dim}, {m0.dtype})",
            )
            pts = [(m.tokens, m.peak_bytes) for m in ran if m.implementation == name]
            if pts:
                ax.loglog(*zip(*pts), marker, color=color, markersize=8, label=f"{name}: measured on {m0.device}")
    for level, label in ((tables.levels[0], "latent"), (tables.pixel, "pixel")):
        ax.axvline(level.tokens, color="grey", lw=0.8)
        ax.text(
            level.tokens,
            0.02,
            f" {label} {level.grid[0]}x{level.grid[1]}",
            rotation=90,
            fontsize=8,
            color="grey",
            transform=ax.get_xaxis_transform(),
            va="bottom",
            ha="right",
        )
        table = table_bytes(level.tokens, tables.dtype)
        ax.annotate(
            f"{format_bytes(table)}",
            (level.tokens, table),
            textcoords="offset points",
            xytext=(6, -12),
            fontsize=9,
            fontweight="bold",
        )
        ax.plot([level.tokens], [table], "k*", markersize=9)
    ax.set_xlabel("tokens (cells attended over)")
    ax.set_ylabel("bytes")
    ax.set_title(f"Self-attention memory against tokens ({tables.height}x{tables.width} image)")
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.2)
    save_figure(fig, path)
