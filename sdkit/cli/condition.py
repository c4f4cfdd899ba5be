"""`sdkit condition`: single- vs multi-token conditioning seen in the cross-attention; on a mini SD,
word maps against masks (--masks) and one token against many (--generate)."""

from __future__ import annotations

import argparse

from ..common import MAPS_FOLDER, SdkitError
from .common import (
    GUIDANCE_HELP,
    LAYERS,
    PRESET_NAMES,
    add_json,
    check_input,
    check_outputs,
    grid_sides,
    guidance_scale,
    latent_size,
    minisd_spec,
    phase,
    positive_int,
    progress_bar,
    refuse_options,
    seed,
    show_result,
)


def _timestep(text: str) -> int:
    values = _timesteps(text)
    if len(values) != 1:
        raise argparse.ArgumentTypeError(f"one timestep, 0 to 999, not {text!r}")
    return values[0]


def _timesteps(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(t) for t in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of timesteps: {text!r} (e.g. 100,500,900)") from None
    if any(not 0 <= t < 1000 for t in values):
        raise argparse.ArgumentTypeError(f"timesteps are 0 to 999: {text!r}")
    return values


def _minisd_findings(args) -> None:
    """condition --masks / --generate: measured on a mini SD, whose generator is the answer key."""
    from pathlib import Path

    from ..minisd.pipeline import SPEC_FILE, MiniSDPipeline

    if minisd_spec(args.unet) is None:
        raise SdkitError(
            f"{args.unet}: --masks and --generate need a mini SD folder (with {SPEC_FILE}): the answer "
            "key is its generator's masks and judge (try --unet weights/minisd)"
        )
    pipe = MiniSDPipeline.from_pretrained(
        args.unet, args.text_encoder, args.encoders_dir, allow_pickle=args.allow_pickle
    )
    if args.masks:
        from ..localization import draw_examples, format_localization, generated_set, generator_set, localize

        reports, tables, pictures = [], [], []
        for source in ("generator", "generated"):
            with progress_bar(
                args, total=args.count * len(args.timesteps), desc=f"maps on {source} images", unit="image"
            ) as bar:
                if source == "generator":
                    images, scenes, masks = generator_set(args.count, pipe.spec.image_size)
                else:
                    images, scenes, masks = generated_set(pipe, args.count, args.guidance, args.steps)
                report = localize(
                    pipe, images, scenes, masks, args.timesteps, model_name=args.unet, source=source, progress=bar
                )
            if source == "generated":
                found = sum(m is not None for ms in masks for m in ms)
                report.note = (
                    f"judge found {found} of {sum(len(ms) for ms in masks)} named objects in the generated images"
                )
            reports.append(report)
            tables.append(format_localization(report))
            if args.plot:  # one picture per image source: FILE-generator.png, FILE-generated.png
                stem = Path(args.plot)
                picture = stem.with_name(f"{stem.stem}-{source}{stem.suffix or '.png'}")
                if draw_examples(report, picture):
                    pictures.append(str(picture))
        table = "\n\n".join(tables) + "".join(f"\nwrote {p}" for p in pictures)
        show_result(args, {"localization": [r.to_json() for r in reports], "pictures": pictures}, table)
        return
    from ..minisd.conditions import CONDITIONS, SETS, compare_token_conditions, draw_comparison, format_token_comparison

    pooled = None
    if args.pooled_model:
        pooled = MiniSDPipeline.from_pretrained(
            args.pooled_model, args.text_encoder, args.encoders_dir, allow_pickle=args.allow_pickle
        )
    runs = len(SETS) * args.count * (len(CONDITIONS) + (pooled is not None))
    with progress_bar(args, total=runs, desc="generating", unit="image") as bar:
        result = compare_token_conditions(
            pipe,
            pooled,
            args.count,
            args.guidance,
            args.steps,
            model_name=args.unet,
            pooled_name=args.pooled_model,
            progress=bar,
        )
    table = format_token_comparison(result)
    if args.plot:
        draw_comparison(result, args.plot)
        table += f"\nwrote {args.plot}"
    show_result(args, result.to_json(), table)


# What each mode reads; an option given for another mode is refused, never ignored.
COMPARISON_ONLY = (
    "prompt",
    "tokenizer",
    "layer",
    "latent_size",
    "timestep",
    "seed",
    "maps",
    "shared_scale",
    "map_sides",
    "device",
)
MINISD_ONLY = ("count", "guidance", "steps", "plot", "timesteps", "pooled_model")


def cmd_condition(args) -> None:
    check_outputs(args, pictures=("plot",), owned={"maps": MAPS_FOLDER})
    if args.masks and args.generate:
        raise SdkitError("choose one of --masks and --generate")
    if args.masks or args.generate:
        mode = "with --masks" if args.masks else "with --generate"
        refuse_options(args, COMPARISON_ONLY + (("pooled_model",) if args.masks else ("timesteps",)), mode)
    else:
        refuse_options(args, MINISD_ONLY, "without --masks or --generate")
    if args.tokenizer and not args.text_encoder:
        raise SdkitError("--tokenizer needs --text-encoder (the tokenizer labels the encoder's tokens)")
    if args.unet not in PRESET_NAMES.split(", "):
        check_input(args.unet, "--unet")
    if args.masks or args.generate:
        if args.pooled_model:
            check_input(args.pooled_model, "--pooled-model")
        return _minisd_findings(args)
    if args.text_encoder:
        check_input(args.text_encoder, "--text-encoder")
    from ..conditioning import (
        check_width,
        compare_conditionings,
        format_comparison,
        preflight,
        prompt_conditionings,
        synthetic_conditionings,
        write_maps,
    )
    from ..encoders import load_text_encoder
    from ..loading import load_unet
    from ..presets import PRESETS
    from ..scoretable import resolve_device

    spec = minisd_spec(args.unet)
    if spec is not None:
        refuse_options(args, ("layer", "tokenizer"), "with a mini SD as --unet (it reads its own encoder's layer)")
    device = resolve_device(args.device)
    phase(f"building {args.unet} with random weights" if args.unet in PRESETS else f"loading {args.unet}")
    unet = load_unet(args.unet, allow_pickle=args.allow_pickle)
    if spec is not None:
        spec.check_unet(unet, args.unet)
    if spec is not None and spec.place_embeddings:  # not in the weights file: a function of the shapes
        from ..minisd.pipeline import add_place_embeddings

        add_place_embeddings(unet, spec.image_size)
    preflight(unet, args.latent_size, device, maps=bool(args.maps))
    unet = unet.to(device)
    note = (
        "preset with RANDOM weights: the numbers show the mechanism, not what a trained model reads"
        if args.unet in PRESETS
        else ""
    )
    if spec is not None:  # a mini SD reads its own encoder, at its own context length
        from ..minisd.pipeline import find_text_encoder

        note = f"trained mini SD, pixel space, reading {spec.text_encoder} ({spec.max_length} tokens)"
        encoder = find_text_encoder(spec, args.text_encoder, args.encoders_dir, args.allow_pickle)
        conditioning = prompt_conditionings(encoder, args.prompt)
    elif args.text_encoder:
        encoder = load_text_encoder(args.text_encoder, args.tokenizer, layer=args.layer, allow_pickle=args.allow_pickle)
        conditioning = prompt_conditionings(encoder, args.prompt)
    else:
        conditioning = synthetic_conditionings(unet.config.cross_attention_dim, seed=args.seed)
    check_width(unet, conditioning)
    with progress_bar(args, total=len(conditioning.cases), desc="forward passes", unit="case") as bar:
        result = compare_conditionings(
            unet,
            conditioning,
            args.latent_size,
            args.timestep,
            args.seed,
            maps=bool(args.maps),
            map_sides=args.map_sides,
            unet_name=args.unet,
            note=note,
            progress=bar,
        )
    table = format_comparison(result)
    if args.maps:
        paths = write_maps(result, conditioning, args.maps, shared_scale=args.shared_scale)
        table += f"\n\nwrote {len(paths)} PNG maps to {args.maps} (overview: {paths[-1]})"
    show_result(args, result.to_json(), table)


def register(sub) -> None:
    p = sub.add_parser(
        "condition",
        help="single- vs multi-token conditioning, seen in the cross-attention",
        description="Run one U-Net, latent and timestep under single-token, repeated-token and "
        "multi-token conditioning and trace every cross-attention layer.",
    )
    p.add_argument("--unet", default="tiny", help="preset (random weights), diffusers folder or checkpoint")
    p.add_argument(
        "--prompt",
        default="a photo of a red cat sitting on a blue chair",
        help="the prompt to encode (for a mini SD, try 'a red circle to the left of a blue square')",
    )
    p.add_argument("--text-encoder", metavar="DIR", help="local transformers text encoder (or SD pipeline folder)")
    p.add_argument("--tokenizer", metavar="DIR", help="its tokenizer, when not beside it")
    p.add_argument(
        "--layer",
        choices=LAYERS,
        default="last",
        help="text-encoder layer the U-Net reads: last (SD 1.x) or penultimate (SD 2.x)",
    )
    p.add_argument(
        "--latent-size", type=latent_size, help="latent grid, e.g. 64 or 64x96 (default: the U-Net's sample size)"
    )
    p.add_argument("--timestep", type=_timestep, default=500, help="diffusion timestep of the forward pass (0 to 999)")
    p.add_argument("--seed", type=seed, default=0, help="seed of the latent (and of synthetic tokens)")
    p.add_argument("--maps", metavar="DIR", help="write a PNG heatmap per word and an overview grid here")
    p.add_argument("--shared-scale", action="store_true", help="one colour scale for all maps")
    p.add_argument(
        "--map-sides",
        type=grid_sides,
        help="only layers with these grid sides in the maps, e.g. 16,32 (default: every layer)",
    )
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu or cuda")
    p.add_argument("--allow-pickle", action="store_true", help="read pickle weights (with weights_only=True)")
    p.add_argument(
        "--masks",
        action="store_true",
        help="mini SD: score each colour and shape word's attention map against its object's mask",
    )
    p.add_argument(
        "--generate",
        action="store_true",
        help="mini SD: generate and judge images under one-token and many-token conditioning",
    )
    p.add_argument("--count", type=positive_int, default=64, help="--masks/--generate: images per set")
    p.add_argument(
        "--timesteps",
        type=_timesteps,
        default=(100, 300, 500, 700, 900),
        help="--masks: timesteps to noise the images to (comma-separated)",
    )
    p.add_argument("--pooled-model", metavar="DIR", help="--generate: a mini SD trained on the pooled state only")
    p.add_argument("--guidance", type=guidance_scale, help=f"--masks/--generate: {GUIDANCE_HELP}")
    p.add_argument("--steps", type=positive_int, default=25, help="--masks/--generate: sampling steps")
    p.add_argument("--encoders-dir", default="weights/encoders", help="where the mini SD's text encoder is")
    p.add_argument(
        "--plot",
        metavar="FILE.png",
        help="--masks/--generate: the picture (--masks writes one per image "
        "source: FILE-generator.png and FILE-generated.png)",
    )
    add_json(p)
    p.set_defaults(func=cmd_condition)
