"""What one U-Net forward pass costs: multiply-accumulate FLOPs by role and level, and the bytes each
level's attention holds, analytic from the config (a meta-device module: shapes, no weights).

Parameters do not grow with the image; attention's work does. Every convolution and linear layer
is counted at the grid its level works on (2 x MACs, as torch's FlopCounterMode counts), and every
attention adds its two products, Q K^T and the weights times V (2 x cells x keys x width each:
keys are the cells for self-attention and the text tokens for cross-attention). Not counted, as
FlopCounterMode does not count them either: norms, softmax, activations, additions, upsampling.

    c = compute("sd15", height=512, width=512)
    c.total, c.roles["self_attention.products"], c.levels[0]
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .audit import parameter_level, parameter_role
from .common import SdkitError, format_bytes, format_table
from .geometry import halved, image_factor, level_depth, native_image_size

ROLES = (
    "self_attention.projections",
    "self_attention.products",
    "cross_attention.query",
    "cross_attention.key_value",
    "cross_attention.output",
    "cross_attention.products",
    "mlp",
    "proj",
    "resnet",
    "time_embedding",
    "sampler",
    "io",
    "other",
)
ATTENTION_ROLES = ROLES[:6]
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass
class Compute:
    source: str
    height: int
    width: int
    batch: int  # U-Net batch (doubled with classifier-free guidance)
    text_tokens: int
    dtype: str
    total: int  # FLOPs (2 x multiply-accumulates) of one forward pass
    roles: dict[str, int]
    levels: list[dict]  # per level: grid, FLOPs by role, attention bytes
    modules: dict[str, int] = field(default_factory=dict, repr=False)  # FLOPs per module (for the checks)

    def to_json(self) -> dict:
        out = asdict(self)
        del out["modules"]
        return out


def meta_unet(model: str):
    """The U-Net of a preset, folder or checkpoint file, built on the meta device from its config (a
    file's is inferred from its header): shapes only, no weights read."""
    from .checkpoints import index_checkpoint
    from .presets import build_unet

    index = index_checkpoint(model)
    if not index.config:
        raise SdkitError(f"{model}: no U-Net config to build it from (its structure is not one sdkit can infer)")
    return build_unet(index.config, weights="meta")


def default_text_tokens(model, config: dict) -> int:
    """The text tokens a model's cross-attention reads: its tokenizer's length when the folder says
    it (a pipeline's tokenizer/, a mini SD's minisd.json), else the mini SD's 24 for a 384-wide
    U-Net (all-MiniLM-L6-v2's) and SD's 77 for any other."""
    import json
    from pathlib import Path

    folder = Path(str(model))
    for path, key in (
        (folder / "tokenizer" / "tokenizer_config.json", "model_max_length"),
        (folder / "minisd.json", "max_length"),
    ):
        try:
            value = json.loads(path.read_text()).get(key)
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(value, int) and not isinstance(value, bool) and 0 < value < 100_000:
            return value
    return 24 if config.get("cross_attention_dim") == 384 else 77


def _role(name: str) -> str:
    role = parameter_role(f"{name}.weight")
    if role == "self_attention":
        return "self_attention.projections"
    return role if role in ROLES else "other"


def compute(
    model,
    height: int | None = None,
    width: int | None = None,
    batch: int = 1,
    cfg: bool = False,
    text_tokens: int | None = None,
    dtype: str = "float16",
) -> Compute:
    """FLOPs of one forward pass of a preset or model folder (built on the meta device)."""
    import torch

    if dtype not in DTYPE_BYTES:
        raise SdkitError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPE_BYTES)}")
    unet = meta_unet(model) if isinstance(model, str) else model
    config = dict(unet.config)
    factor = image_factor(config)
    height = height or native_image_size(config) or 512
    width = width or height
    for side in (height, width):
        if side <= 0 or side % factor:
            raise SdkitError(
                f"image size {height}x{width}: sides must be positive multiples of {factor} "
                f"(the pixels of one input cell)"
            )
    levels = len(config["block_out_channels"])
    if min(height, width) // factor < 2 ** (levels - 1):
        raise SdkitError(f"image size {height}x{width} is too small for {levels} levels")
    latent = (height // factor, width // factor)
    tokens = text_tokens or default_text_tokens(model, config)
    batch = batch * (2 if cfg else 1)
    flops: dict[str, int] = {}  # per module name
    roles = dict.fromkeys(ROLES, 0)
    per_level: dict[str, dict] = {}
    self_attention: dict = {}  # per level, its first self-attention layer (for the bytes it holds)

    def grid(name: str) -> tuple[int, int]:
        level = parameter_level(f"{name}.weight")
        depth = 0 if level in ("stem", "other") else level_depth(level, levels)
        if ".downsamplers." in name:
            depth += 1  # a stride-2 convolution: counted at its output grid
        if ".upsamplers." in name:
            depth -= 1  # nearest upsampling first, then the convolution at the finer grid
        return halved(*latent, depth)

    def add(name: str, role: str, value: int) -> None:
        flops[name] = flops.get(name, 0) + value
        roles[role] += value
        level = parameter_level(f"{name}.weight")
        entry = per_level.setdefault(
            level,
            {"name": level, "grid": list(grid(name)) if level != "stem" else None, "roles": dict.fromkeys(ROLES, 0)},
        )
        entry["roles"][role] += value

    for name, module in unet.named_modules():
        if isinstance(module, torch.nn.Conv2d):
            h, w = grid(name)
            kh, kw = module.kernel_size
            add(
                name,
                _role(name),
                2 * batch * h * w * module.out_channels * module.in_channels // module.groups * kh * kw,
            )
        elif isinstance(module, torch.nn.Linear):
            if name.startswith(("time_embedding.", "add_embedding.", "class_embedding.")) or name.endswith(
                "time_emb_proj"
            ):
                rows = 1  # one vector per image
            elif name.endswith(("attn2.to_k", "attn2.to_v")):
                rows = tokens
            else:
                h, w = grid(name)
                rows = h * w
            add(name, _role(name), 2 * batch * rows * module.in_features * module.out_features)
        elif type(module).__name__ == "Attention":
            if name.endswith("attn1"):
                self_attention.setdefault(parameter_level(f"{name}.weight"), module)
            h, w = grid(name)
            keys = tokens if name.endswith("attn2") else h * w
            width_inner = module.to_q.out_features
            role = "cross_attention.products" if name.endswith("attn2") else "self_attention.products"
            add(f"{name}.products", role, 2 * 2 * batch * h * w * keys * width_inner)
    total = sum(roles.values())
    level_rows = []
    element = DTYPE_BYTES[dtype]
    for level in [
        "stem",
        *sorted((k for k in per_level if k.startswith("down.")), key=lambda k: int(k[5:])),
        "mid",
        *sorted((k for k in per_level if k.startswith("up.")), key=lambda k: int(k[3:])),
    ]:
        if level not in per_level:
            continue
        entry = per_level[level]
        entry["total"] = sum(entry["roles"].values())
        entry["attention_bytes"] = _attention_bytes(self_attention.get(level), entry["grid"], batch, tokens, element)
        level_rows.append(entry)
    return Compute(
        str(model) if isinstance(model, str) else "module",
        height,
        width,
        batch,
        tokens,
        dtype,
        total,
        roles,
        level_rows,
        flops,
    )


def _attention_bytes(layer, grid, batch: int, tokens: int, element: int) -> dict:
    """What one attention call of a level holds at once, unfused (`layer`: its first self-attention
    layer, or None): the self-attention score table (batch x heads x cells x cells), the
    cross-attention table (x text tokens), and Q, K, V, out."""
    if grid is None or layer is None:
        return {}
    cells = grid[0] * grid[1]
    heads, inner = layer.heads, layer.to_q.out_features
    return {
        "self_scores": batch * heads * cells * cells * element,
        "cross_scores": batch * heads * cells * tokens * element,
        "qkv_out": 4 * batch * cells * inner * element,
    }


def shares(c: Compute) -> dict[str, float]:
    """Attention (self and cross, projections and products), MLP and ResNet shares of the FLOPs."""
    attention = sum(c.roles[r] for r in ATTENTION_ROLES)
    return {
        "attention": attention / c.total,
        "self_attention": (c.roles["self_attention.projections"] + c.roles["self_attention.products"]) / c.total,
        "mlp": c.roles["mlp"] / c.total,
        "resnet": c.roles["resnet"] / c.total,
    }


def crossover_side(model, low: int = 64, high: int = 16384) -> int | None:
    """The smallest square side (a multiple of the input cell) at which self-attention's FLOPs pass
    the MLP's; None if they never do below `high`."""
    unet = meta_unet(model) if isinstance(model, str) else model
    factor = image_factor(dict(unet.config)) * 2 ** (len(unet.config.block_out_channels) - 1)

    def passes(side: int) -> bool:
        c = compute(unet, side, side)
        return c.roles["self_attention.projections"] + c.roles["self_attention.products"] > c.roles["mlp"]

    sides = range(-(-low // factor) * factor, high + 1, factor)
    return next((side for side in sides if passes(side)), None)


def format_compute(c: Compute) -> str:
    def giga(v):
        return f"{v / 1e9:,.2f}"

    rows = [[role, giga(v), f"{100 * v / c.total:.1f} %"] for role, v in c.roles.items() if v]
    out = [
        format_table(
            ["role", "GFLOPs", "share"],
            rows,
            title=f"{c.source}: FLOPs of one U-Net forward pass at {c.height}x{c.width}, batch {c.batch}, "
            f"{c.text_tokens} text tokens: {giga(c.total)} GFLOPs",
        )
    ]
    level_rows = []
    for entry in c.levels:
        attention = sum(entry["roles"][r] for r in ATTENTION_ROLES)
        b = entry["attention_bytes"]
        level_rows.append(
            [
                entry["name"],
                "x".join(map(str, entry["grid"])) if entry["grid"] else "-",
                giga(entry["total"]),
                giga(attention),
                giga(entry["roles"]["mlp"]),
                giga(entry["roles"]["resnet"]),
                format_bytes(b["self_scores"]) if b else "-",
                format_bytes(b["cross_scores"]) if b else "-",
            ]
        )
    out += [
        "",
        format_table(
            ["level", "grid", "GFLOPs", "attention", "mlp", "resnet", f"self table ({c.dtype})", "cross table"],
            level_rows,
            title="By level (attention tables: one call, unfused)",
        ),
    ]
    s = shares(c)
    out.append(
        f"\nattention {100 * s['attention']:.1f} % (self-attention {100 * s['self_attention']:.1f} %), "
        f"MLP {100 * s['mlp']:.1f} %, ResNet {100 * s['resnet']:.1f} % of the FLOPs. Not counted (as "
        "FlopCounterMode does not count them): norms, softmax, activations, additions, upsampling."
    )
    return "\n".join(out)


SWEEP_SIDES = (256, 512, 768, 1024, 1536, 2048)


def sweep(models=("sd15", "sd21", "sdxl", "minisd"), sides=SWEEP_SIDES) -> dict:
    """Attention, MLP and ResNet shares of parameters and of FLOPs across square image sides, per
    model, and the side where self-attention's FLOPs pass the MLP's."""
    from .audit import audit

    out = {"sides": list(sides), "models": {}}
    for model in models:
        params = audit(model)
        attention_params = sum(
            params.roles[r]
            for r in ("self_attention", "cross_attention.query", "cross_attention.key_value", "cross_attention.output")
        )
        unet = meta_unet(model)
        factor = image_factor(dict(unet.config)) * 2 ** (len(unet.config.block_out_channels) - 1)
        rows = [{"side": side, **shares(compute(unet, side, side))} for side in sides if side % factor == 0]
        out["models"][model] = {
            "parameters": {
                "attention": attention_params / params.total,
                "mlp": params.roles["mlp"] / params.total,
                "resnet": params.roles["resnet"] / params.total,
            },
            "flops": rows,
            "self_attention_passes_mlp_at": crossover_side(unet),
        }
    return out


def format_sweep(s: dict) -> str:
    rows = []
    for model, m in s["models"].items():
        p = m["parameters"]
        rows.append(
            [
                model,
                "parameters",
                f"{100 * p['attention']:.1f} %",
                "-",
                f"{100 * p['mlp']:.1f} %",
                f"{100 * p['resnet']:.1f} %",
            ]
        )
        for r in m["flops"]:
            rows.append(
                [
                    "",
                    f"FLOPs at {r['side']} px",
                    f"{100 * r['attention']:.1f} %",
                    f"{100 * r['self_attention']:.1f} %",
                    f"{100 * r['mlp']:.1f} %",
                    f"{100 * r['resnet']:.1f} %",
                ]
            )
    out = [
        format_table(
            ["model", "share of", "attention", "self-attn.", "mlp", "resnet"],
            rows,
            title="Attention, MLP and ResNet shares of parameters and of one forward pass's FLOPs",
        )
    ]
    for model, m in s["models"].items():
        side = m["self_attention_passes_mlp_at"]
        out.append(
            f"{model}: self-attention's FLOPs pass the MLP's at {side:,} px"
            if side
            else f"{model}: self-attention's FLOPs stay below the MLP's up to 16,384 px"
        )
    return "\n".join(out)


def plot_sweep(s: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .common import save_figure

    models = list(s["models"])
    fig, axes = plt.subplots(1, len(models), figsize=(3.4 * len(models), 3.2), dpi=110, sharey=True, squeeze=False)
    for ax, model in zip(axes[0], models):
        m = s["models"][model]
        sides = [r["side"] for r in m["flops"]]
        for key, colour in (
            ("attention", "tab:blue"),
            ("self_attention", "tab:cyan"),
            ("mlp", "tab:orange"),
            ("resnet", "tab:green"),
        ):
            ax.plot(sides, [100 * r[key] for r in m["flops"]], "o-", color=colour, label=key.replace("_", "-"), ms=3)
            if key in m["parameters"]:
                ax.axhline(100 * m["parameters"][key], color=colour, ls=":", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sides, [str(x) for x in sides], fontsize=7, rotation=45)
        ax.set_title(model, fontsize=9)
        ax.set_xlabel("image side (px)", fontsize=8)
    axes[0, 0].set_ylabel("% of FLOPs (dotted: % of parameters)", fontsize=8)
    axes[0, 0].legend(fontsize=7, loc="center left")
    fig.suptitle("Where one forward pass's work goes, by image size", fontsize=9, y=1.04)
    save_figure(fig, path)
