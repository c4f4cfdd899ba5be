"""`sdkit memory`: attention as key-value memory, capacities measured and analytic (sdkit.memory)."""

from __future__ import annotations

from .common import add_json, check_input, check_outputs, progress_bar, refuse_options, show_result


def cmd_memory(args) -> None:
    check_outputs(args, pictures=("plot",))
    if args.quick:  # the quick run measures random keys only
        refuse_options(args, ("minisd", "encoders_dir"), "with --quick (it measures random keys only)")
    for dest, what in (("minisd", "--minisd"), ("encoders_dir", "--encoders-dir")):
        if dest in args.given:  # named on purpose: it must be there (the defaults are skipped when absent)
            check_input(getattr(args, dest), what)
    from ..memory import format_report, plot, run

    with progress_bar(args, desc="memories scored", unit="mem", unit_scale=True) as bar:
        report = run(args.quick, args.encoders_dir, args.minisd, progress=bar)
    table = format_report(report)
    if args.plot:
        plot(report, args.plot)
        table += f"\nwrote {args.plot}"
    show_result(args, report.to_json(), table)


def register(sub) -> None:
    p = sub.add_parser(
        "memory",
        help="attention as key-value memory: capacity of linear, ReLU and softmax stores",
        description="Measure how many random (and real) key-value memories a linear, ReLU or "
        "softmax store holds before interference equals the signal, beside the analytic "
        "capacities; tie the result to SD 1.5's attention levels.",
    )
    p.add_argument("--quick", action="store_true", help="small dimensions and memory counts (seconds; for tests)")
    p.add_argument("--plot", metavar="FILE.png", help="log-log SIR and accuracy against memories")
    p.add_argument("--encoders-dir", default="weights/encoders", help="where the real encoder for real keys is")
    p.add_argument("--minisd", default="weights/minisd", help="the mini SD whose cross-attention keys to test")
    add_json(p)
    p.set_defaults(func=cmd_memory)
