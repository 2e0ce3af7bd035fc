"""``jaxckpt plan``: the cheapest remat spec under a memory budget, next to what every preset needs.

One row per remat preset, predicted from shapes (``plan.choice``, no compile), and
the spec ``plan.plan_memory`` chose, whose peak XLA measured: ``plan.preset_table``
computes them, this module parses the flags and formats. The measurement is
XLA:CPU's (``plan.CPU_CAVEAT``); the budget is a device preset's memory or a size.

Example:
    $ jaxckpt plan --model tiny --batch 2 --seq 64 --budget 20MiB
    (a table: remat, params, grads, optimizer, activations, total, fits, recompute,
    measured; the chosen row is starred; the caption gives the budget and minimum)

    $ jaxckpt plan --model llama2-7b --batch 8 --seq 2048 --device ascend-910
    (every row needs about 125 GiB against 29.80 GiB: the table, then the smallest peak
    and what would fit on stderr, exit status 1)

    $ jaxckpt plan --model llama2-7b --batch 8 --seq 2048 --device ascend-910 --devices 8
    (the same rows per device under 8-way FSDP; the chosen spec compiled over 8
    simulated CPU devices)
"""

import argparse
import json
import sys

from rich import box
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

from jaxckpt import nn, plan
from jaxckpt.cli._flags import FLAGS, flag_message

PARAM_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
"""``--param-dtype`` spelling -> ``TransformerConfig.param_dtype``."""

PLAN_FLAGS = {"mesh": "jaxckpt train --mesh"}
"""Names whose flag is another command's here (``jaxckpt.cli._flags.FLAGS`` has the rest)."""


_SIZE_COLUMNS = (
    ("params", "params_bytes"),
    ("grads", "grads_bytes"),
    ("optimizer", "optimizer_bytes"),
    ("activations", "activation_bytes"),
    ("total", "total_bytes"),
)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _size(text: str) -> int:
    try:
        return plan.parse_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be a fraction in [0, 1), got {text!r}")
    return value


def add_parser(sub) -> None:
    """Registers ``plan`` on the subcommand parser ``sub``."""
    p = sub.add_parser(
        "plan",
        help="the cheapest remat spec that fits a memory budget, and what every preset needs",
        description="Predicts params, gradients, optimizer state and activations of a train step "
        "under every remat preset (from shapes, no compile), solves for the spec of least recompute "
        "that fits the budget and checks it against XLA's compiled memory analysis (on CPU).",
    )
    p.add_argument("--model", required=True, choices=list(nn.PRESETS), help="model preset")
    p.add_argument("--batch", required=True, type=_positive_int, help="sequences per micro-batch")
    p.add_argument("--seq", required=True, type=_positive_int, help="tokens per sequence")
    budget = p.add_mutually_exclusive_group(required=True)
    budget.add_argument(
        "--device",
        choices=list(plan.DEVICES),
        help="plan for this device: its memory is the budget, its matmul rate prices recompute",
    )
    budget.add_argument("--budget", type=_size, help="bytes per device: 32GB, 30GiB, 512MiB or a number")
    p.add_argument(
        "--devices",
        type=_positive_int,
        default=1,
        help="plan per device for FSDP over this many devices (jaxckpt train --mesh fsdp=N); the batch "
        "is split over them and every candidate is compiled over N simulated CPU devices",
    )
    p.add_argument("--optimizer", default="adamw", choices=list(plan.OPTIMIZERS), help="default: adamw")
    p.add_argument(
        "--param-dtype", choices=list(PARAM_DTYPES), help="parameter storage dtype; default: the model's"
    )
    p.add_argument(
        "--micro-batches", type=_positive_int, default=1, help="micro-batches accumulated per step"
    )
    p.add_argument(
        "--headroom", type=_fraction, default=0.0, help="fraction of the budget kept free (default 0)"
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.set_defaults(run=run, flags=PLAN_FLAGS)


def run(args: argparse.Namespace) -> int:
    """Plans, prints the table (or JSON); returns 0, or 1 when nothing fits the budget."""
    overrides = {} if args.param_dtype is None else {"param_dtype": PARAM_DTYPES[args.param_dtype]}
    config = nn.TransformerConfig.preset(args.model, **overrides)
    device = plan.device_preset(args.device or "cpu")
    budget = device.memory if args.device else args.budget
    workload = plan.Workload(
        config,
        args.batch,
        args.seq,
        micro_batches=args.micro_batches,
        optimizer=args.optimizer,
        devices=args.devices,
    )
    answer = plan.preset_table(workload, budget, headroom=args.headroom, device=args.device, model=args.model)
    result = answer.to_dict()
    if answer.error is not None:  # the planner's hints name arguments: the table names flags
        result["error"] = flag_message(result["error"], {**FLAGS, **PLAN_FLAGS})
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        console = Console()
        t = table(result)
        wide = console.options.update_width(1000)
        console.width = max(console.width, Measurement.get(console, wide, t).maximum)  # never wrap it
        console.print(t)
        if answer.chosen is not None:
            console.print(_chosen_line(result["chosen"]))
            console.print(_attempts_line(result["attempts"]))
    if answer.error is not None:
        print(f"jaxckpt plan: {result['error']}", file=sys.stderr)
        return 1
    return 0


def table(result: dict) -> Table:
    """The rows as a rich table; the chosen one starred, with XLA's measured peak."""
    c, rows = result["config"], result["rows"]
    micro = f" x{c['micro_batches']} micro-batches" if c["micro_batches"] > 1 else ""
    title = (
        f"{result['model']} B={c['batch']} T={c['seq']}{micro}, {c['optimizer']}, {c['param_dtype']} params"
    )
    if c["devices"] > 1:
        title += f"; per device, FSDP over {c['devices']} devices (B={c['batch'] // c['devices']} each)"
    budget = plan.format_bytes(result["budget_bytes"])
    if result["device"]:
        budget += f" ({result['device']}, {result['budget_bytes'] / 1e9:g} GB)"
    if result["headroom"]:
        budget += f" less {result['headroom']:.0%} headroom"
    source = "predicted" if result["minimum_source"] == "predicted" else "measured by XLA"
    notes = [
        f"budget {budget}; smallest peak {plan.format_bytes(result['minimum_bytes'])} ({source})",
        "sizes and fits are predicted from shapes; recompute: extra FLOPs as a share of a step's",
        *(
            [f"measured: the FSDP step compiled over {c['devices']} simulated CPU devices, one device's peak"]
            if c["devices"] > 1
            else []
        ),
    ]
    if any(r["activation_bytes"] == r["params_bytes"] for r in rows):
        notes.append("activations equal to params are the floor: the update reuses their buffers")
    if result["offload_rows"] != "shown":
        notes.append(f"offload presets {result['offload_rows']}")
    notes.append(f"XLA peaks were {result['caveat']}")
    caption = ". ".join(n[0].upper() + n[1:] for n in notes) + "."
    t = Table(title=title, caption=caption, box=box.SIMPLE_HEAD)
    t.add_column("remat", justify="left")
    for header, _ in _SIZE_COLUMNS:
        t.add_column(header, justify="right")
    for header in ("fits", "recompute", "measured"):
        t.add_column(header, justify="right")
    chosen = result["chosen"]
    for r in result["rows"]:
        is_chosen = chosen is not None and r["remat"] == chosen["remat"]
        t.add_row(
            ("* " if is_chosen else "  ") + r["remat"],
            *(plan.format_bytes(r[key]) for _, key in _SIZE_COLUMNS),
            "yes" if r["fits"] else "no",
            _percent(r["recompute_fraction"]),
            plan.format_bytes(chosen["measured_bytes"]) if is_chosen else "",
            style="bold" if is_chosen else None,
        )
    return t


def _percent(fraction: float) -> str:
    return "<0.1%" if 0 < fraction < 0.001 else f"{fraction:.1%}"


def _chosen_line(chosen: dict) -> str:
    """One line on the chosen spec: what a solved spec keeps per layer, and XLA's peak."""
    spec, what = chosen["spec"], "a preset"
    if chosen["remat"] == "solved":
        what = f"keeps {', '.join(spec['save']) or 'only the layer input'} per layer"
        if spec["offload"]:
            what += f", offloads {', '.join(spec['offload'])}"
        what += ", recomputes the rest"
    peak = plan.format_bytes(chosen["measured_bytes"])
    return f"* chosen: {chosen['remat']} ({what}); XLA:CPU measured a {peak} peak"


def _attempts_line(attempts: list[dict]) -> str:
    """The specs the planner compiled: predicted -> measured, so a miss of the model shows."""
    tried = "; ".join(
        f"{a['remat']} {plan.format_bytes(a['predicted_bytes'])} -> {plan.format_bytes(a['measured_bytes'])}"
        for a in attempts
    )
    return f"  compiled (predicted -> XLA:CPU): {tried}"
