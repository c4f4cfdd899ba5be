"""`sdkit minisd train | sample | eval`: the mini Stable Diffusion trained here (sdkit.minisd)."""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import asdict, replace

from ..common import MAPS_FOLDER, MODEL_FOLDER, SdkitError, check_output_folder
from ..minisd import EVAL_SET_SEED, LATENT_STEPS, LR_SCHEDULES, POSTERIORS, PRECISIONS, SHIPPED_TRAINING_TIME
from .common import (
    CACHE_DEFAULT,
    CACHE_HELP,
    GUIDANCE_HELP,
    LAYERS,
    Parser,
    add_json,
    add_subcommand,
    at_most,
    cache_folder,
    check_input,
    check_outputs,
    guidance_scale,
    nonnegative_float,
    nonnegative_int,
    phase,
    positive_float,
    positive_int,
    progress_bar,
    refuse_options,
    seed,
    show_result,
    steering_objectives,
)

STEERING_OPTIONS = ("guide_scale", "guide_steps", "guide_resolution", "guide_layers")


def cmd_minisd(args) -> None:
    if not args.minisd_command:
        from ..minisd import explanation

        phase.clear()
        print(explanation(args.explain_model, args.explain_encoders_dir))
        return
    # Given before the subcommand, they would be the group's, which the subcommand does not read
    for dest, option in (("explain_model", "--model"), ("explain_encoders_dir", "--encoders-dir")):
        if dest in args.given:
            raise SdkitError(
                f"{option} before '{args.minisd_command}' only says which model `sdkit minisd` explains; "
                f"put it after the subcommand: sdkit minisd {args.minisd_command} {option} ..."
            )
    args.minisd_func(args)


def train_settings(args, vae=None):
    """TrainSettings from `sdkit minisd train`'s options (their defaults are TrainSettings' own: a test).

    Given the VAE of --vae, a latent mini SD's: its image side is the VAE's, a stock pipeline has no
    place embeddings (asked for, they make the ablation's sdkit-only folder), and it trains
    LATENT_STEPS unless --steps says otherwise."""
    from ..minisd.train import TrainSettings

    settings = TrainSettings(
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        lr_schedule=args.lr_schedule,
        seed=args.seed,
        image_size=args.image_size,
        conditioning=args.conditioning,
        empty_fraction=args.empty_fraction,
        pair_fraction=args.pair_fraction,
        grounding_weight=args.grounding_weight,
        relation_weight=args.relation_weight,
        attention_loss_from=args.attention_loss_from,
        zero_terminal_snr=args.zero_terminal_snr,
        swap_fraction=args.swap_fraction,
        swap_from=args.swap_from,
        place_embeddings=args.place_embeddings,
        timestep_bias=args.timestep_bias,
        timestep_bias_from=args.timestep_bias_from,
        precision=args.precision,
        posterior=args.posterior,
        latent_pool=args.latent_pool,
        compile=not args.no_compile,
    )
    if vae is None:
        return settings
    return replace(
        settings,
        space="latents",
        steps=settings.steps if "steps" in args.given else LATENT_STEPS,
        image_size=settings.image_size if "image_size" in args.given else vae.config.sample_size,
        place_embeddings=settings.place_embeddings if "place_embeddings" in args.given else False,
    )


def cmd_minisd_train(args) -> None:
    check_outputs(args, folders=("cache", "checkpoints"), owned={"out": MODEL_FOLDER})
    if args.checkpoints:  # the run so far goes to DIR/model: the same rule as --out
        check_output_folder(os.path.join(args.checkpoints, "model"), MODEL_FOLDER, "--checkpoints model folder")
    if args.keep_models_every and (not args.checkpoints or args.keep_models_every % args.checkpoint_every):
        raise SdkitError(
            f"--keep-models-every {args.keep_models_every} keeps checkpoints' models: it needs --checkpoints "
            f"and a multiple of --checkpoint-every ({args.checkpoint_every})"
        )
    from ..encoders import for_stock_pipeline, load_text_encoder
    from ..minisd.train import train

    vae = None
    if args.vae:
        from ..minisd.pipeline import load_vae

        check_input(args.vae, "--vae")
        phase(f"loading the VAE {args.vae}")
        vae = load_vae(args.vae)
    settings = train_settings(args, vae)
    settings.check()
    folder = args.text_encoder or os.path.join(args.encoders_dir, "all-MiniLM-L6-v2")
    check_input(folder, "the text encoder; python scripts/get_real_encoders.py puts it in weights/encoders")
    phase(f"loading the text encoder {folder}")
    encoder = load_text_encoder(folder, layer=args.layer, allow_pickle=args.allow_pickle)
    if vae is not None:
        encoder = for_stock_pipeline(encoder, settings.context_length)
    # the captions' states are encoded (or read from the cache) before the first step; the phase
    # ends with the run, so in a log its time is the whole run's, and it says so
    phase("encoding the captions, building the U-Net and training")
    result = train(
        args.out,
        encoder,
        settings,
        checkpoint_dir=args.checkpoints,
        checkpoint_every=args.checkpoint_every,
        keep_models_every=args.keep_models_every,
        cache_dir=args.cache,
        progress=not args.json,
        vae=vae,
        vae_record=None if vae is None else vae_training_record(args.vae),
    )
    last = result.history[-1]["loss"] if result.history else float("nan")
    if result.resumed_from == result.steps:
        table = (
            f"the checkpoint already holds all {result.steps} steps: nothing left to train (last loss {last:.4f})"
            f"\nsaved its EMA weights to {result.folder}"
        )
    else:
        resumed = f", resumed from step {result.resumed_from}" if result.resumed_from else ""
        table = (
            f"trained {result.steps} steps{resumed} in {result.seconds:.0f} s ({result.samples_per_second:.1f} "
            f"samples/s); last loss {last:.4f}\nsaved the EMA weights to {result.folder}"
        )
    show_result(args, asdict(result), table)


def vae_training_record(folder: str) -> dict | None:
    """How the VAE in `folder` was trained (its training.json, `sdkit minisd vae` writes it), without
    the loss history; None for a VAE from elsewhere."""
    import json
    from pathlib import Path

    path = Path(folder) / "training.json"
    if not path.is_file():
        if (Path(folder) / "minisd.json").is_file():  # a latent mini SD keeps its VAE's record in its own
            from ..minisd.pipeline import MiniSDSpec

            return MiniSDSpec.read(folder).training.get("vae")
        return None
    try:
        record = json.loads(path.read_text())
    except ValueError:
        raise SdkitError(f"{path}: not valid JSON") from None
    return {k: v for k, v in record.items() if k != "history"} if isinstance(record, dict) else None


def cmd_minisd_vae(args) -> None:
    from ..minisd.pipeline import load_vae
    from ..minisd.vae import VAESettings, format_round_trips, judge_round_trips, latent_separation, train_vae

    if args.judge:
        refuse_options(
            args,
            ("out", "steps", "batch_size", "lr", "kl_weight", "seed", "checkpoints", "start_from", "decoder_only"),
            "with --judge",
        )
        check_input(args.judge, "--judge")
        vae, trained = load_vae(args.judge), None
    else:
        check_outputs(args, folders=("out", "checkpoints"))
        if args.into:
            check_input(args.into, "--into")
        if args.decoder_only and not args.start_from:
            raise SdkitError("--decoder-only fine-tunes a trained VAE's decoder: give it with --start-from DIR")
        if args.decoder_only:
            refuse_options(args, ("kl_weight",), "with --decoder-only (the KL term is the frozen encoder's)")
        if args.start_from:
            check_input(args.start_from, "--start-from")
        settings = VAESettings(
            steps=args.steps,
            batch_size=args.batch_size,
            lr=args.lr,
            kl_weight=args.kl_weight,
            seed=args.seed,
            decoder_only=args.decoder_only,
        )
        settings.check()
        phase("fine-tuning the VAE's decoder" if args.decoder_only else "training the VAE")
        trained = train_vae(
            args.out, settings, checkpoint_dir=args.checkpoints, progress=not args.json, start_from=args.start_from
        )
        vae = load_vae(args.out)
    phase(f"judging {args.count} round trips per set")
    judged = judge_round_trips(vae, args.count)
    result = {"vae": args.judge or args.out, "round_trips": judged, "latent_separation": latent_separation(vae)}
    if trained is not None:
        result.update(
            seconds=round(trained.seconds, 1), scaling_factor=trained.scaling_factor, settings=trained.settings
        )
    else:
        from ..minisd.vae import total_training_seconds

        result.update(
            scaling_factor=vae.config.scaling_factor,
            training=vae_training_record(args.judge),
            training_seconds=total_training_seconds(vae_training_record(args.judge)),
        )
    if args.into:
        from ..minisd.vae import install_vae

        phase(f"putting the VAE into {args.into}")
        install_vae(args.into, result["vae"], vae_training_record(result["vae"]))
        result["installed_into"] = args.into
    show_result(args, result, format_round_trips(result))


def _pipeline(args):
    """The --model's pipeline; with no --guidance given, args.guidance becomes the model's own."""
    from ..minisd.pipeline import MiniSDPipeline

    check_input(args.model, "--model")
    phase(f"loading the mini SD {args.model} and its text encoder")
    pipe = MiniSDPipeline.from_pretrained(
        args.model, args.text_encoder, args.encoders_dir, allow_pickle=args.allow_pickle
    )
    args.guidance = pipe.guidance(args.guidance)
    return pipe


def _model_name(path: str, pipe) -> str:
    """The model's path, and for a run's checkpoint copy that it is one (its weights are a run's so far)."""
    note = pipe.spec.checkpoint_note()
    return f"{path} ({note})" if note else path


def _steering(args):
    """SteeringSettings from --guide and its options (None without --guide, which they need)."""
    if not args.guide:
        refuse_options(args, STEERING_OPTIONS, "without --guide")
        return None
    from ..steering import SteeringSettings

    if args.guide_layers:
        refuse_options(args, ("guide_resolution",), "with --guide-layers (the layers are named, not found by side)")
    layers = tuple(n for n in args.guide_layers.split(",") if n) if args.guide_layers else None
    settings = SteeringSettings(
        objectives=args.guide,
        scale=args.guide_scale,
        steps=args.guide_steps,
        resolution=args.guide_resolution,
        layers=layers or None,
    )
    settings.check()
    return settings


def _steering_title(settings) -> str:
    where = ", ".join(settings.layers) if settings.layers else f"maps at {settings.resolution}x{settings.resolution}"
    return (
        f"steered by {'+'.join(settings.objectives)} (scale {settings.scale:g}, first {settings.steps} steps, {where})"
    )


def cmd_minisd_sample(args) -> None:
    check_outputs(args, pictures=("out",), owned={"overlays": MAPS_FOLDER})
    if args.overlays:
        refuse_options(args, ("guide",), "with --overlays (steering traces the same layers)")
    from ..minisd.evaluate import check_grid, sample_grid

    if args.first_seed + args.seeds > 2**63:
        raise SdkitError(f"--first-seed {args.first_seed} + {args.seeds} seeds passes the largest seed, 2^63 - 1")
    steering = _steering(args)
    pipe = _pipeline(args)
    from ..minisd.pipeline import check_images_fit

    check_images_fit(len(args.prompts) * args.seeds, pipe.spec.image_size, "sampling")
    prompts = [p for p in args.prompts for _ in range(args.seeds)]
    seeds = [args.first_seed + s for _ in args.prompts for s in range(args.seeds)]
    check_grid(prompts)
    guides = None
    if steering is not None:
        from ..minisd.steer import caption_guides

        guides = caption_guides(pipe.encoder, prompts, pipe.spec.image_size)
    from contextlib import nullcontext

    from ..trace import CrossAttentionTrace

    # one batch, so that the trace holds the images in order; guidance stacks (unconditional, conditional)
    trace = CrossAttentionTrace(pipe.unet, cfg=args.guidance != 1, maps=True) if args.overlays else nullcontext()
    with progress_bar(args, total=len(prompts), desc="sampling", unit="image") as bar, trace:
        out = pipe(
            prompts,
            args.steps,
            args.guidance,
            seeds=seeds,
            sampler=args.sampler,
            progress=bar,
            steering=steering,
            guides=guides,
            batch_size=len(prompts) if args.overlays else 64,
        )
    title = f"{_model_name(args.model, pipe)}: {args.sampler} {args.steps} steps, guidance {args.guidance:g}"
    if steering is not None:
        title += f", {_steering_title(steering)}"
    sample_grid(out.images, prompts, seeds, args.out, title)
    overlays = ""
    if args.overlays:
        from ..minisd.evaluate import write_overlays

        written = write_overlays(trace, out.images, prompts, seeds, pipe.encoder, args.overlays)
        overlays = f"; each word's map over each image in {args.overlays} ({len(written)} pictures)"
    steered = None if steering is None else {k: v for k, v in asdict(steering).items() if k != "text_positions"}
    show_result(
        args,
        {
            "model": args.model,
            "checkpoint_step": pipe.spec.training.get("checkpoint_step"),
            "prompts": prompts,
            "seeds": seeds,
            "guidance_scale": args.guidance,
            "steps": args.steps,
            "sampler": args.sampler,
            "steering": steered,
            "grid": args.out,
            "overlays": args.overlays,
        },
        f"wrote {len(prompts)} images to {args.out} ({title}){overlays}",
    )


def cmd_minisd_eval(args) -> None:
    check_outputs(args, pictures=("panel",))
    from ..minisd.evaluate import SETS, draw_panel, evaluate, format_evaluation

    sets = [s for s in args.sets.split(",") if s]
    if not sets:
        raise SdkitError(f"--sets names no prompt set; choose from {', '.join(SETS)}")
    unknown = set(sets) - set(SETS)
    if unknown:
        raise SdkitError(f"unknown prompt set {sorted(unknown)[0]!r}; choose from {', '.join(SETS)}")
    steering = _steering(args)
    pipe = _pipeline(args)
    images = args.count * len(sets) * (1 + (0 if args.no_floors else 2) + (steering is not None))
    with progress_bar(args, total=images, desc="generating", unit="image") as bar:
        ev = evaluate(
            pipe,
            sets,
            args.count,
            args.guidance,
            args.steps,
            args.sampler,
            floors=not args.no_floors,
            model_name=_model_name(args.model, pipe),
            progress=bar,
            steering=steering,
            set_seed=args.set_seed,
        )
    table = format_evaluation(ev)
    if args.panel:
        draw_panel(ev, args.panel)
        table += f"\nwrote {args.panel}"
    show_result(args, ev.to_json(), table)


def _reweights(text: str) -> dict[str, float]:
    """--reweight WORD=FACTOR[,WORD=FACTOR]"""
    out = {}
    for part in (p for p in text.split(",") if p):
        word, _, factor = part.partition("=")
        try:
            out[word.strip()] = float(factor)
        except ValueError:
            raise argparse.ArgumentTypeError(f"a reweight is WORD=FACTOR (e.g. blue=2.0), not {part!r}") from None
        if not word.strip() or not math.isfinite(out[word.strip()]) or out[word.strip()] < 0:
            raise argparse.ArgumentTypeError(f"a reweight is a word and a finite factor of 0 or more, not {part!r}")
    if not out:
        raise argparse.ArgumentTypeError(f"a reweight is WORD=FACTOR (e.g. blue=2.0), not {text!r}")
    return out


def cmd_minisd_edit(args) -> None:
    check_outputs(args, pictures=("out",))
    from ..editing import EditSettings
    from ..minisd.edit import draw_edits, edit_images

    if args.first_seed + args.seeds > 2**63:
        raise SdkitError(f"--first-seed {args.first_seed} + {args.seeds} seeds passes the largest seed, 2^63 - 1")
    settings = EditSettings(
        cross_replace=args.cross_replace,
        self_replace=args.self_replace,
        reweight=args.reweight or {},
        local_blend=args.local_blend,
        blend_threshold=args.blend_threshold,
        source_states=args.source_states,
        unconditional=args.unconditional,
        share_latents=args.share_latents,
    )
    settings.check()
    if not args.local_blend:
        refuse_options(args, ("blend_threshold",), "without --local-blend")
    edited_prompt = args.to if args.to is not None else args.prompt
    if args.to is None and not args.reweight:
        raise SdkitError("give the edited prompt (--to) or a reweight (--reweight WORD=FACTOR), or both")
    if args.image:
        return _edit_real_image(args, settings, edited_prompt)
    refuse_options(args, ("tuned_states_for",), "without --image")
    pipe = _pipeline(args)
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    sources, edits = [args.prompt] * len(seeds), [edited_prompt] * len(seeds)
    with progress_bar(args, total=4 * len(seeds), desc="editing", unit="image") as bar:
        plain_settings = EditSettings(cross_replace=0.0)  # the edited prompt regenerated, same seed
        source_images, plain = edit_images(
            pipe, sources, edits, plain_settings, seeds, args.steps, args.guidance, progress=bar
        )
        _, edited = edit_images(pipe, sources, edits, settings, seeds, args.steps, args.guidance, progress=bar)
    title = f"{_model_name(args.model, pipe)}: Prompt-to-Prompt, {settings.title()} (DDIM {args.steps} steps, guidance {args.guidance:g})"
    columns = [(source_images, f"source: {args.prompt}"), (plain, f"regenerated: {edited_prompt}")]
    draw_edits([*columns, (edited, f"edited: {edited_prompt}")], [f"seed {s}" for s in seeds], args.out, title)
    show_result(
        args,
        {"seeds": seeds, **_edit_summary(args, settings, edited_prompt)},
        f"wrote {args.out}: {len(seeds)} seeds of source, regenerated and edited ({settings.title()})",
    )


def _edit_summary(args, settings, edited_prompt: str) -> dict:
    """What an edit ran with, as its JSON says it."""
    return {
        "model": args.model,
        "prompt": args.prompt,
        "edited_prompt": edited_prompt,
        "cross_replace": settings.cross_replace,
        "self_replace": settings.self_replace,
        "reweight": settings.reweight,
        "local_blend": settings.local_blend,
        "blend_threshold": settings.blend_threshold if settings.local_blend else None,
        "source_states": settings.source_states,
        "unconditional": settings.unconditional,
        "share_latents": settings.share_latents,
        "steps": args.steps,
        "guidance_scale": args.guidance,
        "picture": args.out,
    }


def _edit_real_image(args, settings, edited_prompt: str) -> None:
    """--image: a real image, inverted (null-text) under the prompt into a latent mini SD's stock
    StableDiffusionPipeline, redrawn, regenerated from the inverted start and edited."""
    import numpy as np

    from ..editing import EditSettings, edit_sd, invert_sd
    from ..minisd.edit import draw_edits

    refuse_options(args, ("seeds", "first_seed"), "with --image (the image's inversion is the start)")
    check_input(args.image, "--image")
    from PIL import Image

    try:
        with Image.open(args.image) as opened:
            image = np.asarray(opened.convert("RGB"), dtype=np.float32) / 255  # as the image processor reads arrays
    except OSError as error:  # PIL's UnidentifiedImageError is one
        raise SdkitError(f"{args.image}: not an image (--image): {error}") from None
    pipe = _pipeline(args)
    if pipe.spec.space != "latents":
        raise SdkitError(
            f"{args.model} denoises pixels; a real image is inverted into a latent mini SD (a stock "
            "StableDiffusionPipeline, e.g. weights/minisd-latent)"
        )
    stock = pipe.stock_pipeline()
    stock.set_progress_bar_config(disable=True)
    with progress_bar(args, total=2 * args.steps, desc=f"null-text inversion of {args.image}", unit="step") as bar:
        inversion = invert_sd(stock, image, args.prompt, args.steps, args.guidance, progress=bar)
    edits = {}
    with progress_bar(args, total=2, desc="editing", unit="edit") as bar:
        for name, edit_settings in (("regenerated", EditSettings(cross_replace=0.0)), ("edited", settings)):
            edits[name] = edit_sd(
                stock,
                args.prompt,
                edited_prompt,
                edit_settings,
                args.steps,
                args.guidance,
                output_type="np",
                inversion=inversion,
                tuned_states_for=args.tuned_states_for,
            )
            bar.update()
    redrawn, regenerated = edits["regenerated"]
    side = stock.unet.config.sample_size * stock.vae_scale_factor
    real = stock.image_processor.postprocess(stock.image_processor.preprocess(image, side, side), "np")[
        0
    ]  # as inverted
    title = (
        f"{_model_name(args.model, pipe)}: null-text inversion (tuned states read by the "
        f"{'source branch' if args.tuned_states_for == 'source' else 'both branches'}), then Prompt-to-Prompt, "
        f"{settings.title()} (DDIM {args.steps} steps, guidance {args.guidance:g})"
    )
    columns = [
        ([real], f"real: {args.image}"),
        ([redrawn], f"redrawn: {args.prompt}"),
        ([regenerated], f"regenerated: {edited_prompt}"),
        ([edits["edited"][1]], f"edited: {edited_prompt}"),
    ]
    draw_edits(columns, [f"{side}x{side}"], args.out, title)
    redrawn_error = float(np.abs(redrawn - real).mean())
    show_result(
        args,
        {
            "image": args.image,
            "tuned_states_for": args.tuned_states_for,
            "inversion_error": inversion.errors[-1],
            "redrawn_error": redrawn_error,
            **_edit_summary(args, settings, edited_prompt),
        },
        f"wrote {args.out}: {args.image} redrawn (mean absolute pixel error {redrawn_error:.4f}), regenerated and "
        f"edited ({settings.title()})",
    )


def register(sub) -> None:
    p = sub.add_parser(
        "minisd",
        help="the mini Stable Diffusion trained here: train, sample, judge",
        description="A small SD-1.x-shaped U-Net on 32x32 pixels, conditioned on all-MiniLM-L6-v2 "
        "token states, trained on captioned shapes whose masks are known. Without a "
        "subcommand, explains itself.",
    )
    p.set_defaults(func=cmd_minisd)
    p.add_argument(
        "--model",
        dest="explain_model",
        default="weights/minisd",
        help="without a subcommand: the mini SD folder to explain",
    )
    p.add_argument(
        "--encoders-dir",
        dest="explain_encoders_dir",
        default="weights/encoders",
        help="without a subcommand: where its text encoder is looked for",
    )
    minisd_sub = p.add_subparsers(dest="minisd_command", metavar="SUBCOMMAND", parser_class=Parser)

    def encoder_options(q):
        q.add_argument(
            "--text-encoder", metavar="DIR", help="the text encoder folder (default: the model's, from --encoders-dir)"
        )
        q.add_argument("--encoders-dir", default="weights/encoders", help="where the real encoders are")
        q.add_argument("--allow-pickle", action="store_true", help="read pickle weights (with weights_only=True)")

    def sampling_options(q):
        q.add_argument("--model", default="weights/minisd", help="a mini SD folder")
        q.add_argument("--guidance", type=guidance_scale, help=GUIDANCE_HELP)
        q.add_argument("--steps", type=positive_int, default=25, help="sampling steps")
        q.add_argument("--sampler", choices=("ddim", "dpm"), default="ddim", help="DDIM or DPM-Solver++")
        q.add_argument(
            "--guide",
            type=steering_objectives,
            metavar="OBJECTIVES",
            help="steer the cross-attention by these objectives, comma-separated: excite "
            "(Attend-and-Excite), bind (colour words onto their shapes), layout (each object into "
            "its part of the image); guides come from the captions",
        )
        q.add_argument(
            "--guide-scale",
            type=nonnegative_float,
            default=40.0,
            help="steering step size (A&E's scale, its own default 20; 40 is layout's best on the mini SD)",
        )
        q.add_argument("--guide-steps", type=nonnegative_int, default=15, help="steer the first this many steps")
        q.add_argument(
            "--guide-resolution",
            type=positive_int,
            default=16,
            help="steer the maps of the cross-attention layers at this grid side",
        )
        q.add_argument("--guide-layers", metavar="NAMES", help="or steer exactly these layers (comma-separated)")
        encoder_options(q)
        add_json(q)

    q = add_subcommand(minisd_sub, "train", f"train a mini SD (the shipped recipe: {SHIPPED_TRAINING_TIME})")
    q.add_argument(
        "--out",
        default="out/minisd",
        help="save the model folder here: a new or empty folder, or a mini SD folder, whose model is "
        "replaced (other files in it are kept); the shipped model is weights/minisd",
    )
    q.add_argument("--steps", type=positive_int, default=3600, help=f"optimizer steps; {LATENT_STEPS} with --vae")
    q.add_argument("--batch-size", type=positive_int, default=32, help="images per step")
    q.add_argument("--lr", type=positive_float, default=1e-3, help="peak learning rate")
    q.add_argument(
        "--lr-schedule",
        choices=LR_SCHEDULES,
        default="cosine",
        help="after a 100-step warm-up: cosine decay to zero, or constant (SD 1.x's)",
    )
    q.add_argument("--seed", type=seed, default=0, help="seed of the data stream, noise and initialisation")
    q.add_argument(
        "--image-size",
        type=positive_int,
        default=32,
        help="image side in pixels: a multiple of 4 from 12 to 512 (trained here: 32 and 64)",
    )
    q.add_argument(
        "--conditioning",
        choices=("tokens", "pooled"),
        default="tokens",
        help="tokens: every token state; pooled: their mean, one key/value",
    )
    q.add_argument("--empty-fraction", type=nonnegative_float, default=0.1, help="captions dropped for guidance")
    q.add_argument("--pair-fraction", type=nonnegative_float, default=0.5, help="images with two objects")
    q.add_argument(
        "--grounding-weight",
        type=nonnegative_float,
        default=0.0,
        help="weight of the loss that makes each object's words attend to its mask (TokenCompose's; 0: off)",
    )
    q.add_argument(
        "--relation-weight",
        type=nonnegative_float,
        default=0.0,
        help="weight of the loss that orders a pair's attention as its caption does (left of / right of; 0: off)",
    )
    q.add_argument(
        "--attention-loss-from",
        type=nonnegative_int,
        default=0,
        metavar="T",
        help="apply those two losses only to images noised to timestep T or more (of 1000)",
    )
    q.add_argument(
        "--zero-terminal-snr",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="rescale the noise schedule to end at pure noise and predict v (Lin et al. 2024; on by default; "
        "SD 1.x ends at SNR 0.0047 and predicts the noise)",
    )
    q.add_argument(
        "--place-embeddings",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="add diffusers' sinusoidal positional embedding before each transformer block's attention, so "
        "queries know their place (on by default; SD 1.x has none: a departure)",
    )
    q.add_argument(
        "--swap-fraction",
        type=nonnegative_float,
        default=0.0,
        metavar="F",
        help="noise this fraction of pair images from the pair with its objects exchanged, asking for the "
        "true image: the noise then cannot say which object is where (a departure from SD's recipe; "
        "default 0: off)",
    )
    q.add_argument(
        "--swap-from",
        type=nonnegative_int,
        default=600,
        metavar="T",
        help="... only at timesteps T or more (of 1000; default 600)",
    )
    q.add_argument(
        "--posterior",
        choices=POSTERIORS,
        default="sample",
        help="with --vae: train on draws from the VAE's posterior (sample, SD's recipe) or on its mean",
    )
    q.add_argument(
        "--latent-pool",
        type=nonnegative_int,
        default=0,
        metavar="N",
        help="with --vae: encode the stream's first N images once and train on them, a new order each pass "
        "(default 0: every image new, encoded at its step)",
    )
    q.add_argument(
        "--timestep-bias",
        type=positive_float,
        default=3.0,
        metavar="M",
        help="draw timesteps of T or more M times as often as the others (diffusers' 'later' timestep "
        "bias; default 3; 1: uniform, SD's recipe)",
    )
    q.add_argument(
        "--timestep-bias-from", type=nonnegative_int, default=900, metavar="T", help="... T, of 1000 (default 900)"
    )
    q.add_argument(
        "--layer",
        choices=LAYERS,
        default="last",
        help="text-encoder layer the U-Net reads: last (SD 1.x) or penultimate (SD 2.x's choice)",
    )
    q.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="auto",
        help="bf16: bfloat16 autocast on float32 weights (about 2x fp32's speed on a CPU with AMX, "
        "faster on a GPU; on the CPU it trained models that drew fewer pairs); bf16-fp32-ends: the "
        "same with the U-Net's first and last layers in float32 (as fast; pairs within the seeds' "
        "spread of fp32's, on four seeds); auto: bf16-fp32-ends on a GPU that has bfloat16, fp32 "
        "(what the shipped model was trained in) on a CPU",
    )
    q.add_argument(
        "--no-compile", action="store_true", help="skip torch.compile (saves its ~1-2 min start; trains slower)"
    )
    q.add_argument(
        "--checkpoints",
        metavar="DIR",
        help="write (and resume from) a checkpoint here; DIR/model holds its EMA "
        "weights as a mini SD, to eval or sample while the run goes on",
    )
    q.add_argument("--checkpoint-every", type=positive_int, default=200, help="steps between checkpoints")
    q.add_argument(
        "--keep-models-every",
        type=positive_int,
        metavar="N",
        help="with --checkpoints: also keep the EMA weights of every Nth step as DIR/model-N (a multiple "
        "of --checkpoint-every), to judge the run's course afterwards",
    )
    q.add_argument(
        "--vae",
        metavar="DIR",
        help="train a latent mini SD on this VAE's latents (a folder `sdkit minisd vae` wrote, or a pipeline "
        "folder's vae/): the model is then a stock diffusers StableDiffusionPipeline folder, its image size "
        "the VAE's, with no place embeddings (given --place-embeddings, an sdkit-only folder: a stock "
        "pipeline would sample it without them)",
    )
    q.add_argument("--cache", type=cache_folder, default=CACHE_DEFAULT, help=CACHE_HELP)
    encoder_options(q)
    add_json(q)
    q.set_defaults(minisd_func=cmd_minisd_train)

    q = add_subcommand(minisd_sub, "vae", "train the latent mini SD's VAE, or judge one's round trips")
    q.add_argument("--out", default="out/minisd-vae", help="save the trained VAE here (a new folder)")
    q.add_argument("--judge", metavar="DIR", help="judge this VAE's round trips instead of training one")
    q.add_argument("--steps", type=positive_int, default=1500, help="optimizer steps")
    q.add_argument("--batch-size", type=positive_int, default=16, help="images per step")
    q.add_argument("--lr", type=positive_float, default=1e-3, help="peak learning rate")
    q.add_argument(
        "--kl-weight",
        type=nonnegative_float,
        default=1e-6,
        help="weight of the KL term beside the L1 summed per image (SD's 1e-6 leaves the latents unregularised)",
    )
    q.add_argument("--seed", type=seed, default=0, help="seed of the data stream and initialisation")
    q.add_argument("--count", type=positive_int, default=64, help="judged round trips per set (singles, pairs)")
    q.add_argument("--checkpoints", metavar="DIR", help="write (and resume from) a checkpoint here")
    q.add_argument("--start-from", metavar="DIR", help="start from this trained VAE instead of random weights")
    q.add_argument(
        "--decoder-only",
        action="store_true",
        help="train the decoder alone (with --start-from): the latent space, and U-Nets trained on it, are kept",
    )
    q.add_argument(
        "--into",
        metavar="MODEL",
        help="then put the VAE into this latent mini SD folder in place of its own (only a decoder fine-tuned "
        "from the model's own VAE: the latents its U-Net read are kept)",
    )
    add_json(q)
    q.set_defaults(minisd_func=cmd_minisd_vae)

    q = add_subcommand(minisd_sub, "sample", "generate images for prompts, as a PNG grid")
    q.add_argument("prompts", nargs="+", help="captions, e.g. 'a red circle at the top left'")
    q.add_argument("--seeds", type=positive_int, default=8, help="images per prompt (seeds first-seed, +1, ...)")
    q.add_argument("--first-seed", type=seed, default=0, help="seed of the first image")
    q.add_argument("--out", default="minisd-samples.png", help="the PNG grid")
    q.add_argument("--overlays", metavar="DIR", help="also draw each word's cross-attention map over each image here")
    sampling_options(q)
    q.set_defaults(minisd_func=cmd_minisd_sample)

    q = add_subcommand(minisd_sub, "edit", "edit an image with Prompt-to-Prompt: source, regenerated and edited")
    q.add_argument("prompt", help="the source prompt, e.g. 'a red circle at the top left'")
    q.add_argument("--to", metavar="PROMPT", help="the edited prompt, e.g. 'a blue circle at the top left'")
    q.add_argument(
        "--reweight",
        type=_reweights,
        metavar="WORD=FACTOR",
        help="scale a word's attention in the edited prompt, e.g. blue=2.0 (comma-separated for several)",
    )
    q.add_argument(
        "--cross-replace",
        type=nonnegative_float,
        default=0.8,
        help="the fraction of steps whose cross-attention the edit reads from the source",
    )
    q.add_argument(
        "--self-replace",
        type=nonnegative_float,
        default=0.0,
        help="the fraction of steps whose coarse self-attention is the source's",
    )
    q.add_argument(
        "--local-blend",
        action="store_true",
        help="change only where the words the edit changed attend; elsewhere the source (P2P's local blending)",
    )
    q.add_argument(
        "--blend-threshold",
        type=nonnegative_float,
        default=0.3,
        help="--local-blend: the share of the words' peak attention a cell needs to be changed",
    )
    q.add_argument(
        "--source-states",
        action="store_true",
        help="the edited prompt's unchanged words read the source's token states (for a bidirectional text "
        "encoder such as the mini SD's, whose every state a swapped word changes; not in P2P)",
    )
    q.add_argument(
        "--unconditional",
        action="store_true",
        help="inject into the unconditional half of guidance too, for the same fractions of steps (not in P2P, "
        "which edits the conditional half only)",
    )
    q.add_argument(
        "--share-latents",
        type=nonnegative_float,
        default=0.0,
        help="the fraction of steps the edited branch is the source (its latents the source's), so the edit goes "
        "on from the source's layout (SDEdit-like; not in P2P)",
    )
    q.add_argument(
        "--seeds", type=at_most(256, "a picture holds 256 rows"), default=4, help="edits (seeds first-seed, +1, ...)"
    )
    q.add_argument("--first-seed", type=seed, default=0, help="seed of the first edit")
    q.add_argument(
        "--image",
        metavar="IMAGE",
        help="edit this real image instead (a latent mini SD): null-text inversion under the prompt, its caption",
    )
    q.add_argument(
        "--tuned-states-for",
        choices=("source", "both"),
        default="source",
        help="--image: the branches that read the inversion's tuned unconditional states (both: the paper's)",
    )
    q.add_argument(
        "--out",
        default="minisd-edit.png",
        help="the PNG: a row per seed of source, regenerated and edited (--image: one row, the image as "
        "inverted, redrawn, regenerated, edited)",
    )
    q.add_argument("--model", default="weights/minisd", help="a mini SD folder")
    q.add_argument("--guidance", type=guidance_scale, help=GUIDANCE_HELP)
    q.add_argument("--steps", type=positive_int, default=25, help="sampling steps")
    encoder_options(q)
    add_json(q)
    q.set_defaults(minisd_func=cmd_minisd_edit)

    q = add_subcommand(minisd_sub, "eval", "judge generated images against their captions, with floors")
    q.add_argument("--count", type=positive_int, default=64, help="prompts per set")
    q.add_argument("--sets", default="singles,pairs,held_out_singles,held_out_pairs", help="comma-separated sets")
    q.add_argument("--no-floors", action="store_true", help="skip the empty-prompt and untrained floors")
    q.add_argument("--panel", metavar="FILE.png", help="draw samples with the judge's verdicts here")
    q.add_argument(
        "--set-seed",
        type=seed,
        default=EVAL_SET_SEED,
        help="draw of the sets' captions: another seed gives other captions, to choose settings on one draw "
        "and report them on the default one",
    )
    sampling_options(q)
    q.set_defaults(minisd_func=cmd_minisd_eval)
