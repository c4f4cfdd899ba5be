"""What teaches the mini SD to compose: one model per row, trained and judged the same way.

Every row is SD 1.x's recipe (TrainSettings at --steps, less the three departures the shipped
recipe makes: SD_RECIPE) with one change, trained from the same seed on the same data stream for the
same number of steps (rows named with their steps excepted: 6,000, the budget of the models shipped
before, and 3,600, the hour the issue allows) and judged on the same prompts and seeds: 64 single
objects and 64 pairs, DDIM 25 steps, guidance 4, with 95 % bootstrap intervals over prompts. Rows:

    baseline            SD 1.x's recipe at --steps (1,600: the budget of the earlier, slower loop)
    6000 steps          the same at 6,000 steps: the model shipped until the recipe below
    pairs 75 %          three images in four with two objects (against one in two)
    attention 32x32     cross-attention (and self-attention) also at the full-resolution level
    context 77          SD's 77 token positions (zeros past the caption) against 24
    mpnet encoder       all-mpnet-base-v2 (768 wide) in place of all-MiniLM-L6-v2 (384)
    coordinates         two coordinate channels at the input: a departure from SD 1.x, which has none
    grounding loss      TokenCompose's token loss on the generator's masks, weight 1: each object's
                        colour and shape words made to attend to its mask (a departure from SD's
                        recipe, which has no masks)
    grounding + coordinates   both departures at once: the loss asks the attention for a place,
                        the channels give the queries one
    relation loss       weight 1 on a loss that asks only for a pair's order: the first object's
                        attention centred left of the second's when the caption says "left of"
                        (and right when "right of"); a departure from SD's recipe too
    relation loss 0.05  the same at weight 0.05 (at weight 1, the grounding loss's gradient is about
                        twice the denoising loss's on the trained model)
    relation loss 0.1 at t >= 600   weight 0.1, only on images noised to timestep 600 or more: where the
                        layout is decided and only the text can say where an object goes
    zero terminal SNR   the noise schedule rescaled to end at pure noise, and v-prediction (Lin et al.
                        2024; SD 1.x's schedule leaves the objects faintly visible at the last timestep,
                        so the layout can be learnt from the noise instead of the text)
    zero terminal SNR + coordinates   with the layout left to the text, the queries given a place to match
    zero terminal SNR + mpnet         with the layout left to the text, the text that holds the relation best
    zero terminal SNR 6000 steps      the then shipped model's budget with zero terminal SNR: would it ship?
    zero terminal SNR + floor 5       and five times the weight on the noisiest images, where only the text
                                      can order a pair (the implied image's error weighted min(SNR, 5) + 5)
    swapped pairs at t >= 600   half the pair images noised to timestep 600 or more are noised from the
                        pair with its two objects exchanged (each cell kept), the loss asking for the
                        true image: the noise then says where objects are but not which is which, so
                        only the caption can (a departure from SD's recipe)
    swapped pairs + coordinates   the same, with coordinate channels: a place for the queries to read
                        which object goes where from the caption
    place embeddings    diffusers' sinusoidal positional embedding before every transformer block's
                        attentions (BasicTransformerBlock's positional_embeddings): queries that know
                        their place, as the layout probe's do (a departure from SD 1.x)
    place embeddings + swapped pairs   queries that know their place, and noise that cannot say
                        which object is where
    penultimate layer   the text encoder's penultimate layer in place of its last (SD 2.x's choice; in
                        MiniLM it carries binding and the relation better: the probe's layer rows)
    later timesteps x9  timesteps >= 900 drawn nine times as often (diffusers' "later" timestep bias), alone
    zero terminal SNR + place embeddings + later timesteps x9   the three departures together, at the rows' budget
    zero terminal SNR + place embeddings + later timesteps x9 6000 steps   the recipe shipped before
                        the one below: timesteps >= 900 drawn nine times as often, where only the caption
                        can order a pair, with the layout left to the text and queries that know their place
    ... 3600 steps      the same in the hour the issue allows (the learning rate decays to zero at the end)
    ... 3600 steps constant lr   and with SD 1.x's schedule: the peak rate held after the warm-up
    ... later timesteps x3 3600 steps   the shipped recipe (the defaults): the hour with a third of the
                        bias, a quarter of the images at t >= 900 (x9: half), so more steps where the
                        objects' shapes are drawn
    ... x3 3600 steps bfloat16          the shipped recipe trained in bfloat16 autocast (--precision bf16),
                        which some CPUs run faster: does it learn the same?
    ... x3 3600 steps bfloat16 float32 ends   the same with the U-Net's ends (input and output
                        convolutions, output norm, timestep embedding) in float32 (--precision
                        bf16-fp32-ends): in bfloat16 the output convolution's gradient is 26 % off
    ... x3 3600 steps seed 1            the shipped recipe from seed 1 (initialisation, data stream and
                        noise): how far one run of the recipe lies from another
    ... x3 3600 steps seed 1 bfloat16   the two together
    ... x3 3600 steps seed 1 bfloat16 float32 ends   and with the ends in float32
    ... x3 3600 steps seed 2            a third seed, in float32 ...
    ... x3 3600 steps seed 2 bfloat16 float32 ends   ... and with float32 ends: do they draw pairs
                        as float32 does?
    ... x3 3600 steps seed 3            a fourth seed, in float32 ...
    ... x3 3600 steps seed 3 bfloat16 float32 ends   ... and with float32 ends: is the relation bfloat16
                        lost on two seeds of five lost by float32 too, on some seed?

Each row writes its model under --out (with a checkpoint, so a killed run resumes) and its result
into --json as soon as it is judged; a row already in --json with the same settings is not run
again. --trained ROW=FOLDER judges a row from a model `sdkit minisd train` saved, once its
minisd.json shows the row's settings, encoder, layer and U-Net (the time is the one it records);
without --rows, only the rows given --trained are run.
Needs the real encoders (python scripts/get_real_encoders.py). About 15 minutes a row at 1,600
steps on 2 CPU cores ("attention 32x32": about 2 hours in float32).

    python scripts/ablate_minisd.py [--rows baseline,...] [--steps 1600] [--out out/ablation]
"""

import argparse
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from sdkit.common import SdkitError, format_table, write_json
from sdkit.encoders import load_text_encoder
from sdkit.minisd.evaluate import evaluate
from sdkit.minisd.pipeline import MiniSDPipeline, MiniSDSpec
from sdkit.minisd.train import TrainSettings, recorded_settings, train
from sdkit.presets import preset_config

# the shipped recipe's departures from SD 1.x's, turned off: each row's starting point
SD_RECIPE = {"zero_terminal_snr": False, "place_embeddings": False, "timestep_bias": 1.0}
# the shipped recipe (the defaults) as changes to SD_RECIPE: the rows that vary its precision and seed start here
SHIPPED = {"zero_terminal_snr": True, "place_embeddings": True, "timestep_bias": 3.0, "steps": 3600}
ALL_CROSS_ATTENTION = {"down_block_types": ["CrossAttnDownBlock2D"] * 3, "up_block_types": ["CrossAttnUpBlock2D"] * 3}
# name -> (changes to TrainSettings, changes to the U-Net config, text encoder[, its layer: "last" if not named])
ROWS = {
    "baseline": ({}, {}, "all-MiniLM-L6-v2"),
    "6000 steps": ({"steps": 6000}, {}, "all-MiniLM-L6-v2"),  # in place of --steps
    "pairs 75 %": ({"pair_fraction": 0.75}, {}, "all-MiniLM-L6-v2"),
    "attention 32x32": ({}, ALL_CROSS_ATTENTION, "all-MiniLM-L6-v2"),
    "context 77": ({"context_length": 77}, {}, "all-MiniLM-L6-v2"),
    "mpnet encoder": ({}, {"cross_attention_dim": 768}, "all-mpnet-base-v2"),
    "coordinates": ({"coordinates": True}, {}, "all-MiniLM-L6-v2"),
    "grounding loss": ({"grounding_weight": 1.0}, {}, "all-MiniLM-L6-v2"),
    "grounding + coordinates": ({"grounding_weight": 1.0, "coordinates": True}, {}, "all-MiniLM-L6-v2"),
    "relation loss": ({"relation_weight": 1.0}, {}, "all-MiniLM-L6-v2"),
    "relation loss 0.05": ({"relation_weight": 0.05}, {}, "all-MiniLM-L6-v2"),
    "relation loss 0.1 at t >= 600": ({"relation_weight": 0.1, "attention_loss_from": 600}, {}, "all-MiniLM-L6-v2"),
    "zero terminal SNR": ({"zero_terminal_snr": True}, {}, "all-MiniLM-L6-v2"),
    "zero terminal SNR + coordinates": ({"zero_terminal_snr": True, "coordinates": True}, {}, "all-MiniLM-L6-v2"),
    "zero terminal SNR + mpnet": ({"zero_terminal_snr": True}, {"cross_attention_dim": 768}, "all-mpnet-base-v2"),
    "zero terminal SNR 6000 steps": ({"zero_terminal_snr": True, "steps": 6000}, {}, "all-MiniLM-L6-v2"),
    "zero terminal SNR + floor 5": ({"zero_terminal_snr": True, "x0_weight_floor": 5.0}, {}, "all-MiniLM-L6-v2"),
    "swapped pairs at t >= 600": ({"swap_fraction": 0.5, "swap_from": 600}, {}, "all-MiniLM-L6-v2"),
    "swapped pairs + coordinates": (
        {"swap_fraction": 0.5, "swap_from": 600, "coordinates": True},
        {},
        "all-MiniLM-L6-v2",
    ),
    "place embeddings": ({"place_embeddings": True}, {}, "all-MiniLM-L6-v2"),
    "place embeddings + swapped pairs": (
        {"place_embeddings": True, "swap_fraction": 0.5, "swap_from": 600},
        {},
        "all-MiniLM-L6-v2",
    ),
    "penultimate layer": ({}, {}, "all-MiniLM-L6-v2", "penultimate"),
    "later timesteps x9": ({"timestep_bias": 9.0}, {}, "all-MiniLM-L6-v2"),
    "zero terminal SNR + place embeddings + later timesteps x9": (
        {"zero_terminal_snr": True, "place_embeddings": True, "timestep_bias": 9.0},
        {},
        "all-MiniLM-L6-v2",
    ),
    "zero terminal SNR + place embeddings + later timesteps x9 6000 steps": (
        {"zero_terminal_snr": True, "place_embeddings": True, "timestep_bias": 9.0, "steps": 6000},
        {},
        "all-MiniLM-L6-v2",
    ),
    "zero terminal SNR + place embeddings + later timesteps x9 3600 steps": (
        {"zero_terminal_snr": True, "place_embeddings": True, "timestep_bias": 9.0, "steps": 3600},
        {},
        "all-MiniLM-L6-v2",
    ),
    "zero terminal SNR + place embeddings + later timesteps x9 3600 steps constant lr": (
        {
            "zero_terminal_snr": True,
            "place_embeddings": True,
            "timestep_bias": 9.0,
            "steps": 3600,
            "lr_schedule": "constant",
        },
        {},
        "all-MiniLM-L6-v2",
    ),
    "zero terminal SNR + place embeddings + later timesteps x3 3600 steps": (SHIPPED, {}, "all-MiniLM-L6-v2"),
    "zero terminal SNR + place embeddings + later timesteps x3 3600 steps bfloat16": (
        {**SHIPPED, "precision": "bf16"},
        {},
        "all-MiniLM-L6-v2",
    ),
    "zero terminal SNR + place embeddings + later timesteps x3 3600 steps bfloat16 float32 ends": (
        {**SHIPPED, "precision": "bf16-fp32-ends"},
        {},
        "all-MiniLM-L6-v2",
    ),
    "zero terminal SNR + place embeddings + later timesteps x3 3600 steps seed 1": (
        {**SHIPPED, "seed": 1},
        {},
        "all-MiniLM-L6-v2",
    ),
    "zero terminal SNR + place embeddings + later timesteps x3 3600 steps seed 1 bfloat16": (
        {**SHIPPED, "seed": 1, "precision": "bf16"},
        {},
        "all-MiniLM-L6-v2",
    ),
    "zero terminal SNR + place embeddings + later timesteps x3 3600 steps seed 1 bfloat16 float32 ends": (
        {**SHIPPED, "seed": 1, "precision": "bf16-fp32-ends"},
        {},
        "all-MiniLM-L6-v2",
    ),
    "zero terminal SNR + place embeddings + later timesteps x3 3600 steps seed 2": (
        {**SHIPPED, "seed": 2},
        {},
        "all-MiniLM-L6-v2",
    ),
    "zero terminal SNR + place embeddings + later timesteps x3 3600 steps seed 2 bfloat16 float32 ends": (
        {**SHIPPED, "seed": 2, "precision": "bf16-fp32-ends"},
        {},
        "all-MiniLM-L6-v2",
    ),
    "zero terminal SNR + place embeddings + later timesteps x3 3600 steps seed 3": (
        {**SHIPPED, "seed": 3},
        {},
        "all-MiniLM-L6-v2",
    ),
    "zero terminal SNR + place embeddings + later timesteps x3 3600 steps seed 3 bfloat16 float32 ends": (
        {**SHIPPED, "seed": 3, "precision": "bf16-fp32-ends"},
        {},
        "all-MiniLM-L6-v2",
    ),
}
SETS = ("singles", "pairs")


def row_settings(name: str, steps: int) -> tuple[TrainSettings, dict, str, str]:
    changes, config_changes, encoder, *layer = ROWS[name]
    settings = replace(TrainSettings(steps=steps), **{**SD_RECIPE, **changes})
    return settings, {**preset_config("minisd"), **config_changes}, encoder, layer[0] if layer else "last"


def main() -> int:
    from sdkit.cli import quiet_libraries

    quiet_libraries()  # the library's load bars and logs, as the sdkit command keeps them off stderr
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", help="comma-separated rows (default: every row, or with --trained only those)")
    parser.add_argument("--steps", type=int, default=1600, help="training steps of a row")
    parser.add_argument("--count", type=int, default=64, help="prompts per set")
    parser.add_argument("--out", default="out/ablation", help="models and checkpoints")
    parser.add_argument("--json", default="weights/minisd/findings/ablation.json", help="results")
    parser.add_argument("--encoders-dir", default="weights/encoders")
    parser.add_argument(
        "--trained",
        action="append",
        default=[],
        type=row_and_folder,
        metavar="ROW=FOLDER",
        help="judge ROW from this model folder (trained with its settings) instead of training it",
    )
    args = parser.parse_args()
    trained_folders = dict(args.trained)
    if args.rows is not None:
        rows = [r for r in args.rows.split(",") if r]
    else:  # --trained alone judges its rows: every other row too would be hours of training
        rows = [] if trained_folders else list(ROWS)
    rows += [r for r in trained_folders if r not in rows]  # a row given its model is a row asked for
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        print(f"unknown row {unknown[0]!r}; choose from {', '.join(ROWS)}", file=sys.stderr)
        return 2
    results_path = Path(args.json)
    results = json.loads(results_path.read_text()) if results_path.is_file() else {"rows": {}}
    for name in rows:
        settings, config, encoder_name, layer = row_settings(name, args.steps)
        record = {
            "settings": asdict(settings),
            "unet": config,
            "text_encoder": encoder_name,
            "count": args.count,
            "layer": layer,
        }
        done = results["rows"].get(name)
        # rows judged before the layer was a choice read the last one, and record none; a row given
        # its model with --trained is judged again from that model, as asked
        if (
            done
            and name not in trained_folders
            and all(done.get(k, "last" if k == "layer" else None) == v for k, v in record.items() if k != "settings")
            and same_recipe(done["settings"], record["settings"])
        ):
            print(f"{name}: already judged, kept", flush=True)
            continue
        if name in trained_folders:  # checked before the encoder loads: a wrong folder is refused at once
            model = Path(trained_folders[name])
            try:
                trained = trained_as_row(model, record)
            except SdkitError as error:  # not a mini SD folder, or an unreadable one: the error names it
                print(f"{name}: {error}", file=sys.stderr)
                return 2
            if isinstance(trained, str):
                print(f"{model}: not the model of row {name!r}: {trained}", file=sys.stderr)
                return 2
        encoder = load_text_encoder(Path(args.encoders_dir) / encoder_name, layer=layer)
        if name not in trained_folders:
            print(f"{name}: training {settings.steps} steps", flush=True)
            folder = Path(args.out) / name.replace(" ", "-").replace("%", "pct")
            model = folder / "model"
            run = train(
                model,
                encoder,
                settings,
                config,
                checkpoint_dir=folder / "checkpoints",
                checkpoint_every=200,
                cache_dir="weights/cache",
            )
            trained = {
                "settings": run.settings,
                "train_seconds": run.total_seconds,
                "samples_per_second": run.samples_per_second,
            }
        pipe = MiniSDPipeline.from_pretrained(model, text_encoder=encoder.source)
        began = time.perf_counter()
        ev = evaluate(pipe, SETS, args.count, floors=False, model_name=name)
        record.update(
            **trained,
            eval_seconds=time.perf_counter() - began,
            results={s: ev.results["model"][s] for s in SETS},
            intervals=ev.intervals,
        )
        results["rows"][name] = record
        write_json(results_path, results)
        print(
            f"{name}: pairs all {ev.results['model']['pairs']['all']:.3f}, singles all "
            f"{ev.results['model']['singles']['all']:.3f}",
            flush=True,
        )
    print(format_ablation(results))
    return 0


def same_recipe(recorded: dict, settings: dict) -> bool:
    """Whether a run's recorded settings are these: for a row at precision "auto", whatever it chose
    on the run's machine; a row that names its precision is that precision only."""
    recorded = recorded_settings(recorded)
    if settings["precision"] == "auto":
        recorded = {**recorded, "precision": "auto"}
    return recorded == settings


def row_and_folder(text: str) -> tuple[str, str]:
    row, equals, folder = text.partition("=")
    if not equals or not folder:
        raise argparse.ArgumentTypeError(f"{text!r} is not ROW=FOLDER")
    return row, folder


def trained_as_row(folder: Path, record: dict) -> dict | str:
    """The row's training record from a saved model folder, or what makes it another row's model."""
    spec = MiniSDSpec.read(folder)
    training = spec.training
    if not training:
        return "its minisd.json records no training"
    if note := spec.checkpoint_note():
        return f"it is {note}"
    if not same_recipe(training["settings"], record["settings"]):
        return "trained with other settings"
    if (spec.text_encoder, spec.layer) != (record["text_encoder"], record["layer"]):
        return f"it reads {spec.text_encoder}'s {spec.layer} layer"
    unet_config_file = folder / "unet" / "config.json"
    if not unet_config_file.is_file():
        return "it has no unet/config.json"
    unet_config = json.loads(unet_config_file.read_text())
    if any(unet_config.get(key) != value for key, value in record["unet"].items()):
        return "another U-Net config"
    # "seconds" times only a resumed run's last process; records older than "total_seconds" have
    # the run's time (every process counted) in their history's last entry, made at the last step
    seconds = training.get("total_seconds", training["history"][-1]["seconds"])
    return {
        "settings": training["settings"],
        "train_seconds": seconds,
        "samples_per_second": training["samples_per_second"],
    }


def format_ablation(results: dict) -> str:
    rows = []
    for name, r in results["rows"].items():
        p, s, ci = r["results"]["pairs"], r["results"]["singles"], r["intervals"]["pairs"]
        rows.append(
            [
                name,
                r["settings"]["steps"],
                f"{r['train_seconds'] / 60:.0f} min",
                f"{100 * s['all']:.1f} %",
                f"{100 * p['all']:.1f} % [{100 * ci['all'][0]:.0f}, {100 * ci['all'][1]:.0f}]",
                f"{100 * p['colour']:.1f} %",
                f"{100 * p['shape']:.1f} %",
                f"{100 * p['extra']:.1f} %",
                "-" if p["position_if_bound"] is None else f"{100 * p['position_if_bound']:.1f} %",
            ]
        )
    return format_table(
        [
            "row",
            "steps",
            "trained",
            "singles all",
            "pairs all [95 % CI]",
            "pairs colour",
            "pairs shape",
            "pairs extra",
            "pairs relation if bound",
        ],
        rows,
        title="mini SD ablation: one change a row, the same prompts and seeds",
    )


if __name__ == "__main__":
    sys.exit(main())
