"""The docs' tables of measured numbers, written from the committed JSON they come from.

    python scripts/maintain/tables.py --write       # rewrite each table in docs/ (after regenerating JSON)
    python scripts/maintain/tables.py eval memory   # print tables

In a page of docs/ each table stands between <!-- name --> and <!-- /name -->, on one page only.
tests/test_docs.py holds the pages to these: a number edited by hand, or JSON regenerated without
the pages, fails it. Numbers in the pages' prose are read off these tables.
"""

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
FINDINGS = ROOT / "weights" / "minisd" / "findings"
SET_NAMES = {
    "singles": "single objects",
    "pairs": "pairs",
    "held_out_singles": "held-out single objects",
    "held_out_pairs": "held-out pairs",
}


def load(name: str) -> dict:
    return json.loads((FINDINGS / f"{name}.json").read_text())


def pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f} %"


def interval(pair) -> str:
    return f"[{100 * pair[0]:.0f}, {100 * pair[1]:.0f}]"


def markdown(headers: list[str], rows: list[list], right_from: int = 1) -> str:
    align = ["---" if i < right_from else "---:" for i in range(len(headers))]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(align) + "|"]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def eval_table() -> str:
    ev = load("eval")
    results = ev["results"]
    rows = []
    for name in ev["counts"]:
        acc = results["model"][name]
        rows.append(
            [
                SET_NAMES[name],
                pct(acc["colour"]),
                pct(acc["position"]),
                pct(acc["shape"]),
                pct(acc["extra"]),
                f"**{pct(acc['all'])}** {interval(ev['intervals'][name]['all'])}",
                pct(acc["position_if_bound"]) if "pairs" in name else "-",
                pct(results["empty prompt"][name]["all"]),
                pct(results["untrained"][name]["all"]),
            ]
        )
    return markdown(
        [
            "set",
            "colour",
            "position",
            "shape",
            "extra objects",
            "all [95 % CI]",
            "left/right if bound",
            "empty prompt (all)",
            "untrained (all)",
        ],
        rows,
    )


def ablation_table(findings: str = "ablation") -> str:
    rows = []
    for name, row in load(findings)["rows"].items():
        res, ci = row["results"], row["intervals"]
        rows.append(
            [
                name,
                f"{row['settings']['steps']:,}",
                f"{row['train_seconds'] / 60:.0f} min",
                f"{row['samples_per_second']:.0f}",
                pct(res["singles"]["all"]),
                f"{pct(res['pairs']['all'])} {interval(ci['pairs']['all'])}",
                pct(res["pairs"]["colour"]),
                pct(res["pairs"]["shape"]),
                pct(res["pairs"]["extra"]),
                pct(res["pairs"]["position_if_bound"]),
            ]
        )
    return markdown(
        [
            "row",
            "steps",
            "trained in",
            "samples/s",
            "singles all",
            "pairs all [95 % CI]",
            "pairs colour",
            "pairs shape",
            "pairs extra objects",
            "pairs left/right if bound",
        ],
        rows,
    )


def ablation_256_table() -> str:
    """The shipped recipe's rows judged again on 256 prompts per set (the first 64 are the ablation's)."""
    return ablation_table("ablation-256")


def probe_table() -> str:
    from sdkit.minisd.probe import QUESTIONS

    rows = []
    for report in load("probe")["reports"]:
        for e in report["rows"]:
            rows.append(
                [
                    Path(report["encoder"]).name,
                    report["layer"],
                    QUESTIONS[(e["word"], e["target"])],
                    f"**{pct(e['contextual'])}**",
                    pct(e["input embedding"]),
                    pct(e["chance"]),
                    e["test"],
                ]
            )
    return markdown(
        ["encoder", "layer", "what the probe reads", "token states", "input embeddings", "chance", "n"], rows, 3
    )


def leakage_table() -> str:
    data = load("leakage")
    rows = []
    for source in ("generator", "generated"):
        by = {(r["layer"], r["timestep"]): r for r in data[source]["rows"]}
        layers = sorted({layer for layer, _ in by}, key=lambda n: (n == "all layers", n))
        for layer in layers:
            cells = [by[(layer, t)]["colour"] for t in data[source]["timesteps"]]
            rows.append(
                [
                    source if layer == layers[0] else "",
                    layer.split(".transformer")[0],
                    *("-" if c is None else f"{c:.2f}" for c in cells),
                ]
            )
    return markdown(["pair images", "layer", *(f"t = {t}" for t in data["generator"]["timesteps"])], rows, 2)


def verdict_table() -> str:
    """The model's own pair images split by the judge's verdict: the colour words' leakage where the
    colours came out bound against swapped, and how well it (and the relation word) tells them apart."""
    data = load("leakage")["generated"]
    rows = []
    for r in data["by_verdict"]:
        if r["layer"] not in ("all layers", "down_blocks.1.attentions.0.transformer_blocks.0.attn2"):
            continue
        cell = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
        rows.append(
            [
                r["layer"].split(".transformer")[0],
                r["timestep"],
                cell(r["colour leakage, bound"]),
                cell(r["colour leakage, swapped"]),
                cell(r["colour AUC"]),
                cell(r["relation AUC"]),
            ]
        )
    groups = ", ".join(f"{k} {v}" for k, v in data["groups"].items())
    return (
        markdown(["layer", "t", "colour leakage, bound", "colour leakage, swapped", "AUC", "relation AUC"], rows, 1)
        + f"\n\n({data['images']} usable pair images; {groups})"
    )


def order_table() -> str:
    from sdkit.minisd.trajectory import MEASURES

    data = load("order")
    last = len(data["timesteps"]) - 1
    steps = sorted({*range(0, last + 1, 4), last})
    rows = [
        [name, *(f"{pct(data['shares'][name][k])} {interval(data['intervals'][name][k])}" for k in steps)]
        for name in MEASURES
    ]
    return markdown(
        [f"pairs ({data['pairs']}, each with both relations)", *(f"t = {data['timesteps'][k]}" for k in steps)], rows
    )


def caption_vs_noise_table() -> str:
    from sdkit.minisd.trajectory import SOURCES

    data = load("caption_vs_noise")
    rows = [
        [name, *(f"{pct(v)} {interval(i)}" for v, i in zip(data["shares"][name], data["intervals"][name]))]
        for name in SOURCES
    ]
    return markdown(
        [f"pairs ({data['pairs']}): the prediction in the caption's order", *(f"t = {t}" for t in data["timesteps"])],
        rows,
    )


def steering_table() -> str:
    def judged(pairs) -> list[str]:
        return [pct(pairs["colour"]), pct(pairs["shape"]), pct(pairs["extra"]), pct(pairs["position_if_bound"])]

    def fixed_broken(changed) -> str:
        return f"{changed['fixed']} / {changed['broken']}"

    data = load("steering")
    plain = data["rows"][0]["unsteered"]
    rows = [
        [
            "unsteered",
            *judged(plain["pairs"]),
            f"**{pct(plain['pairs']['all'])}**",
            "-",
            pct(plain["singles"]["all"]),
            "1.00x",
        ]
    ]
    for row in data["rows"]:
        pairs, singles, per = row["steered"]["pairs"], row["steered"]["singles"], row["seconds_per_image"]
        rows.append(
            [
                "+".join(row["objectives"]),
                *judged(pairs),
                f"**{pct(pairs['all'])}** {interval(row['intervals']['pairs']['all'])}",
                fixed_broken(row["changed"]["pairs"]),
                pct(singles["all"]),
                f"{per['model'] / per['unsteered']:.2f}x",
            ]
        )
    held_out = data["best_on_held_out_pairs"]
    plain, steered = held_out["unsteered"], held_out["steered"]
    rows.append(["unsteered, held-out pairs", *judged(plain), f"**{pct(plain['all'])}**", "-", "-", "-"])
    rows.append(
        [
            f"{'+'.join(data['best'])}, held-out pairs",
            *judged(steered),
            f"**{pct(steered['all'])}** {interval(held_out['intervals']['all'])}",
            fixed_broken(held_out["changed"]),
            "-",
            "-",
        ]
    )
    return markdown(
        [
            "steering",
            "pairs colour",
            "pairs shape",
            "pairs extra objects",
            "pairs left/right if bound",
            "pairs all [95 % CI]",
            "pairs fixed / broken",
            "singles all",
            "time per image",
        ],
        rows,
    )


def tokens_table() -> str:
    data = load("tokens")
    names = {
        "tokens": "all tokens",
        "pooled": "pooled (one key/value)",
        "eos": "EOS (one key/value)",
        "pooled repeated": "pooled repeated",
        "words only": "words only",
        "bos only": "BOS only",
        "pooled-trained model": "model trained on the pooled state",
    }
    rows = []
    for key, acc in data["results"].items():
        s, p = acc["singles"], acc["pairs"]
        rows.append(
            [
                names.get(key, key),
                pct(s["colour"]),
                pct(s["position"]),
                pct(s["shape"]),
                pct(s["all"]),
                pct(p["all"]),
                pct(p.get("extra")),
            ]
        )
    return markdown(
        [
            "condition",
            "singles colour",
            "singles position",
            "singles shape",
            "singles all",
            "pairs all",
            "pairs extra objects",
        ],
        rows,
    )


def maps_table() -> str:
    rows = []
    for r in load("maps")["localization"]:
        whole = [x for x in r["rows"] if x["resolution"] == "all layers" and x["word"]]
        cells = []
        for source in ("word", "other object's word", "centre prior", "uniform"):
            entries = [x[source] for x in whole if x.get(source)]
            cells.append(
                "-"
                if not entries
                else f"{sum(e['auc'] for e in entries) / len(entries):.3f} / "
                f"{sum(e['iou'] for e in entries) / len(entries):.3f}"
            )
        rows.append([f"{r['count']} {r['images']} images", *cells])
    return markdown(["images", "the word's own map", "the other object's word", "centre prior", "uniform"], rows)


def adapter_table() -> str:
    rows = []
    for corpus in ("captions", "generic"):
        data = load(f"adapter-{corpus}")
        judged = data["judged"]["results"]
        for method, m in data["methods"].items():
            if method == "mean" or (corpus == "generic" and method in ("width_only", "linear")):
                continue
            ci = m["interval"]["rel_mse"]
            rel = f"{m['rel_mse']:.3f}" + ("" if method == "width_only" else f" [{ci[0]:.3f}, {ci[1]:.3f}]")
            rows.append(
                [
                    method,
                    "-" if method == "width_only" else corpus,
                    rel,
                    f"{m['unet_rel_to_text_effect']:.3f}",
                    pct(judged[method]["singles"]["all"]),
                    pct(judged[method]["pairs"]["all"]),
                ]
            )
        native = judged["native"]
        rows.append(
            [
                f"(native encoder, {corpus} run)",
                "-",
                "-",
                "-",
                pct(native["singles"]["all"]),
                pct(native["pairs"]["all"]),
            ]
        )
    return markdown(
        ["adapter", "trained on", "held-out relMSE [95 % CI]", "U-Net error vs text", "singles all", "pairs all"],
        rows,
        2,
    )


def _count(x: float) -> str:
    return f"{x:,.0f}" if x < 1e7 else f"{x:.2e}"


def memory_table() -> str:
    rows = []
    for c in load("memory")["capacities"]:
        ci = c.get("measured_interval")
        measured = _count(c["measured"]) + (f" [{_count(ci[0])}, {_count(ci[1])}]" if ci else "")
        measured += " (extrapolated)" if c["extrapolated"] else ""
        rows.append(
            [
                c["phi"],
                c["d"],
                _count(c["analytic"]),
                measured,
                f"{c['measured'] / c['analytic']:.2f}",
                "-" if c["published"] is None else _count(c["published"]),
            ]
        )
    return markdown(["phi", "d_k", "analytic M*", "measured M* [95 % CI]", "measured / analytic", "published"], rows)


def compute_table() -> str:
    """Not from JSON: from the shipped configs, by the code itself (on the meta device, in seconds)."""
    from sdkit.audit import audit
    from sdkit.compute import compute, crossover_side, meta_unet, shares

    rows = []
    for model in ("sd15", "sd21", "sdxl", "minisd"):
        unet = meta_unet(model)
        c, params = compute(unet), audit(model)
        attention = (
            sum(
                params.roles[r]
                for r in (
                    "self_attention",
                    "cross_attention.query",
                    "cross_attention.key_value",
                    "cross_attention.output",
                )
            )
            / params.total
        )
        share = shares(c)
        side = crossover_side(unet)
        rows.append(
            [
                model,
                f"{c.height} px",
                f"{c.total / 1e9:,.1f}",
                pct(attention),
                pct(params.roles["mlp"] / params.total),
                pct(share["attention"]),
                pct(share["self_attention"]),
                pct(share["mlp"]),
                pct(share["resnet"]),
                "-" if side is None else f"{side} px",
            ]
        )
    return markdown(
        [
            "model",
            "native size",
            "GFLOPs (one pass, batch 1)",
            "attention parameters",
            "MLP parameters",
            "attention FLOPs",
            "self-attention FLOPs",
            "MLP FLOPs",
            "ResNet FLOPs",
            "self-attention passes MLP at",
        ],
        rows,
    )


def memory_real_table() -> str:
    data = load("memory")["real_keys"]
    by = {}
    for r in data:
        by.setdefault((r["source"], r["keys"], r["d"], r["mean_abs_cosine"]), {})[r["phi"]] = r
    rows = []
    for (source, keys, d, cosine), phis in by.items():
        cells = [
            "-"
            if p not in phis
            else f"< {phis[p]['searched_from']}"
            if phis[p]["measured"] is None  # SIR < 1 from the start
            else _count(phis[p]["measured"]) + (" (extrapolated)" if phis[p]["extrapolated"] else "")
            for p in ("linear", "relu", "softmax")
        ]
        random = [_count(phis[p]["analytic_random"]) for p in ("linear", "relu", "softmax") if p in phis]
        rows.append(
            [
                source.split(" (")[0].replace(".transformer_blocks.0.attn2", ""),
                keys,
                d,
                f"{cosine:.2f}",
                *cells,
                " / ".join(random),
            ]
        )
    return markdown(
        ["keys from", "keys", "d", "mean abs cosine", "linear M*", "ReLU M*", "softmax M*", "random keys, analytic"],
        rows,
        2,
    )


def memory_levels_table() -> str:
    rows = []
    for r in load("memory")["sd_levels"]:
        rows.append(
            [
                r["level"],
                r["head_dim"],
                _count(r["capacity"]),
                *(f"{c:,}" for c in r["cells"].values()),
                f"{r['pixel_over_capacity']:.3g}",
                f"{r['passes_capacity_at_side']:,.0f} px",
            ]
        )
    sides = list(load("memory")["sd_levels"][0]["cells"])
    return markdown(
        [
            "SD 1.5 level",
            "head size",
            "capacity (random keys)",
            *(f"cells at {s} px" for s in sides),
            "pixel-level cells / capacity",
            "passes capacity at",
        ],
        rows,
    )


def memory_context_table() -> str:
    curves = load("memory")["long_context"]
    rows = []
    for i, m in enumerate(curves[0]["memories"]):
        rows.append([f"{m:,}", *(f"{c['sir'][i]:.2f} / {pct(c['accuracy'][i])}" for c in curves)])
    return markdown(["memories", *(f"{c['keys']}: SIR / retrieval" for c in curves)], rows)


def timings_table() -> str:
    data = load("timings")
    machine = data["machine"]
    rows = []
    for r in data["rows"]:
        took = (
            f"{r['seconds']:.1f} s"
            if r["seconds"] < 10
            else f"{r['seconds']:,.0f} s"
            if r["seconds"] < 120
            else f"{r['seconds'] / 60:.0f} min"
        )
        rows.append(
            [
                f"`{r['command']}`",
                took if r["finished"] else f"over {took} (stopped)",
                f"{r['first_output']} s",
                f"{r['longest_silence']} s",
            ]
        )
    where = f"{machine['cpus']} CPU cores" + (f", {machine['gpu']}" if machine["gpu"] else ", no GPU")
    return markdown([f"command ({where}; cold: a new process)", "wall time", "first output", "longest silence"], rows)


EDIT_NAMES = {
    "colour_single": "colour swap, single objects",
    "colour_pair": "colour swap of one object, pairs",
    "shape_single": "shape swap, single objects",
    "relation": "relation swap (left of <-> right of)",
}  # sdkit.minisd.edit.EDIT_NAMES, named without importing torch


# an edit study row's setting (scripts/edit_study.py's KEYS)
SETTING_KEYS = ("cross_replace", "self_replace", "local_blend", "source_states", "share_latents")


def _other_injection(row: dict) -> bool:
    """A row that injects more than cross-attention and shared steps: self-attention, local blending
    or the source's token states (the editing page's second table)."""
    return bool(row["self_replace"] or row["local_blend"] or row["source_states"])


def editing_table(others: bool = False) -> str:
    """Prompt-to-Prompt on the reported captions: each edit set at each cross_replace fraction (0:
    the edited prompt regenerated from the same seed, no injection) and each share of the source's
    first steps; with `others`, the rows with other injections instead."""
    data = load("editing")
    rows = []
    shown = [r for r in data["rows"] if _other_injection(r) == others]
    for row in sorted(shown, key=lambda r: list(EDIT_NAMES).index(r["edit"])):
        setting = (
            "regenerated (no injection)"
            if row["cross_replace"] == 0
            else f"P2P, cross_replace {row['cross_replace']:g}"
        )
        if row["share_latents"]:
            setting = f"source's latents for the first {row['share_latents'] * 100:g} % of steps, then {setting}"
        if row["self_replace"]:
            setting += f", self_replace {row['self_replace']:g}"
        if row["local_blend"]:
            setting += ", local blend"
        if row["source_states"]:
            setting += ", source states"
        if [row[k] for k in SETTING_KEYS] == [data[f"chosen_{k}"] for k in SETTING_KEYS]:
            setting += " (chosen)"
        rows.append(
            [
                EDIT_NAMES[row["edit"]],
                setting,
                f"{pct(row['edited'])} {interval(row['edited_interval'])}",
                f"{pct(row['kept'])} {interval(row['kept_interval'])}",
                f"**{pct(row['both'])}** {interval(row['both_interval'])}",
                pct(row["source_right"]),
                "-"
                if row["right_source_both"] is None
                else f"{pct(row['right_source_both'])} {interval(row['right_source_both_interval'])}",
            ]
        )
    headers = ["edit set", "setting", "edited [95 % CI]", "kept [95 % CI]", "both [95 % CI]", "sources right"]
    return markdown([*headers, "both, right sources [95 % CI]"], rows, right_from=2)


def editing_reweight_table() -> str:
    data = load("editing")
    rows = [
        [f"x{row['factor']:g}", pct(row["colour_shown"]), row["count"]]
        for row in data["reweight"]
        if row["setting"] == data["reweight_setting"]
    ]
    return markdown(["colour word's attention", "its colour shown", "images"], rows)


def inversion_table() -> str:
    """Real (rendered) images inverted, redrawn and colour-swapped: per set and inversion, the
    redrawn source judged and its pixel error, then each edit setting's edited-and-kept rate."""
    data = load("inversion")
    settings = [e["setting"] for e in data["blocks"][0]["edits"]]
    rows = [
        [
            block["set"],
            block["inversion"],
            pct(block["redrawn_right"]),
            f"{block['redrawn_error']:.4f} ({block['vae_error']:.4f})",
            f"{block['inversion_seconds']:.1f}",
            *[f"{pct(e['both'])} {interval(e['both_interval'])}" for e in block["edits"]],
        ]
        for block in data["blocks"]
    ]
    headers = ["images", "inversion", "redrawn judged right", "redrawn error (VAE's)", "s per inversion"]
    return markdown([*headers, *[f"edited and kept: {s}" for s in settings]], rows, right_from=2)


def latent_vae_table() -> str:
    """The VAE's round trips judged (the generator's images, then encoded and decoded), and PSNR."""
    data = load("latent_vae")
    rows = [
        [
            SET_NAMES[name],
            pct(row["originals"]["all"]),
            f"**{pct(row['round_trips']['all'])}**",
            f"{row['psnr_db']:.1f} dB",
        ]
        for name, row in data["round_trips"].items()
    ]
    return markdown(["set", "generator images judged all", "VAE round trips judged all", "PSNR"], rows)


def latent_vs_pixel_table() -> str:
    """The pixel and the latent mini SD side by side (latent_vs_pixel.json, scripts/latent_vs_pixel.py)."""
    pixel, latent = load("latent_vs_pixel")["rows"]

    def judged(row, name):
        cell = row["judged"][name]
        return f"{pct(cell['all'])} {interval(cell['interval'])}"

    def minutes(seconds):
        return "-" if seconds is None else f"{seconds / 60:.0f} min"

    def cross(row):
        return ", ".join(
            f"{c['grid']}x{c['grid']}: {c['entries']:,} ({c['layers']} layer{'s' if c['layers'] > 1 else ''})"
            for c in row["cross_attention"]
        )

    measures = [
        ("denoises", lambda r: f"{r['space']}, {r['grid']} ({r['image_size']} px images)"),
        ("judged at guidance", lambda r: f"{r['guidance_scale']:g}"),
        ("pairs judged all [95 % CI]", lambda r: judged(r, "pairs")),
        ("single objects judged all", lambda r: judged(r, "singles")),
        ("held-out pairs judged all", lambda r: judged(r, "held_out_pairs")),
        (
            "U-Net training",
            lambda r: f"{r['training_steps']:,} steps of {r['training_batch']}, {minutes(r['training_seconds'])}",
        ),
        ("training samples/s", lambda r: f"{r['training_samples_per_second']:.1f}"),
        ("VAE training", lambda r: "no VAE" if r["space"] == "pixels" else minutes(r["vae_training_seconds"])),
        ("sampling, s per image (25 steps)", lambda r: f"{r['sampling_seconds_per_image']:.2f}"),
        ("cross-attention score table per head and layer (cells x tokens)", cross),
        ("U-Net GFLOPs per sampling step (both guidance halves)", lambda r: f"{r['unet_flops_per_step'] / 1e9:.2f}"),
        (
            "word maps against masks, AUC per grid, mean of 5 timesteps (centre prior's)",
            lambda r: ", ".join(
                f"{m['grid']}x{m['grid']}: {m['word_auc']:.2f} ({m['centre_prior_auc']:.2f})" for m in r["maps"]
            ),
        ),
    ]
    rows = [[name, fn(pixel), fn(latent)] for name, fn in measures]
    return markdown(["", "pixel mini SD", "latent mini SD"], rows)


def latent_runs_table() -> str:
    """The latent U-Net's training runs (those with place embeddings are the ablation's sdkit-only
    folders: a stock pipeline has none)."""
    rows = []
    for run in load("latent_vs_pixel")["runs"]:
        judged = run["judged"]
        rows.append(
            [
                run["name"],
                f"{run['training_steps']:,}",
                f"{run['guidance_scale']:g}",
                f"{run['training_seconds'] / 60:.0f} min",
                pct(judged["singles"]["all"]),
                f"**{pct(judged['pairs']['all'])}** {interval(judged['pairs']['interval'])}",
                pct(judged["held_out_pairs"]["all"]),
                pct(run["pairs_colour"]),
                pct(run["pairs_extra_objects"]),
                pct(run["pairs_left_right_if_bound"]),
            ]
        )
    headers = ["run", "steps", "judged at guidance", "trained in", "singles all", "pairs all [95 % CI]"]
    headers += ["held-out pairs all", "pairs colour", "pairs extra objects", "pairs left/right if bound"]
    return markdown(headers, rows)


def latent_guidance_table() -> str:
    """Judged pairs against the guidance scale, per model and draw of captions."""
    from sdkit.minisd import EVAL_SET_SEED

    rows = load("guidance")["rows"]
    scales = sorted({r["guidance"] for r in rows})
    lines = []
    for model, seed in dict.fromkeys((r["model"], r["set_seed"]) for r in rows):
        cells = {r["guidance"]: r for r in rows if (r["model"], r["set_seed"]) == (model, seed) and r["set"] == "pairs"}
        draw = f"eval's ({seed})" if seed == EVAL_SET_SEED else f"another ({seed})"
        lines.append(
            [model, draw]
            + [f"{pct(cells[g]['all'])} ({pct(cells[g]['extra'])})" if g in cells else "-" for g in scales]
        )
    return markdown(["model", "captions drawn", *(f"guidance {g:g}" for g in scales)], lines, right_from=2)


TABLES = {
    "latent-runs": latent_runs_table,
    "latent-guidance": latent_guidance_table,
    "latent-vae": latent_vae_table,
    "latent-vs-pixel": latent_vs_pixel_table,
    "timings": timings_table,
    "compute": compute_table,
    "eval": eval_table,
    "ablation": ablation_table,
    "ablation-256": ablation_256_table,
    "probe": probe_table,
    "leakage": leakage_table,
    "verdicts": verdict_table,
    "order": order_table,
    "caption-vs-noise": caption_vs_noise_table,
    "steering": steering_table,
    "tokens": tokens_table,
    "maps": maps_table,
    "adapter": adapter_table,
    "memory": memory_table,
    "memory-real": memory_real_table,
    "memory-levels": memory_levels_table,
    "memory-context": memory_context_table,
    "editing": editing_table,
    "editing-other-injections": lambda: editing_table(others=True),
    "editing-reweight": editing_reweight_table,
    "inversion": inversion_table,
}


def block(name: str) -> str:
    return f"<!-- {name} -->\n{TABLES[name]()}\n<!-- /{name} -->"


def _pattern(name: str):
    return re.compile(rf"<!-- {re.escape(name)} -->\n(?:.*?\n)?<!-- /{re.escape(name)} -->", re.S)


def pages() -> dict[str, Path]:
    """Each table's page: the page of docs/ that holds its block."""
    found = {}
    for page in sorted(DOCS.rglob("*.md")):
        text = page.read_text()
        for name in TABLES:
            if _pattern(name).search(text):
                found[name] = page
    return found


def write_docs() -> list[str]:
    """Rewrite every table block in docs/ from its data; returns the names of blocks not found."""
    where = pages()
    for name, page in where.items():
        page.write_text(_pattern(name).sub(lambda _, name=name: block(name), page.read_text()))
    return [name for name in TABLES if name not in where]


def main(argv: list[str]) -> int:
    names = [a for a in argv if a != "--write"]
    unknown = [n for n in names if n not in TABLES]
    if unknown:
        print(f"unknown table {unknown[0]!r}; choose from {', '.join(TABLES)}", file=sys.stderr)
        return 2
    if "--write" in argv:
        missing = write_docs()
        print("rewrote the tables in docs/" + (f"; no block for {', '.join(missing)}" if missing else ""))
        return 1 if missing else 0
    for name in names or TABLES:
        print(block(name) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
