"""The `sdkit` command: a thin layer over the library; each subcommand calls library functions.

Arguments and output paths are checked before anything heavy is imported, so a mistake costs a
second, not the start-up of torch and diffusers.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import warnings

from .common import SdkitError, check_output, check_output_folder, parse_bytes, write_json

PRESET_NAMES = "sd15, sd21, sdxl, tiny, minisd"  # presets.PRESETS, without importing torch to say so
# The file that marks a folder as one sdkit wrote (minisd.pipeline.SPEC_FILE, adapter.REPORT_FILE,
# conditioning.MAPS_FILE), named here so that outputs are checked before torch is imported.
MODEL_MARKER, ADAPTERS_MARKER, MAPS_MARKER = "minisd.json", "report.json", "maps.json"


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except where there is none to show."""

    def _get_help_string(self, action):
        # Identity, not ==: a default of 0 or 0.0 equals False and is still worth showing.
        if any(action.default is none for none in (None, False, argparse.SUPPRESS)) or "%(default)" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)

    def error(self, message):  # one line, like every other input error
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# --- argument types: refuse what would silently become something else ------------------------------


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, not {value}")
    return value


def nonnegative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {value}")
    return value


def positive_float(text: str) -> float:
    value = _finite(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, not {text}")
    return value


def nonnegative_float(text: str) -> float:
    value = _finite(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {text}")
    return value


def _finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, not {text}")
    return value


def _sides(text: str) -> tuple[int, ...]:
    try:
        sides = tuple(int(side) for side in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of grid sides: {text!r} (e.g. 16,32)") from None
    if any(side <= 0 for side in sides):
        raise argparse.ArgumentTypeError(f"grid sides must be positive: {text!r}")
    return sides


def _latent_size(text: str) -> tuple[int, int]:
    h, _, w = text.lower().partition("x")
    try:
        size = int(h), int(w or h)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a latent size: {text!r} (e.g. 64 or 64x96)") from None
    if min(size) <= 0:
        raise argparse.ArgumentTypeError(f"latent sides must be positive: {text!r}")
    return size


# --- output ----------------------------------------------------------------------------------------------


def _add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout instead of the table")
    p.add_argument("--json-out", metavar="FILE", help="also write the result as JSON to FILE (the table still prints)")


def _report(args, data: dict, table: str) -> None:
    """The table for people, or JSON on stdout with --json; and JSON to --json-out when given."""
    if args.json_out:
        write_json(args.json_out, data)
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        print(table)
        if args.json_out:
            print(f"wrote {args.json_out}")


def _bar(args, **kwargs):
    """A progress bar on stderr, for people: none with --json or when stderr is not a terminal
    (logs and pipes get the result, not bar redraws)."""
    from tqdm import tqdm

    return tqdm(leave=False, disable=True if getattr(args, "json", False) else None, **kwargs)


def _check_outputs(args, files=(), folders=(), owned: dict | None = None, inputs=()) -> None:
    """Check every output path the command will write, before it starts working.

    files: flags naming output files; folders: flags naming folders the command adds its own files
    to (caches, checkpoints); owned: flag -> marker file, for folders the command writes as a whole
    (a model, adapters, maps): new, empty, or written by sdkit before. inputs: what the command
    reads, which no output may overwrite."""
    if getattr(args, "json_out", None):
        check_output(args.json_out, "--json-out file", inputs=inputs)
    for flag in files:
        if getattr(args, flag, None):
            check_output(getattr(args, flag), f"--{flag.replace('_', '-')} file", inputs=inputs)
    for flag in folders:
        if getattr(args, flag, None):
            check_output(getattr(args, flag), f"--{flag.replace('_', '-')} folder", folder=True)
    for flag, marker in (owned or {}).items():
        if getattr(args, flag, None):
            check_output_folder(getattr(args, flag), marker, f"--{flag.replace('_', '-')} folder", inputs=inputs)


def _check_input(path: str, what: str) -> None:
    """A missing input, said before the heavy imports (a hub id is looked up in the cache later)."""
    from pathlib import Path

    from .checkpoints import HUB_ID

    if not Path(path).exists() and not HUB_ID.fullmatch(str(path)):
        raise SdkitError(f"{path}: no such file or folder ({what})")


# --- commands ------------------------------------------------------------------------------------------------


def cmd_audit(args) -> None:
    _check_outputs(args, inputs=[args.model])
    from .audit import audit, format_audit

    result = audit(args.model, allow_pickle=args.allow_pickle, context_dim=args.context_dim, image_size=args.image_size)
    _report(args, result.to_json(), format_audit(result))


def cmd_scoretable(args) -> None:
    _check_outputs(args, files=("plot",))
    from .scoretable import (format_measurements, format_score_tables, measure, plot, resolve_device,
                             score_tables)  # fmt: skip

    height = args.height if args.height is not None else args.size
    width = args.width if args.width is not None else height
    tables = score_tables(height, width, args.preset, args.dtype, args.batch, args.cfg)
    measured = []
    if args.measure:
        finest = tables.levels[0]
        device = resolve_device(args.device)
        dtype = args.measure_dtype or ("float16" if device.startswith("cuda") else "float32")
        implementations = args.implementations.split(",")
        with _bar(args, total=len(implementations), desc="measuring", unit="impl") as bar:
            measured = measure(args.tokens or finest.tokens, args.heads or finest.heads,
                               args.head_dim or finest.head_dim, dtype, device, implementations,
                               args.chunk_budget, args.budget, args.repeats, progress=bar)  # fmt: skip
    if args.plot:
        plot(tables, measured, args.plot, args.chunk_budget)
    from dataclasses import asdict

    table = format_score_tables(tables)
    if measured:
        table += "\n\n" + format_measurements(measured)
    if args.plot:
        table += f"\n\nwrote {args.plot}"
    _report(args, {**tables.to_json(), "measured": [asdict(m) for m in measured]}, table)


def _timesteps(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(t) for t in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of timesteps: {text!r} (e.g. 100,500,900)") from None
    if any(not 0 <= t < 1000 for t in values):
        raise argparse.ArgumentTypeError(f"timesteps are 0 to 999: {text!r}")
    return values


def _minisd_spec(unet: str):
    """The mini SD spec when `unet` is a mini SD folder, else None."""
    from pathlib import Path

    from .minisd.pipeline import SPEC_FILE, MiniSDSpec

    return MiniSDSpec.read(unet) if (Path(unet) / SPEC_FILE).is_file() else None


def _minisd_findings(args) -> None:
    """condition --masks / --generate: measured on a mini SD, whose generator is the answer key."""
    from pathlib import Path

    from .minisd.pipeline import SPEC_FILE, MiniSDPipeline

    if _minisd_spec(args.unet) is None:
        raise SdkitError(f"{args.unet}: --masks and --generate need a mini SD folder (with {SPEC_FILE}): the answer "
                         "key is its generator's masks and judge (try --unet weights/minisd)")  # fmt: skip
    pipe = MiniSDPipeline.from_pretrained(args.unet, args.text_encoder, args.encoders_dir, allow_pickle=args.allow_pickle)
    if args.masks:
        from .localization import draw_examples, format_localization, generated_set, generator_set, localize

        reports, tables = [], []
        for source in ("generator", "generated"):
            with _bar(args, total=args.count * len(args.timesteps), desc=f"maps on {source} images", unit="image") as bar:
                if source == "generator":
                    images, scenes, masks = generator_set(args.count, pipe.spec.image_size)
                else:
                    images, scenes, masks = generated_set(pipe, args.count, args.guidance, args.steps)
                report = localize(pipe, images, scenes, masks, args.timesteps, model_name=args.unet, source=source,
                                  progress=bar)  # fmt: skip
            if source == "generated":
                found = sum(m is not None for ms in masks for m in ms)
                report.note = f"judge found {found} of {sum(len(ms) for ms in masks)} named objects in the generated images"
            reports.append(report)
            tables.append(format_localization(report))
            if args.plot:
                stem = Path(args.plot)
                draw_examples(report, stem.with_name(f"{stem.stem}-{source}{stem.suffix or '.png'}"))
        _report(args, {"localization": [r.to_json() for r in reports]}, "\n\n".join(tables))
        return
    from .minisd.conditions import CONDITIONS, SETS, compare_token_conditions, draw_comparison, format_token_comparison

    pooled = None
    if args.pooled_model:
        pooled = MiniSDPipeline.from_pretrained(args.pooled_model, args.text_encoder, args.encoders_dir,
                                                allow_pickle=args.allow_pickle)  # fmt: skip
    runs = len(SETS) * args.count * (len(CONDITIONS) + (pooled is not None))
    with _bar(args, total=runs, desc="generating", unit="image") as bar:
        result = compare_token_conditions(pipe, pooled, args.count, args.guidance, args.steps, model_name=args.unet,
                                          pooled_name=args.pooled_model, progress=bar)  # fmt: skip
    table = format_token_comparison(result)
    if args.plot:
        draw_comparison(result, args.plot)
        table += f"\nwrote {args.plot}"
    _report(args, result.to_json(), table)


def cmd_condition(args) -> None:
    _check_outputs(args, files=("plot",), owned={"maps": MAPS_MARKER},
                   inputs=[args.unet, args.text_encoder, args.tokenizer, args.pooled_model])
    if args.masks and args.generate:
        raise SdkitError("choose one of --masks and --generate")
    if args.tokenizer and not args.text_encoder:
        raise SdkitError("--tokenizer needs --text-encoder (the tokenizer labels the encoder's tokens)")
    if args.unet not in PRESET_NAMES.split(", "):
        _check_input(args.unet, "--unet")
    if args.masks or args.generate:
        if args.pooled_model:
            _check_input(args.pooled_model, "--pooled-model")
        return _minisd_findings(args)
    if args.text_encoder:
        _check_input(args.text_encoder, "--text-encoder")
    from .conditioning import (check_width, compare_conditionings, format_comparison, preflight,
                               prompt_conditionings, synthetic_conditionings, write_maps)  # fmt: skip
    from .encoders import load_text_encoder
    from .loading import load_unet
    from .presets import PRESETS
    from .scoretable import resolve_device

    device = resolve_device(args.device)
    unet = load_unet(args.unet, allow_pickle=args.allow_pickle)
    preflight(unet, args.latent_size, device, maps=bool(args.maps))
    unet = unet.to(device)
    note = "preset with RANDOM weights: the numbers show the mechanism, not what a trained model reads" \
        if args.unet in PRESETS else ""  # fmt: skip
    spec = _minisd_spec(args.unet)
    if spec is not None:  # a mini SD reads its own encoder, at its own context length
        from .minisd.pipeline import find_text_encoder

        note = f"trained mini SD, pixel space, reading {spec.text_encoder} ({spec.max_length} tokens)"
        encoder = find_text_encoder(spec, args.text_encoder, args.encoders_dir, args.allow_pickle)
        conditioning = prompt_conditionings(encoder, args.prompt)
    elif args.text_encoder:
        encoder = load_text_encoder(args.text_encoder, args.tokenizer, layer=args.layer,
                                    allow_pickle=args.allow_pickle)  # fmt: skip
        conditioning = prompt_conditionings(encoder, args.prompt)
    else:
        conditioning = synthetic_conditionings(unet.config.cross_attention_dim, seed=args.seed)
    check_width(unet, conditioning)
    with _bar(args, total=len(conditioning.cases), desc="forward passes", unit="case") as bar:
        result = compare_conditionings(unet, conditioning, args.latent_size, args.timestep, args.seed,
                                       maps=bool(args.maps), map_sides=args.map_sides, unet_name=args.unet, note=note,
                                       progress=bar)  # fmt: skip
    table = format_comparison(result)
    if args.maps:
        paths = write_maps(result, conditioning, args.maps, shared_scale=args.shared_scale)
        table += f"\n\nwrote {len(paths)} PNG maps to {args.maps} (overview: {paths[-1]})"
    _report(args, result.to_json(), table)


def cmd_adapter(args) -> None:
    from .adapter import explanation

    if not args.adapter_command:
        print(explanation(args.encoders_dir))
        return
    args.adapter_func(args)


def _train_config(args):
    from .adapter import TrainConfig

    return TrainConfig(max_epochs=args.epochs, lr=args.lr, batch_size=args.batch_size, patience=args.patience,
                       cosine_weight=args.cosine_weight, hidden_dim=args.hidden_dim, seed=args.seed)  # fmt: skip


def _run_comparison(args, new_dir, old_dir, prompts, note: str | None = None) -> None:
    from .adapter import compare_adapters, format_report
    from .encoders import load_text_encoder
    from .loading import load_unet
    from .presets import PRESETS

    spec = _minisd_spec(args.unet) if args.unet != "none" else None
    # A mini SD reads a shorter context than SD's 77 tokens: both encoders are read at its length.
    length = {"context_length": spec.max_length} if spec else {}
    new = load_text_encoder(new_dir, layer=args.new_layer, allow_pickle=args.allow_pickle, **length)
    old = load_text_encoder(old_dir, layer=args.old_layer, allow_pickle=args.allow_pickle, **length)
    unet = load_unet(args.unet, allow_pickle=args.allow_pickle) if args.unet != "none" else None
    kinds = [k for k in args.kinds.split(",") if k]
    if spec:
        unet_name = f"{args.unet} (trained mini SD)"
    elif args.unet in PRESETS:
        unet_name = f"{args.unet} preset, RANDOM weights: shows the check, not a trained SD U-Net"
    else:
        unet_name = args.unet
    report = compare_adapters(new, old, prompts, kinds, _train_config(args), unet, unet_name, args.cache,
                              args.out, args.checkpoints, seed=args.seed, progress=not args.json)  # fmt: skip
    table = format_report(report)
    if note:
        table = f"Encoders: {note}\n\n{table}"
    data = {"encoders": note, **report.to_json()}
    if spec and args.judge:
        from .minisd.adapters import SETS, format_judged, judge_adapters
        from .minisd.pipeline import MiniSDPipeline, read_scheduler_config

        pipe = MiniSDPipeline(unet, read_scheduler_config(args.unet), spec, old)
        adapters = report.adapters
        total = args.judge * len(SETS) * (1 + len(adapters))
        with _bar(args, total=total, desc="judging", unit="image") as bar:
            judged = judge_adapters(pipe, new, adapters, count=args.judge, progress=bar)
        table += "\n\n" + format_judged(judged, args.unet)
        data["judged"] = judged
    _report(args, data, table)


def _check_training_outputs(args, inputs=()) -> None:
    _check_outputs(args, folders=("cache", "checkpoints"), owned={"out": ADAPTERS_MARKER},
                   inputs=[args.unet, *inputs])  # fmt: skip


def cmd_adapter_demo(args) -> None:
    _check_training_outputs(args)
    from .adapter import available_pair, generate_prompts

    if args.full:  # the benchmark's run: more prompts and epochs, the numbers the README reports
        args.prompts, args.epochs = max(args.prompts, 2400), max(args.epochs, 24)
        print("the full comparison takes about 15 minutes on 2 CPU cores", file=sys.stderr, flush=True)
    new_dir, old_dir, note = available_pair(args.encoders_dir)
    _run_comparison(args, new_dir, old_dir, generate_prompts(args.prompts, seed=args.seed), note)


def cmd_adapter_train(args) -> None:
    _check_training_outputs(args, inputs=[args.new, args.old, args.corpus])
    for flag in ("new", "old"):
        _check_input(getattr(args, flag), f"--{flag}")
    from .adapter import generate_prompts, read_prompts

    if args.corpus and args.captions:
        raise SdkitError("choose one of --corpus and --captions")
    if args.captions:
        from .minisd.adapters import training_captions

        prompts = training_captions(args.captions, seed=args.seed)
    else:
        prompts = read_prompts(args.corpus) if args.corpus else generate_prompts(args.generate, seed=args.seed)
    _run_comparison(args, args.new, args.old, prompts)


def cmd_adapter_encode(args) -> None:
    check_output(args.out, "--out file", inputs=[args.adapter, args.new])
    _check_input(args.adapter, "--adapter")
    _check_input(args.new, "--new")
    from safetensors.torch import save_file

    from .adapter import adapted_embeddings, load_adapter
    from .common import atomic_path
    from .encoders import load_text_encoder

    adapter = load_adapter(args.adapter)
    encoder = load_text_encoder(args.new, layer=args.new_layer, allow_pickle=args.allow_pickle)
    tensors = {"prompt_embeds": adapted_embeddings(adapter, encoder, args.prompts).contiguous()}
    if args.negative is not None:
        negative = adapted_embeddings(adapter, encoder, [args.negative] * len(args.prompts))
        tensors["negative_prompt_embeds"] = negative.contiguous()
    with atomic_path(args.out) as tmp:
        save_file(tensors, str(tmp), metadata={"prompts": json.dumps(args.prompts), "adapter": str(args.adapter)})
    shapes = ", ".join(f"{k} {list(v.shape)}" for k, v in tensors.items())
    print(f"wrote {args.out}: {shapes}")


def cmd_minisd(args) -> None:
    if not args.minisd_command:
        from .minisd import explanation

        print(explanation(args.model, args.encoders_dir))
        return
    args.minisd_func(args)


def cmd_minisd_train(args) -> None:
    _check_outputs(args, folders=("cache", "checkpoints"), owned={"out": MODEL_MARKER},
                   inputs=[args.text_encoder, args.encoders_dir])  # fmt: skip
    from .encoders import load_text_encoder
    from .minisd.train import TrainSettings, train

    settings = TrainSettings(steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
                             image_size=args.image_size, conditioning=args.conditioning,
                             empty_fraction=args.empty_fraction, pair_fraction=args.pair_fraction,
                             precision=args.precision, compile=not args.no_compile)  # fmt: skip
    settings.check()
    folder = args.text_encoder or os.path.join(args.encoders_dir, "all-MiniLM-L6-v2")
    _check_input(folder, "the text encoder; python scripts/get_real_encoders.py puts it in weights/encoders")
    encoder = load_text_encoder(folder, allow_pickle=args.allow_pickle)
    result = train(args.out, encoder, settings, checkpoint_dir=args.checkpoints, checkpoint_every=args.checkpoint_every,
                   cache_dir=args.cache, progress=not args.json)  # fmt: skip
    from dataclasses import asdict

    resumed = f", resumed from step {result.resumed_from}" if result.resumed_from else ""
    last = result.history[-1]["loss"] if result.history else float("nan")
    table = (f"trained {result.steps} steps{resumed} in {result.seconds:.0f} s ({result.samples_per_second:.1f} "
             f"samples/s); last loss {last:.4f}\nsaved the EMA weights to {result.folder}")  # fmt: skip
    _report(args, asdict(result), table)


def _pipeline(args):
    from .minisd.pipeline import MiniSDPipeline

    _check_input(args.model, "--model")
    return MiniSDPipeline.from_pretrained(args.model, args.text_encoder, args.encoders_dir, allow_pickle=args.allow_pickle)


def cmd_minisd_sample(args) -> None:
    _check_outputs(args, files=("out",), inputs=[args.model, args.text_encoder])
    from .minisd.evaluate import sample_grid

    pipe = _pipeline(args)
    prompts = [p for p in args.prompts for _ in range(args.seeds)]
    seeds = [args.first_seed + s for _ in args.prompts for s in range(args.seeds)]
    with _bar(args, total=len(prompts), desc="sampling", unit="image") as bar:
        out = pipe(prompts, seeds, args.guidance, args.steps, args.sampler, progress=bar)
    title = f"{args.model}: {args.sampler} {args.steps} steps, guidance {args.guidance:g}"
    sample_grid(out.images, prompts, seeds, args.out, title)
    _report(args, {"model": args.model, "prompts": prompts, "seeds": seeds, "guidance_scale": args.guidance,
                   "steps": args.steps, "sampler": args.sampler, "grid": args.out},
            f"wrote {len(prompts)} images to {args.out} ({title})")  # fmt: skip


def cmd_minisd_eval(args) -> None:
    _check_outputs(args, files=("panel",), inputs=[args.model, args.text_encoder])
    from .minisd.evaluate import SETS, draw_panel, evaluate, format_evaluation

    sets = [s for s in args.sets.split(",") if s]
    unknown = set(sets) - set(SETS)
    if unknown:
        raise SdkitError(f"unknown prompt set {sorted(unknown)[0]!r}; choose from {', '.join(SETS)}")
    pipe = _pipeline(args)
    images = args.count * len(sets) * (1 if args.no_floors else 3)
    with _bar(args, total=images, desc="generating", unit="image") as bar:
        ev = evaluate(pipe, sets, args.count, args.guidance, args.steps, args.sampler, floors=not args.no_floors,
                      model_name=args.model, progress=bar)  # fmt: skip
    table = format_evaluation(ev)
    if args.panel:
        draw_panel(ev, args.panel)
        table += f"\nwrote {args.panel}"
    _report(args, ev.to_json(), table)


def cmd_memory(args) -> None:
    _check_outputs(args, files=("plot",), inputs=[args.minisd])
    from .memory import format_report, plot, run

    with _bar(args, desc="memories scored", unit="mem", unit_scale=True) as bar:
        report = run(args.quick, args.encoders_dir, args.minisd, progress=bar)
    table = format_report(report)
    if args.plot:
        plot(report, args.plot)
        table += f"\nwrote {args.plot}"
    _report(args, report.to_json(), table)


# --- the parser ----------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="sdkit", description="Look inside the cross-attention of Stable "
                                     "Diffusion 1.x U-Nets (and SD 2.x / SDXL). Offline; see README.md.")  # fmt: skip
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

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
    _add_json(p)
    p.set_defaults(func=cmd_audit)

    p = sub.add_parser("scoretable", help="score-table sizes: the latent grid against pixel-level attention",
                       description="Exact self-attention score-table sizes per U-Net level and for a pixel-level "
                                   "model; with --measure, one attention run naive, chunked and with SDPA.")  # fmt: skip
    p.add_argument("--size", type=positive_int, default=512, help="square image side in pixels")
    p.add_argument("--height", type=positive_int, help="image height (with --width, for non-square images)")
    p.add_argument("--width", type=positive_int, help="image width (default: the height)")
    p.add_argument("--preset", default="sd15", help="U-Net whose levels, heads and head sizes to use")
    p.add_argument("--batch", type=positive_int, default=1, help="images per batch")
    p.add_argument("--cfg", action="store_true", help="classifier-free guidance (doubles the batch)")
    p.add_argument("--dtype", default="float16", help="dtype of the analytic tables")
    p.add_argument("--measure", action="store_true", help="also run one self-attention and measure it")
    p.add_argument("--tokens", type=positive_int, help="tokens to measure at (default: the finest latent level)")
    p.add_argument("--heads", type=positive_int, help="heads to measure with (default: the finest level's)")
    p.add_argument("--head-dim", type=positive_int, help="head size to measure with (default: the finest level's)")
    p.add_argument("--measure-dtype", help="dtype to measure in (default: float16 on CUDA, float32 on CPU)")
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu or cuda")
    p.add_argument("--implementations", default="naive,chunked,sdpa", help="comma-separated subset")
    p.add_argument("--budget", type=parse_bytes, help="memory to allow (default: what the device has free)")
    p.add_argument("--chunk-budget", type=parse_bytes, default="64MiB", help="bytes of scores per chunk")
    p.add_argument("--repeats", type=positive_int, default=3, help="timed runs per implementation (median reported)")
    p.add_argument("--plot", metavar="FILE.png", help="draw tokens against bytes, log-log")
    _add_json(p)
    p.set_defaults(func=cmd_scoretable)

    p = sub.add_parser("condition", help="single- vs multi-token conditioning, seen in the cross-attention",
                       description="Run one U-Net, latent and timestep under single-token, repeated-token and "
                                   "multi-token conditioning and trace every cross-attention layer.")  # fmt: skip
    p.add_argument("--unet", default="tiny", help="preset (random weights), diffusers folder or checkpoint")
    p.add_argument("--prompt", default="a photo of a red cat sitting on a blue chair",
                   help="the prompt to encode (for a mini SD, try 'a red circle to the left of a blue square')")  # fmt: skip
    p.add_argument("--text-encoder", metavar="DIR", help="local transformers text encoder (or SD pipeline folder)")
    p.add_argument("--tokenizer", metavar="DIR", help="its tokenizer, when not beside it")
    p.add_argument("--layer", default="last", help="text-encoder layer the U-Net reads: last (SD 1.x) or penultimate (SD 2.x)")
    p.add_argument("--latent-size", type=_latent_size, help="latent grid, e.g. 64 or 64x96 (default: the U-Net's sample size)")
    p.add_argument("--timestep", type=nonnegative_int, default=500, help="diffusion timestep of the forward pass")
    p.add_argument("--seed", type=int, default=0, help="seed of the latent (and of synthetic tokens)")
    p.add_argument("--maps", metavar="DIR", help="write a PNG heatmap per word and an overview grid here")
    p.add_argument("--shared-scale", action="store_true", help="one colour scale for all maps")
    p.add_argument("--map-sides", type=_sides, help="only layers with these grid sides in the maps, e.g. 16,32")
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu or cuda")
    p.add_argument("--allow-pickle", action="store_true", help="read pickle weights (with weights_only=True)")
    p.add_argument("--masks", action="store_true",
                   help="mini SD: score each colour and shape word's attention map against its object's mask")  # fmt: skip
    p.add_argument("--generate", action="store_true",
                   help="mini SD: generate and judge images under one-token and many-token conditioning")  # fmt: skip
    p.add_argument("--count", type=positive_int, default=64, help="--masks/--generate: images per set")
    p.add_argument("--timesteps", type=_timesteps, default=(100, 300, 500, 700, 900),
                   help="--masks: timesteps to noise the images to (comma-separated)")  # fmt: skip
    p.add_argument("--pooled-model", metavar="DIR", help="--generate: a mini SD trained on the pooled state only")
    p.add_argument("--guidance", type=nonnegative_float, default=4.0, help="--masks/--generate: guidance scale")
    p.add_argument("--steps", type=positive_int, default=25, help="--masks/--generate: sampling steps")
    p.add_argument("--encoders-dir", default="weights/encoders", help="where the mini SD's text encoder is")
    p.add_argument("--plot", metavar="FILE.png", help="--masks/--generate: the picture")
    _add_json(p)
    p.set_defaults(func=cmd_condition)

    p = sub.add_parser("adapter", help="swap the text encoder: train and score a new -> old adapter",
                       description="Swap the text encoder of a frozen SD 1.x U-Net with a trained adapter. "
                                   "Without a subcommand, explains itself.")  # fmt: skip
    p.set_defaults(func=cmd_adapter)
    p.add_argument("--encoders-dir", default="weights/encoders", help=argparse.SUPPRESS)
    adapter_sub = p.add_subparsers(dest="adapter_command", metavar="SUBCOMMAND", parser_class=_Parser)

    def training_options(q, default_out):
        q.add_argument("--kinds", default="linear,mlp", help="adapters to train")
        q.add_argument("--unet", default="tiny", help="frozen U-Net for the noise-prediction check (preset, folder, "
                                                      "file, or none)")  # fmt: skip
        q.add_argument("--new-layer", default="last", help="layer read from the new encoder (last or penultimate)")
        q.add_argument("--old-layer", default="last", help="layer the U-Net was trained on (SD 1.x: last)")
        q.add_argument("--epochs", type=positive_int, default=24, help="most training epochs")
        q.add_argument("--patience", type=positive_int, default=8, help="early stopping: epochs without improvement")
        q.add_argument("--lr", type=positive_float, default=2e-3, help="peak learning rate")
        q.add_argument("--batch-size", type=positive_int, default=256, help="tokens per batch")
        q.add_argument("--hidden-dim", type=positive_int, help="mlp hidden width (default: the old encoder's width)")
        q.add_argument("--cosine-weight", type=nonnegative_float, default=0.0,
                       help="add w * (1 - cosine) to the per-token MSE")  # fmt: skip
        q.add_argument("--seed", type=int, default=0, help="seed of the split, initialisation and data order")
        q.add_argument("--cache", default="weights/cache", help="where encoded states are cached")
        q.add_argument("--checkpoints", help="write (and resume from) training checkpoints here")
        q.add_argument("--out", default=default_out, help="save the adapters and report.json here")
        q.add_argument("--allow-pickle", action="store_true", help="read pickle weights (with weights_only=True)")
        q.add_argument("--judge", type=nonnegative_int, default=64,
                       help="with a mini SD as --unet: prompts per set to generate and judge through each adapter "
                            "(0: skip)")  # fmt: skip
        _add_json(q)

    q = adapter_sub.add_parser("demo", help="the whole comparison on the best encoders available here (minutes)")
    q.add_argument("--prompts", type=positive_int, default=300, help="generated prompts")
    q.add_argument("--full", action="store_true", help="the benchmark-sized run: 2,400 prompts, 24 epochs")
    q.add_argument("--encoders-dir", default="weights/encoders", help="where to look for (or build) encoders")
    training_options(q, "weights/adapters/demo")
    q.set_defaults(adapter_func=cmd_adapter_demo)

    q = adapter_sub.add_parser("train", help="encode a corpus with both encoders, fit, train and score adapters")
    q.add_argument("--new", required=True, metavar="DIR", help="the new text encoder (transformers folder)")
    q.add_argument("--old", required=True, metavar="DIR", help="the encoder the U-Net was trained with")
    q.add_argument("--corpus", metavar="FILE", help="prompts, one per line (default: generated prompts)")
    q.add_argument("--generate", type=positive_int, default=2000, help="how many prompts to generate without --corpus")
    q.add_argument("--captions", type=positive_int, metavar="N",
                   help="train on N of the mini SD's training captions instead of generic prompts")  # fmt: skip
    training_options(q, "weights/adapters/latest")
    q.set_defaults(adapter_func=cmd_adapter_train)

    q = adapter_sub.add_parser("encode", help="write prompt embeddings for a frozen SD 1.x U-Net")
    q.add_argument("prompts", nargs="+", help="the prompts to encode")
    q.add_argument("--adapter", required=True, metavar="DIR", help="a saved adapter folder")
    q.add_argument("--new", required=True, metavar="DIR", help="the new text encoder the adapter reads")
    q.add_argument("--new-layer", default="last", help="layer read from the new encoder (last or penultimate)")
    q.add_argument("--negative", help="also write negative_prompt_embeds for this prompt (e.g. '')")
    q.add_argument("--out", required=True, help="a .safetensors file")
    q.add_argument("--allow-pickle", action="store_true", help="read pickle weights (with weights_only=True)")
    q.set_defaults(adapter_func=cmd_adapter_encode)

    p = sub.add_parser("minisd", help="the mini Stable Diffusion trained here: train, sample, judge",
                       description="A small SD-1.x-shaped U-Net on 32x32 pixels, conditioned on all-MiniLM-L6-v2 "
                                   "token states, trained on captioned shapes whose masks are known. Without a "
                                   "subcommand, explains itself.")  # fmt: skip
    p.set_defaults(func=cmd_minisd)
    p.add_argument("--model", default="weights/minisd", help=argparse.SUPPRESS)
    p.add_argument("--encoders-dir", default="weights/encoders", help=argparse.SUPPRESS)
    minisd_sub = p.add_subparsers(dest="minisd_command", metavar="SUBCOMMAND", parser_class=_Parser)

    def encoder_options(q):
        q.add_argument("--text-encoder", metavar="DIR", help="the text encoder folder (default: the model's, "
                                                               "from --encoders-dir)")  # fmt: skip
        q.add_argument("--encoders-dir", default="weights/encoders", help="where the real encoders are")
        q.add_argument("--allow-pickle", action="store_true", help="read pickle weights (with weights_only=True)")

    def sampling_options(q):
        q.add_argument("--model", default="weights/minisd", help="a mini SD folder")
        q.add_argument("--guidance", type=nonnegative_float, default=4.0, help="classifier-free guidance scale")
        q.add_argument("--steps", type=positive_int, default=25, help="sampling steps")
        q.add_argument("--sampler", choices=("ddim", "dpm"), default="ddim", help="DDIM or DPM-Solver++")
        encoder_options(q)
        _add_json(q)

    q = minisd_sub.add_parser("train", help="train a mini SD (the shipped one: the defaults, ~23 min on 2 CPU cores)")
    q.add_argument("--out", default="out/minisd",
                   help="save the model folder here: a new or empty folder, or a mini SD folder, whose model is "
                        "replaced (other files in it are kept); the shipped model is weights/minisd")  # fmt: skip
    q.add_argument("--steps", type=positive_int, default=1600, help="optimizer steps")
    q.add_argument("--batch-size", type=positive_int, default=32, help="images per step")
    q.add_argument("--lr", type=positive_float, default=1e-3, help="peak learning rate")
    q.add_argument("--seed", type=int, default=0, help="seed of the data stream, noise and initialisation")
    q.add_argument("--image-size", type=positive_int, default=32, help="image side in pixels (32 or 64)")
    q.add_argument("--conditioning", choices=("tokens", "pooled"), default="tokens",
                   help="tokens: every token state; pooled: their mean, one key/value")  # fmt: skip
    q.add_argument("--empty-fraction", type=nonnegative_float, default=0.1, help="captions dropped for guidance")
    q.add_argument("--pair-fraction", type=nonnegative_float, default=0.5, help="images with two objects")
    q.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto",
                   help="bf16: bfloat16 autocast on float32 weights; auto: bf16 where the device computes it natively")
    q.add_argument("--no-compile", action="store_true", help="skip torch.compile (saves its ~1-2 min start; trains slower)")
    q.add_argument("--checkpoints", metavar="DIR", help="write (and resume from) a checkpoint here")
    q.add_argument("--checkpoint-every", type=positive_int, default=200, help="steps between checkpoints")
    q.add_argument("--cache", default="weights/cache", help="where the caption states are cached")
    encoder_options(q)
    _add_json(q)
    q.set_defaults(minisd_func=cmd_minisd_train)

    q = minisd_sub.add_parser("sample", help="generate images for prompts, as a PNG grid")
    q.add_argument("prompts", nargs="+", help="captions, e.g. 'a red circle at the top left'")
    q.add_argument("--seeds", type=positive_int, default=8, help="images per prompt (seeds first-seed, +1, ...)")
    q.add_argument("--first-seed", type=int, default=0, help="seed of the first image")
    q.add_argument("--out", default="minisd-samples.png", help="the PNG grid")
    sampling_options(q)
    q.set_defaults(minisd_func=cmd_minisd_sample)

    q = minisd_sub.add_parser("eval", help="judge generated images against their captions, with floors")
    q.add_argument("--count", type=positive_int, default=64, help="prompts per set")
    q.add_argument("--sets", default="singles,pairs,held_out_singles,held_out_pairs", help="comma-separated sets")
    q.add_argument("--no-floors", action="store_true", help="skip the empty-prompt and untrained floors")
    q.add_argument("--panel", metavar="FILE.png", help="draw samples with the judge's verdicts here")
    sampling_options(q)
    q.set_defaults(minisd_func=cmd_minisd_eval)

    p = sub.add_parser("memory", help="attention as key-value memory: capacity of linear, ReLU and softmax stores",
                       description="Measure how many random (and real) key-value memories a linear, ReLU or "
                                   "softmax store holds before interference equals the signal, beside the analytic "
                                   "capacities; tie the result to SD 1.5's attention levels.")  # fmt: skip
    p.add_argument("--quick", action="store_true", help="small dimensions and memory counts (seconds; for tests)")
    p.add_argument("--plot", metavar="FILE.png", help="log-log SIR and accuracy against memories")
    p.add_argument("--encoders-dir", default="weights/encoders", help="where the real encoder for real keys is")
    p.add_argument("--minisd", default="weights/minisd", help="the mini SD whose cross-attention keys to test")
    _add_json(p)
    p.set_defaults(func=cmd_memory)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' per-load bars; ours stay
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    name = "sdkit"
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if not getattr(args, "func", None):
            parser.print_help()
            return 0
        name = f"sdkit {args.command}"
        # Library chatter (deprecations, diffusers' info logs) is not the user's problem.
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", module=r"(diffusers|transformers|torch|accelerate|huggingface_hub)(\.|$)")
        # Their errors reach the user as our one line; their own log lines would be a second.
        logging.getLogger("diffusers").setLevel(logging.CRITICAL)
        logging.getLogger("transformers").setLevel(logging.CRITICAL)
        args.func(args)
    except SdkitError as e:
        print(f"{name}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `sdkit ... | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as e:  # the machine said no: permissions, a full disk, a vanished file
        where = f"{e.filename}: " if e.filename else ""
        print(f"{name}: error: {where}{e.strerror or e}", file=sys.stderr)
        return 2
    return 0


def run() -> None:
    """The `sdkit` command's entry point: main(), and its exit code as the process's.

    After Ctrl-C the process leaves at once with 130: shutting the interpreter down after an
    interrupted import (torch, say) can otherwise end it by SIGINT after all (exit status -2).
    """
    code = main()
    if code == 130:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
    sys.exit(code)


if __name__ == "__main__":
    run()
