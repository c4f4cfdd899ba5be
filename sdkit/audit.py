"""Where a U-Net's parameters live: every parameter gets exactly one role.

Counting works on an index of names and shapes (see loading.py), so a preset on the meta device,
a loaded module and a .safetensors header are counted by the same code.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import asdict, dataclass, field

from .checkpoints import CheckpointIndex, index_checkpoint
from .common import SdkitError, format_bytes, format_table
from .geometry import halved, image_factor, level_depth, native_image_size
from .safetensors_header import TensorInfo

ROLES = (
    "self_attention",
    "cross_attention.query",
    "cross_attention.key_value",
    "cross_attention.output",
    "mlp",
    "norm",
    "proj",
    "resnet",
    "time_embedding",
    "sampler",
    "io",
    "other",
)
CROSS_ATTENTION_ROLES = ROLES[1:4]
IMAGE_SIZE = 512  # the image side for the per-level grid when the model does not say its own

_CROSS = {
    "to_q": "cross_attention.query",
    "to_k": "cross_attention.key_value",
    "to_v": "cross_attention.key_value",
    "to_out": "cross_attention.output",
}
_CROSS_PART = re.compile(r"\.attn2\.(to_q|to_k|to_v|to_out)\.")
_NORM = re.compile(r"\.norm\d?\.")
_KEY_VALUE = re.compile(r"\.attn2\.to_[kv]\.weight$")


def parameter_role(name: str) -> str:
    """The role of one U-Net parameter, from its diffusers name."""
    if ".attentions." in name:
        if ".attn1." in name:
            return "self_attention"
        if m := _CROSS_PART.search(name):
            return _CROSS[m.group(1)]
        if ".ff." in name:
            return "mlp"
        if ".proj_in." in name or ".proj_out." in name:
            return "proj"
        if _NORM.search(name):
            return "norm"
        return "other"
    if ".resnets." in name:
        return "resnet"
    if ".downsamplers." in name or ".upsamplers." in name:
        return "sampler"
    if name.startswith(("time_embedding.", "add_embedding.", "class_embedding.")):
        return "time_embedding"
    if name.startswith(("conv_in.", "conv_norm_out.", "conv_out.")):
        return "io"
    return "other"


def parameter_level(name: str) -> str:
    """down.i, mid, up.i, or stem for what sits outside the blocks (conv_in/out, time embedding)."""
    block, _, rest = name.partition(".")
    if block in ("down_blocks", "up_blocks"):
        index = rest.partition(".")[0]
        return f"{block[:-7]}.{index}" if index.isdigit() else "other"
    return "mid" if block == "mid_block" else "stem"


@dataclass
class Audit:
    source: str
    layout: str
    total: int
    roles: dict[str, int]
    attention_blocks: dict
    levels: list[dict]
    image_size: int  # the image side the per-level grid sides are for
    grid_factor: int  # image pixels per input grid cell: 8 through SD's VAE, 1 for a pixel-space U-Net
    components: dict[str, dict] = field(default_factory=dict)
    bytes_read: int | None = None  # of the checkpoint, when counted from its header
    text_width_swap: dict | None = None

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class _Entry:
    name: str
    role: str
    level: str
    numel: int


def _classify(unet: dict[str, TensorInfo]) -> list[_Entry]:
    return [_Entry(n, parameter_role(n), parameter_level(n), info.numel) for n, info in unet.items()]


def _sum_roles(entries) -> dict[str, int]:
    roles = dict.fromkeys(ROLES, 0)
    for e in entries:
        roles[e.role] += e.numel
    return roles


def _attention_blocks(entries: list[_Entry]) -> dict:
    """The Transformer2D view: what share of the "attention blocks" is attention."""
    inside = [e for e in entries if ".attentions." in e.name]
    blocks = {e.name.split(".attentions.")[0] + "." + e.name.split(".attentions.")[1].split(".")[0] for e in inside}
    roles = _sum_roles(inside)
    total = sum(roles.values())
    return {
        "count": len(blocks),
        "total": total,
        "mlp": roles["mlp"],
        "self_attention": roles["self_attention"],
        "cross_attention": sum(roles[r] for r in CROSS_ATTENTION_ROLES),
        "cross_attention_query": roles["cross_attention.query"],
        "cross_attention_key_value": roles["cross_attention.key_value"],
        "cross_attention_output": roles["cross_attention.output"],
        "norm": roles["norm"],
        "proj": roles["proj"],
        "mlp_share": roles["mlp"] / total if total else 0.0,
    }


def _levels(entries: list[_Entry], image_size: int, factor: int) -> list[dict]:
    by_level: dict[str, list[_Entry]] = {}
    for e in entries:
        by_level.setdefault(e.level, []).append(e)
    index = lambda level: int(level.split(".")[1])  # noqa: E731
    downs = sorted((k for k in by_level if k.startswith("down.")), key=index)
    ups = sorted((k for k in by_level if k.startswith("up.")), key=index)
    levels = 1 + max((index(k) for k in downs + ups), default=0)
    side = image_size // factor
    rows = []
    for level in ["stem", *downs, "mid", *ups, "other"]:
        if level not in by_level:
            continue
        roles = _sum_roles(by_level[level])
        depth = None if level == "other" else max(0, level_depth(level, levels))
        rows.append(
            {
                "name": level,
                "latent_side": None if depth is None else halved(side, side, depth)[0],
                "total": sum(roles.values()),
                "roles": roles,
            }
        )
    return rows


def text_width_swap(unet: dict[str, TensorInfo], new_width: int) -> dict:
    """What reading a text encoder of another width costs inside the U-Net, beside an adapter.

    Only attn2's to_k and to_v read the text states, so only they change shape.
    """
    changed = []
    for name, info in unet.items():
        if _KEY_VALUE.search(name):
            changed.append({"name": name, "old_shape": list(info.shape), "new_shape": [info.shape[0], new_width]})
    if not changed:
        raise SdkitError("this U-Net has no cross-attention: no text width to change")
    old_widths = {c["old_shape"][1] for c in changed}
    if len(old_widths) != 1:
        raise SdkitError(f"this U-Net reads several text widths {sorted(old_widths)}")
    (old_width,) = old_widths
    change = sum(c["new_shape"][0] * (new_width - old_width) for c in changed)
    total = sum(info.numel for info in unet.values())
    return {
        "old_width": old_width,
        "new_width": new_width,
        "changed_tensors": len(changed),
        "changed": changed,
        "parameter_change": change,
        "total_before": total,
        "total_after": total + change,
        # A linear map new -> old (weight and bias) in front of the unchanged U-Net.
        "linear_adapter_parameters": new_width * old_width + old_width,
    }


def audit_index(index: CheckpointIndex, context_dim: int | None = None, image_size: int | None = None) -> Audit:
    """Count by role. image_size (the side for the per-level grid) defaults to the model's native
    one when its config says it (SD 1.5: 512, SD 2.1: 768, SDXL: 1024), else 512."""
    for name, value in (("context_dim", context_dim), ("image_size", image_size)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise SdkitError(f"{name} must be a whole number of at least 1 (or None), not {value!r}")
    unet = index.unet
    empty = next((name for name, info in unet.items() if info.numel == 0), None)
    if empty is not None:
        raise SdkitError(
            f"{index.source}: U-Net tensor {empty} has shape {list(unet[empty].shape)}, no elements; a "
            "U-Net's tensors are never empty"
        )
    for name, info in unet.items():  # the tensors whose sizes are read below must have their rank
        rank = 4 if name == "conv_in.weight" else 2 if _KEY_VALUE.search(name) else None
        if rank is not None and len(info.shape) != rank:
            raise SdkitError(
                f"{index.source}: {name} has shape {list(info.shape)}, not the {rank}-D weight a U-Net has there"
            )
    config = index.config or {"in_channels": next((i.shape[1] for n, i in unet.items() if n == "conv_in.weight"), 4)}
    factor = image_factor(config)
    image_size = image_size if image_size is not None else native_image_size(config) or IMAGE_SIZE
    if image_size % factor:  # as scoretable: a latent U-Net sees the image through the VAE's 8-pixel cells
        raise SdkitError(f"image size {image_size} is not a multiple of {factor} (the pixels of one latent cell)")
    entries = _classify(unet)
    roles = _sum_roles(entries)
    components = {}
    if index.kind != "preset":
        for name, tensors in sorted(index.components.items()):
            dtypes = Counter()
            for info in tensors.values():
                dtypes[info.dtype] += info.numel
            components[name] = {
                "params": sum(info.numel for info in tensors.values()),
                "bytes": sum(info.nbytes for info in tensors.values()),
                "dtypes": dict(dtypes),
            }
    return Audit(
        source=index.source,
        layout=index.layout if index.kind != "preset" else "preset (meta device)",
        total=sum(roles.values()),
        roles=roles,
        attention_blocks=_attention_blocks(entries),
        levels=_levels(entries, image_size, factor),
        image_size=image_size,
        grid_factor=factor,
        components=components,
        bytes_read=index.bytes_read if index.kind != "preset" else None,
        text_width_swap=text_width_swap(unet, context_dim) if context_dim is not None else None,
    )


def audit(spec, allow_pickle: bool = False, context_dim: int | None = None, image_size: int | None = None) -> Audit:
    """Audit a preset, a diffusers folder or a checkpoint file (from its header when .safetensors)."""
    return audit_index(index_checkpoint(spec, allow_pickle), context_dim, image_size)


def audit_module(model, source: str = "module", context_dim: int | None = None) -> Audit:
    """Audit a U-Net module (torch.nn.Module) as it is, or a diffusers pipeline (such as a
    StableDiffusionPipeline): its U-Net by role, and each of its modules (VAE, text encoder, ...)
    counted in the components table."""
    import torch

    from .tensors import module_index

    if isinstance(getattr(model, "components", None), dict) and hasattr(model, "unet"):
        components = {
            name: module_index(part)
            for name, part in model.components.items()
            if isinstance(part, torch.nn.Module) and name != "unet"
        }
        unet = model.unet
    else:
        components, unet = {}, model
    index = CheckpointIndex(
        source,
        "module",
        "diffusers",
        {"unet": module_index(unet), **components},
        config=dict(getattr(unet, "config", {})),
    )
    return audit_index(index, context_dim)


_SHORT = {
    "self_attention": "self-attn",
    "cross_attention.query": "cross q",
    "cross_attention.key_value": "cross k/v",
    "cross_attention.output": "cross out",
    "time_embedding": "time emb",
}


def format_audit(a: Audit) -> str:
    pct = lambda n, d: f"{100 * n / d:.1f} %" if d else "-"  # noqa: E731
    out = [f"{a.source} [{a.layout}]: {a.total:,} U-Net parameters"]
    if a.bytes_read is not None:
        out[0] += f" (counted from {format_bytes(a.bytes_read)} of header, no tensor data read)"
    out.append("")
    out.append(format_table(["role", "params", "share"], [[r, n, pct(n, a.total)] for r, n in a.roles.items() if n]))
    b = a.attention_blocks
    out += [
        "",
        f"{b['count']} attention (Transformer2D) blocks hold {b['total']:,} ({pct(b['total'], a.total)} of the U-Net):",
    ]
    rows = [
        ["mlp (feed-forward)", b["mlp"], pct(b["mlp"], b["total"])],
        ["self-attention", b["self_attention"], pct(b["self_attention"], b["total"])],
        ["cross-attention", b["cross_attention"], pct(b["cross_attention"], b["total"])],
        ["  query", b["cross_attention_query"], pct(b["cross_attention_query"], b["total"])],
        ["  key/value (text)", b["cross_attention_key_value"], pct(b["cross_attention_key_value"], b["total"])],
        ["  output", b["cross_attention_output"], pct(b["cross_attention_output"], b["total"])],
        ["norm", b["norm"], pct(b["norm"], b["total"])],
        ["proj_in/proj_out", b["proj"], pct(b["proj"], b["total"])],
    ]
    out.append(format_table(["part", "params", "of blocks"], rows))
    used = [r for r in ROLES if any(level["roles"][r] for level in a.levels)]
    # Two tables of at most seven roles each, so that lines stay within 120 columns.
    halves = [[r for r in used if r in ROLES[:7]], [r for r in used if r not in ROLES[:7]]]
    for part, roles in zip(("attention blocks", "the rest"), halves):
        if not roles:
            continue
        rows = [
            [lv["name"], lv["latent_side"], *(lv["roles"][r] for r in roles), sum(lv["roles"][r] for r in roles)]
            for lv in a.levels
        ]
        rows.append(["total", "", *(a.roles[r] for r in roles), sum(a.roles[r] for r in roles)])
        title = (
            f"Per level, {part} (side: {'latent' if a.grid_factor > 1 else 'grid'} cells per side at "
            f"{a.image_size}x{a.image_size} px)"
        )
        out += ["", format_table(["level", "side", *(_SHORT.get(r, r) for r in roles), "sum"], rows, title=title)]
    if a.components:
        rows = [
            [c, v["params"], ", ".join(sorted(v["dtypes"])), format_bytes(v["bytes"])] for c, v in a.components.items()
        ]
        out += ["", format_table(["component", "params", "dtype", "bytes"], rows)]
    if s := a.text_width_swap:
        groups = Counter(
            (c["name"].rsplit(".", 2)[-2], tuple(c["old_shape"]), tuple(c["new_shape"])) for c in s["changed"]
        )
        rows = [
            [f"attn2.{t}", list(old), list(new), n, n * new[0] * (new[1] - old[1])]
            for (t, old, new), n in groups.items()
        ]
        rows.append(["total", "", "", s["changed_tensors"], s["parameter_change"]])
        title = (
            f"Text width {s['old_width']} -> {s['new_width']}: the U-Net goes from {s['total_before']:,} to "
            f"{s['total_after']:,} parameters\n({s['parameter_change']:+,}), only in these tensors:"
        )
        out += ["", format_table(["tensor", "old shape", "new shape", "count", "change"], rows, title=title)]
        out.append(
            f"Or keep the U-Net as it is and put a linear adapter {s['new_width']} -> {s['old_width']} in front:\n"
            f"{s['linear_adapter_parameters']:,} parameters (trained, see `sdkit adapter`)."
        )
    return "\n".join(out)


# --- the paper table -------------------------------------------------------------------------------------------

PAPER_COLUMNS = (
    "model",
    "image px",
    "U-Net params",
    "blocks",
    "in blocks",
    "% of U-Net",
    "MLP",
    "self-attn",
    "cross-attn",
    "norm",
    "proj",
    "MLP share",
)


def paper_rows(audits: list[Audit]) -> list[list]:
    """One row per model: the Transformer2D blocks' parameters by part. The parts (MLP, self- and
    cross-attention, norm, proj_in/out) add up to 'in blocks'; 'image px' is the side the model was
    made for."""
    rows = []
    for a in audits:
        b = a.attention_blocks
        rows.append(
            [
                a.source,
                a.image_size,
                a.total,
                b["count"],
                b["total"],
                100 * b["total"] / a.total,
                b["mlp"],
                b["self_attention"],
                b["cross_attention"],
                b["norm"],
                b["proj"],
                100 * b["mlp_share"],
            ]
        )
    return rows


def paper_table(audits: list[Audit], fmt: str = "markdown") -> str:
    """The table as Markdown, CSV or LaTeX (booktabs)."""
    rows = paper_rows(audits)

    def text(value, latex: bool = False) -> str:
        if isinstance(value, float):
            return f"{value:.1f}" + (r"\%" if latex else " %")
        if isinstance(value, int):
            return f"{value:,}" if not latex else f"{value:,}".replace(",", "{,}")
        return str(value).replace("_", r"\_") if latex else str(value)

    if fmt == "csv":
        import csv
        import io

        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerow(PAPER_COLUMNS)
        writer.writerows([[f"{v:.2f}" if isinstance(v, float) else v for v in row] for row in rows])
        return buffer.getvalue()
    if fmt == "latex":
        lines = [
            r"\begin{tabular}{l" + "r" * (len(PAPER_COLUMNS) - 1) + "}",
            r"\toprule",
            " & ".join(c.replace("%", r"\%") for c in PAPER_COLUMNS) + r" \\",
            r"\midrule",
        ]
        lines += [" & ".join(text(v, latex=True) for v in row) + r" \\" for row in rows]
        lines += [r"\bottomrule", r"\end{tabular}"]
        return "\n".join(lines) + "\n"
    if fmt != "markdown":
        raise SdkitError(f"unknown table format {fmt!r}; choose markdown, csv or latex")
    lines = ["| " + " | ".join(PAPER_COLUMNS) + " |", "|---" + "|---:" * (len(PAPER_COLUMNS) - 1) + "|"]
    lines += ["| " + " | ".join(text(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"
