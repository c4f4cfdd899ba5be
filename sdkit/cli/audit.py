"""`sdkit audit`: count a U-Net's parameters by role (sdkit.audit.audit)."""

from __future__ import annotations

from .common import PRESET_NAMES, add_json, check_outputs, positive_int, show_result


def cmd_audit(args) -> None:
    check_outputs(args, inputs=[args.model])
    from ..audit import audit, format_audit

    result = audit(args.model, allow_pickle=args.allow_pickle, context_dim=args.context_dim, image_size=args.image_size)
    show_result(args, result.to_json(), format_audit(result))


def register(sub) -> None:
    p = sub.add_parser("audit", help="count a U-Net's parameters by role (attention vs MLP vs ...)",
                       description="Count a U-Net's parameters by role. A .safetensors file is counted "
                                   "from its header alone, without reading tensor data.")  # fmt: skip
    p.add_argument("model", nargs="?", default="sd15",
                   help=f"preset ({PRESET_NAMES}), diffusers folder, or checkpoint file")  # fmt: skip
    p.add_argument("--context-dim", type=positive_int, metavar="N",
                   help="also report what a text encoder of width N changes in the U-Net (e.g. 1024)")  # fmt: skip
    p.add_argument("--image-size", type=positive_int, metavar="PX",
                   help="image side for the latent side per level (default: the model's native size)")  # fmt: skip
    p.add_argument("--allow-pickle", action="store_true",
                   help="read .ckpt/.bin/.pt files (with torch.load(weights_only=True))")  # fmt: skip
    add_json(p)
    p.set_defaults(func=cmd_audit)

