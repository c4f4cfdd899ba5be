"""`sdkit audit`: count a U-Net's parameters by role (sdkit.audit.audit), and with --compute the FLOPs
of one forward pass by role and level (sdkit.compute.compute)."""

from __future__ import annotations

from .common import PRESET_NAMES, add_json, check_outputs, positive_int, refuse_options, show_result

COMPUTE_ONLY = ("height", "width", "batch", "cfg", "dtype", "text_tokens", "sweep", "plot")


def cmd_audit(args) -> None:
    check_outputs(args, pictures=("plot",))
    if not args.compute:
        refuse_options(args, COMPUTE_ONLY, "without --compute")
        from ..audit import audit, format_audit

        result = audit(
            args.model, allow_pickle=args.allow_pickle, context_dim=args.context_dim, image_size=args.image_size
        )
        show_result(args, result.to_json(), format_audit(result))
        return
    refuse_options(args, ("context_dim", "image_size", "allow_pickle"), "with --compute (see --height and --width)")
    if args.plot and not args.sweep:
        refuse_options(args, ("plot",), "without --sweep")
    from ..compute import compute, format_compute, format_sweep, plot_sweep, sweep

    result = compute(
        args.model, args.height, args.width or args.height, args.batch, args.cfg, args.text_tokens, args.dtype
    )
    data, table = result.to_json(), format_compute(result)
    if args.sweep:
        shares = sweep()
        data["sweep"] = shares
        table += "\n\n" + format_sweep(shares)
        if args.plot:
            plot_sweep(shares, args.plot)
            table += f"\nwrote {args.plot}"
    show_result(args, data, table)


def register(sub) -> None:
    p = sub.add_parser(
        "audit",
        help="count a U-Net's parameters by role (attention vs MLP vs ...), or its FLOPs",
        description="Count a U-Net's parameters by role. A .safetensors file is counted "
        "from its header alone, without reading tensor data. With --compute, the "
        "FLOPs of one forward pass by role and level at an image size, and the "
        "bytes each level's attention holds.",
    )
    p.add_argument(
        "model", nargs="?", default="sd15", help=f"preset ({PRESET_NAMES}), diffusers folder, or checkpoint file"
    )
    p.add_argument(
        "--context-dim",
        type=positive_int,
        metavar="N",
        help="also report what a text encoder of width N changes in the U-Net (e.g. 1024)",
    )
    p.add_argument(
        "--image-size",
        type=positive_int,
        metavar="PX",
        help="image side for the latent side per level (default: the model's native size)",
    )
    p.add_argument(
        "--allow-pickle", action="store_true", help="read .ckpt/.bin/.pt files (with torch.load(weights_only=True))"
    )
    p.add_argument("--compute", action="store_true", help="FLOPs of one forward pass by role and level (meta device)")
    p.add_argument("--height", type=positive_int, metavar="PX", help="--compute: image height (default: native)")
    p.add_argument("--width", type=positive_int, metavar="PX", help="--compute: image width (default: the height)")
    p.add_argument("--batch", type=positive_int, default=1, help="--compute: images per batch")
    p.add_argument("--cfg", action="store_true", help="--compute: classifier-free guidance (doubles the batch)")
    p.add_argument(
        "--dtype",
        choices=("float16", "bfloat16", "float32"),
        default="float16",
        help="--compute: dtype of the attention tables",
    )
    p.add_argument(
        "--text-tokens",
        type=positive_int,
        metavar="N",
        help="--compute: text tokens cross-attention reads (default: 77; the mini SD's 24)",
    )
    p.add_argument(
        "--sweep",
        action="store_true",
        help="--compute: also the shares across sides 256-2048 for sd15, sd21, sdxl and minisd",
    )
    p.add_argument("--plot", metavar="FILE.png", help="--compute --sweep: the shares against image side")
    add_json(p)
    p.set_defaults(func=cmd_audit)
