"""`sdkit adapter demo | train | encode`: swap the text encoder with a trained adapter (sdkit.adapter)."""

from __future__ import annotations

import json
import sys

from ..common import ADAPTERS_FOLDER, SdkitError
from .common import (
    ADAPTER_KINDS,
    CACHE_DEFAULT,
    CACHE_HELP,
    LAYERS,
    Parser,
    adapter_kinds,
    add_json,
    add_subcommand,
    at_most,
    cache_folder,
    check_input,
    check_outputs,
    minisd_spec,
    nonnegative_float,
    nonnegative_int,
    phase,
    positive_float,
    positive_int,
    progress_bar,
    refuse_options,
    seed,
    show_result,
)

MAX_PROMPTS = 200_000  # drawn prompts: past this, only repeats (which are merged) and hours of encoding


def cmd_adapter(args) -> None:
    from ..adapter import explanation

    if not args.adapter_command:
        phase.clear()
        print(explanation(args.explain_encoders_dir))
        return
    if "explain_encoders_dir" in args.given:  # the group's, which no subcommand reads
        raise SdkitError(
            f"--encoders-dir before '{args.adapter_command}' only says where `sdkit adapter` looks when it "
            f"explains itself; put it after the subcommand"
        )
    args.adapter_func(args)


def _train_config(args):
    from ..adapter import TrainConfig

    return TrainConfig(
        max_epochs=args.epochs,
        lr=args.lr,
        batch_size=args.batch_size,
        patience=args.patience,
        cosine_weight=args.cosine_weight,
        hidden_dim=args.hidden_dim,
        seed=args.seed,
    )


def _run_comparison(args, new_dir, old_dir, prompts, note: str | None = None) -> None:
    from ..adapter import compare_adapters, format_report
    from ..encoders import load_text_encoder
    from ..loading import load_unet
    from ..presets import PRESETS

    spec = minisd_spec(args.unet) if args.unet != "none" else None
    phase("loading the text encoders and the U-Net")
    # A mini SD reads a shorter context than SD's 77 tokens: both encoders are read at its length.
    length = {"context_length": spec.max_length} if spec else {}
    new = load_text_encoder(new_dir, layer=args.new_layer, allow_pickle=args.allow_pickle, **length)
    old = load_text_encoder(old_dir, layer=args.old_layer, allow_pickle=args.allow_pickle, **length)
    unet = load_unet(args.unet, allow_pickle=args.allow_pickle) if args.unet != "none" else None
    if spec:
        spec.check_unet(unet, args.unet)
    if spec and spec.place_embeddings:  # not in the weights file: a function of the shapes
        from ..minisd.pipeline import add_place_embeddings

        add_place_embeddings(unet, spec.image_size)
    kinds = args.kinds
    if spec:
        unet_name = f"{args.unet} (trained mini SD)"
    elif args.unet in PRESETS:
        unet_name = f"{args.unet} preset, RANDOM weights: shows the check, not a trained SD U-Net"
    else:
        unet_name = args.unet
    report = compare_adapters(
        new,
        old,
        prompts,
        kinds,
        _train_config(args),
        unet,
        unet_name,
        args.cache,
        args.out,
        args.checkpoints,
        seed=args.seed,
        progress=not args.json,
        # sdkit's own prompts (generated, or the mini SD's captions) may be cut to what the U-Net
        # reads, and the report says how many were; a user's corpus is refused instead
        cut_long_prompts=not getattr(args, "corpus", None),
    )
    table = format_report(report)
    if note:
        table = f"Encoders: {note}\n\n{table}"
    data = {"encoders": note, **report.to_json()}
    if spec and args.judge:
        from ..minisd.adapters import SETS, format_judged, judge_adapters
        from ..minisd.pipeline import MiniSDPipeline, load_vae, read_scheduler_config

        vae = load_vae(args.unet) if spec.space == "latents" else None
        pipe = MiniSDPipeline(unet, read_scheduler_config(args.unet), spec, old, vae)
        adapters = report.adapters
        total = args.judge * len(SETS) * (1 + len(adapters))
        with progress_bar(args, total=total, desc="judging", unit="image") as bar:
            judged = judge_adapters(pipe, new, adapters, count=args.judge, progress=bar)
        table += "\n\n" + format_judged(judged, args.unet)
        data["judged"] = judged
    show_result(args, data, table)


def _check_training_outputs(args) -> None:
    check_outputs(args, folders=("cache", "checkpoints"), owned={"out": ADAPTERS_FOLDER})
    if "judge" in args.given and args.judge and minisd_spec(args.unet) is None:  # 0: no judging, said plainly
        refuse_options(args, ("judge",), "without a mini SD as --unet (its answer key does the judging)")


def cmd_adapter_demo(args) -> None:
    _check_training_outputs(args)
    from ..adapter import available_pair, generate_prompts

    if args.full:  # the benchmark's run: more prompts and epochs, the numbers docs/commands/adapter.md reports
        args.prompts, args.epochs = max(args.prompts, 2400), max(args.epochs, 24)
        print("the full comparison takes about 15 minutes on 2 CPU cores", file=sys.stderr, flush=True)
    new_dir, old_dir, note = available_pair(args.encoders_dir, args.cache)
    _run_comparison(args, new_dir, old_dir, generate_prompts(args.prompts, seed=args.seed), note)


def cmd_adapter_train(args) -> None:
    _check_training_outputs(args)
    for flag in ("new", "old"):
        check_input(getattr(args, flag), f"--{flag}")
    from ..adapter import generate_prompts, read_prompts

    if args.corpus and args.captions:
        raise SdkitError("choose one of --corpus and --captions")
    if args.corpus or args.captions:
        refuse_options(args, ("generate",), "with --corpus or --captions (it counts generated prompts)")
    if args.captions:
        from ..minisd.adapters import training_captions

        prompts = training_captions(args.captions, seed=args.seed)
    else:
        prompts = read_prompts(args.corpus) if args.corpus else generate_prompts(args.generate, seed=args.seed)
    _run_comparison(args, args.new, args.old, prompts)


def cmd_adapter_encode(args) -> None:
    check_outputs(args, files=("out",))
    check_input(args.adapter, "--adapter")
    check_input(args.new, "--new")
    from safetensors.torch import save_file

    from ..adapter import adapted_embeddings, load_adapter
    from ..common import atomic_path
    from ..encoders import load_text_encoder

    adapter = load_adapter(args.adapter)
    encoder = load_text_encoder(args.new, layer=args.new_layer, allow_pickle=args.allow_pickle)
    tensors = {"prompt_embeds": adapted_embeddings(adapter, encoder, args.prompts).contiguous()}
    if args.negative is not None:
        negative = adapted_embeddings(adapter, encoder, [args.negative] * len(args.prompts))
        tensors["negative_prompt_embeds"] = negative.contiguous()
    with atomic_path(args.out) as tmp:
        save_file(tensors, str(tmp), metadata={"prompts": json.dumps(args.prompts), "adapter": str(args.adapter)})
    shapes = ", ".join(f"{k} {list(v.shape)}" for k, v in tensors.items())
    phase.clear()
    print(f"wrote {args.out}: {shapes}")


def register(sub) -> None:
    p = sub.add_parser(
        "adapter",
        help="swap the text encoder: train and score a new -> old adapter",
        description="Swap the text encoder of a frozen SD 1.x U-Net with a trained adapter. "
        "Without a subcommand, explains itself.",
    )
    p.set_defaults(func=cmd_adapter)
    p.add_argument(
        "--encoders-dir",
        dest="explain_encoders_dir",
        default="weights/encoders",
        help="without a subcommand: where the real encoders are looked for",
    )
    adapter_sub = p.add_subparsers(dest="adapter_command", metavar="SUBCOMMAND", parser_class=Parser)

    def training_options(q, default_out):
        q.add_argument(
            "--kinds",
            type=adapter_kinds,
            default="linear,mlp",
            help=f"adapters to train, comma-separated from {', '.join(ADAPTER_KINDS)} (lstsq always fits)",
        )
        q.add_argument(
            "--unet", default="tiny", help="frozen U-Net for the noise-prediction check (preset, folder, file, or none)"
        )
        q.add_argument("--new-layer", choices=LAYERS, default="last", help="layer read from the new encoder")
        q.add_argument(
            "--old-layer", choices=LAYERS, default="last", help="layer the U-Net was trained on (SD 1.x: last)"
        )
        q.add_argument("--epochs", type=positive_int, default=24, help="most training epochs")
        q.add_argument("--patience", type=positive_int, default=8, help="early stopping: epochs without improvement")
        q.add_argument("--lr", type=positive_float, default=2e-3, help="peak learning rate")
        q.add_argument("--batch-size", type=positive_int, default=256, help="tokens per batch")
        q.add_argument("--hidden-dim", type=positive_int, help="mlp hidden width (default: the old encoder's width)")
        q.add_argument(
            "--cosine-weight", type=nonnegative_float, default=0.0, help="add w * (1 - cosine) to the per-token MSE"
        )
        q.add_argument("--seed", type=seed, default=0, help="seed of the split, initialisation and data order")
        q.add_argument("--cache", type=cache_folder, default=CACHE_DEFAULT, help=CACHE_HELP)
        q.add_argument("--checkpoints", help="write (and resume from) training checkpoints here")
        q.add_argument("--out", default=default_out, help="save the adapters and report.json here")
        q.add_argument("--allow-pickle", action="store_true", help="read pickle weights (with weights_only=True)")
        q.add_argument(
            "--judge",
            type=nonnegative_int,
            default=64,
            help="with a mini SD as --unet: prompts per set to generate and judge through each adapter (0: skip)",
        )
        add_json(q)

    q = add_subcommand(adapter_sub, "demo", "the whole comparison on the best encoders available here (minutes)")
    q.add_argument(
        "--prompts",
        type=at_most(MAX_PROMPTS, "generated prompts repeat long before that"),
        default=300,
        help="generated prompts",
    )
    q.add_argument("--full", action="store_true", help="the benchmark-sized run: 2,400 prompts, 24 epochs")
    q.add_argument(
        "--encoders-dir",
        default="weights/encoders",
        help="where the real pair is (scripts/get_real_encoders.py puts it there); without it, tiny random "
        "encoders are built into the cache",
    )
    training_options(q, "weights/adapters/demo")
    q.set_defaults(adapter_func=cmd_adapter_demo)

    q = add_subcommand(adapter_sub, "train", "encode a corpus with both encoders, fit, train and score adapters")
    q.add_argument("--new", required=True, metavar="DIR", help="the new text encoder (transformers folder)")
    q.add_argument("--old", required=True, metavar="DIR", help="the encoder the U-Net was trained with")
    q.add_argument("--corpus", metavar="FILE", help="prompts, one per line (default: generated prompts)")
    q.add_argument(
        "--generate",
        type=at_most(MAX_PROMPTS, "generated prompts repeat long before that"),
        default=2000,
        help="how many prompts to generate without --corpus",
    )
    q.add_argument(
        "--captions",
        type=at_most(MAX_PROMPTS, "the mini SD has a few thousand distinct captions"),
        metavar="N",
        help="train on N of the mini SD's training captions instead of generic prompts",
    )
    training_options(q, "weights/adapters/latest")
    q.set_defaults(adapter_func=cmd_adapter_train)

    q = add_subcommand(adapter_sub, "encode", "write prompt embeddings for a frozen SD 1.x U-Net")
    q.add_argument("prompts", nargs="+", help="the prompts to encode")
    q.add_argument("--adapter", required=True, metavar="DIR", help="a saved adapter folder")
    q.add_argument("--new", required=True, metavar="DIR", help="the new text encoder the adapter reads")
    q.add_argument("--new-layer", choices=LAYERS, default="last", help="layer read from the new encoder")
    q.add_argument("--negative", help="also write negative_prompt_embeds for this prompt (e.g. '')")
    q.add_argument("--out", required=True, help="a .safetensors file")
    q.add_argument("--allow-pickle", action="store_true", help="read pickle weights (with weights_only=True)")
    q.set_defaults(adapter_func=cmd_adapter_encode)
