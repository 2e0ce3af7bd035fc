"""Per-layer plans: the recompute of ``plan_memory(per_layer=True)`` against the best uniform
spec, over a sweep of budgets, every plan confirmed by XLA:CPU's compiled memory analysis.

A uniform spec steps between the specs' peaks: a budget between ``full`` and ``save_attn``
gets ``full`` (or a spec the MILP solves for) and leaves the rest unused. A per-layer plan
gives the first k layers a richer spec than the rest (``remat.Layered``), so the budget is
used. The budgets cover the whole range, from ``full``'s measured peak to no remat's: two in
each interval between the measured peaks of consecutive uniform specs (``--per-interval``).
At each: the best uniform spec that XLA confirms fits, and the per-layer plan, compiled until
it fits (``sweep``); the goal is a per-layer recompute at least ``GOAL_REDUCTION`` below the
uniform one's.

Why the gain differs between intervals (``hull``): a split ``k x a + (n - k) x b``
recomputes on the straight line between ``b``'s and ``a``'s recompute, and the planner prices
its peak on or above the line between theirs (the richer spec's working set is paid once,
whatever k). ``hull`` is the gain at the lower convex hull of the compiled uniform specs'
(measured peak, recompute) points: what a split whose measured peak lies on that line would
gain. Where the two uniform specs around a budget recompute within 20% of each other, a split
on the line cannot gain 20%; where XLA measures a split below the line, the gain exceeds
``hull``.

Memory is XLA's compiled memory analysis: exact and free of noise; recompute is the
analytic FLOPs the backward pass repeats, as a share of the step's (``MemoryPlan``).

    python benchmarks/speed/bench_per_layer.py            # tiny, 6 layers, B4 T1024
    python benchmarks/speed/bench_per_layer.py --quick    # 4 layers, B2 T512, one budget per interval
    python benchmarks/speed/bench_per_layer.py --table-from benchmarks/results/per_layer.json  # no compile
"""

import argparse
import itertools
import json
import os
import platform
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness
import harness
import jax
import matplotlib
import numpy as np
from rich.console import Console

from jaxckpt import nn, plan, remat
from jaxckpt.plan._solver import CHECK_MARGIN, MAX_ATTEMPTS, PREDICTION_MARGIN

matplotlib.use("Agg")
import matplotlib.pyplot as plt

MIB = 2**20
GOAL_REDUCTION = 0.20  # per-layer recompute at least 20% below the uniform plan's


def workload(quick: bool, n_layers: int | None = None) -> plan.Workload:
    """The planned step: ``tiny`` (d 128) at 6 layers, B4 T1024, where the layers' activations,
    not the state, set the peaks (``--quick``: 4 layers, B2 T512)."""
    layers = n_layers or (4 if quick else 6)
    config = nn.TransformerConfig.preset("tiny", n_layers=layers)
    return plan.Workload(config, batch=2 if quick else 4, seq=512 if quick else 1024)


class Measured:
    """``plan.measure`` per spec, each compiled once; each compile is logged to ``console``."""

    def __init__(self, w: plan.Workload, console: Console | None = None):
        self.workload, self.reports, self.console = w, {}, console

    def __call__(self, spec):
        if spec not in self.reports:
            self.reports[spec] = plan.measure(self.workload, spec)
            if self.console is not None:
                self.console.print(
                    f"  compiled {label(spec)}: {self.reports[spec].peak / MIB:.2f} MiB", style="dim"
                )
        return self.reports[spec]


def _choice(w: plan.Workload, spec) -> plan.Choice:
    if isinstance(spec, remat.Layered):
        return plan.choice_layered(w, spec)
    return plan.choice(w, spec)


def interval_budgets(peaks: list[int], per_interval: int) -> list[int]:
    """``per_interval`` budgets spread evenly inside each interval between consecutive
    ``peaks`` (sorted, distinct)."""
    budgets = []
    for low, high in itertools.pairwise(peaks):
        budgets += [int(b) for b in np.linspace(low, high, per_interval + 2)[1:-1]]
    return budgets


def hull(points: list[tuple[int, float]], budget: int, uniform: float) -> float:
    """The least recompute a split of two uniform specs can reach at ``budget``, as its gain
    over the best uniform spec's recompute ``uniform``: ``points`` are the uniform specs'
    ``(measured peak, recompute share)``. A split's recompute lies on the straight line
    between its two specs' and its peak near it (never below it in the planner's pricing), so
    no split beats the lower convex hull of the points: the answer is that hull at
    ``budget``."""
    if uniform == 0:
        return 0.0
    hull = uniform
    for pa, ra in points:
        for pb, rb in points:
            if pb <= budget < pa:  # b fits, a does not: the share of a's layers that does
                share = (budget - pb) / (pa - pb)
                hull = min(hull, rb + share * (ra - rb))
    return 1 - hull / uniform


def sweep(w: plan.Workload, per_interval: int, console: Console) -> dict:
    """The per-layer plan against the best uniform spec, ``per_interval`` budgets in each
    interval between the measured peaks of the uniform specs, from ``full``'s to no remat's.

    The uniform specs are ``plan.uniform_candidates`` (the remat'd presets and the MILP's
    solutions across the range, reduced to their frontier), their measured frontier, and the
    MILP's solution at each budget (``plan.solve``, what ``plan_memory`` compiles first), each
    compiled once: the uniform answer at a budget is the one of least recompute whose measured
    peak fits. The per-layer plan is ``plan_memory(per_layer=True)``'s search over the same
    uniform specs: the splits predicted within 5% over the budget (``PREDICTION_MARGIN``),
    compiled cheapest first until one fits (``MAX_ATTEMPTS`` at most). A uniform spec predicted more
    than ``CHECK_MARGIN`` over a budget is not compiled for it.
    """
    measured = Measured(w, console)
    step = plan.step_flops(w)
    none = remat.get("none")
    frontier = list(plan.uniform_candidates(w))
    peaks = sorted({measured(s).peak for s in frontier} | {measured(none).peak})
    budgets = interval_budgets(peaks, per_interval)
    anchors = sorted((measured(s).peak, label(s)) for s in [*frontier, none])
    uniform = set(frontier)
    for budget in budgets:
        spec = plan.solve(w, int(budget * (1 + PREDICTION_MARGIN)))
        if spec is not None and spec.enabled and not spec.offload and not spec.compress:
            uniform.add(spec)
    uniform = sorted(uniform, key=lambda s: plan.choice(w, s).recompute_flops)
    uniform_set = set(uniform)
    rows = []
    for budget in budgets:
        # the model is within CHECK_MARGIN of XLA: a spec predicted further over is not compiled
        plausible = (s for s in uniform if plan.predict(w, s).total <= budget * (1 + CHECK_MARGIN))
        best = next((s for s in plausible if measured(s).peak <= budget), remat.get("full"))
        choices = plan.layered_choices(w, int(budget * (1 + PREDICTION_MARGIN)), candidates=uniform)
        tried = choices[:MAX_ATTEMPTS]
        layered = next((c for c in tried if measured(c.spec).peak <= budget), None)
        u = plan.choice(w, best)
        p = layered or u
        cheapest = choices[0] if choices else p
        row = {
            "budget_bytes": budget,
            "interval": interval(budget, anchors),
            "uniform": _figures(w, best, u, measured, step),
            "per_layer": _figures(w, p.spec, p, measured, step),
            "reduction": 1 - p.recompute_flops / u.recompute_flops if u.recompute_flops else 0.0,
            "cheapest_predicted": {
                "remat": label(cheapest.spec),
                "recompute_fraction": cheapest.recompute_flops / step,
                "predicted_bytes": cheapest.predicted.total,
                "measured_bytes": measured.reports[cheapest.spec].peak
                if cheapest.spec in measured.reports
                else None,
            },
            "compiled_splits": sum(1 for c in tried if c.spec in measured.reports),
        }
        rows.append(row)
        a, b = row["uniform"], row["per_layer"]
        console.print(
            f"{budget / MIB:8.2f} MiB: uniform {a['remat']} {a['recompute_fraction']:.3f}, "
            f"per-layer {b['remat']} {b['recompute_fraction']:.3f}"
        )
    # the hull of every uniform spec compiled on the way (the frontier's all are)
    points = [
        (m.peak, plan.choice(w, s).recompute_flops / step)
        for s, m in measured.reports.items()
        if s in uniform_set
    ]
    for row in rows:
        row["hull"] = hull(points, row["budget_bytes"], row["uniform"]["recompute_fraction"])
    return {
        "full_peak": measured(remat.get("full")).peak,
        "none_peak": measured(none).peak,
        "uniform_specs": [
            {
                "remat": label(s),
                "recompute_fraction": plan.choice(w, s).recompute_flops / step,
                "predicted_bytes": plan.predict(w, s).total,
                "measured_bytes": measured.reports[s].peak if s in measured.reports else None,
            }
            for s in uniform
        ],
        "compiles": len(measured.reports),
        "rows": rows,
    }


def interval(budget: int, anchors: list[tuple[int, str]]) -> str:
    """``"a < b"``: the uniform specs whose measured peaks surround ``budget``."""
    below = max((a for a in anchors if a[0] <= budget), default=None)
    above = min((a for a in anchors if a[0] > budget), default=None)
    return f"{below[1] if below else '-'} < {above[1] if above else '-'}"


def _figures(w: plan.Workload, spec, c: plan.Choice, measured: Measured, step: int) -> dict:
    return {
        "remat": label(spec),
        "recompute_fraction": c.recompute_flops / step,
        "predicted_bytes": c.predicted.total,
        "measured_bytes": measured(spec).peak,
    }


def label(spec) -> str:
    """A preset's name, a solved spec's saved tags, a ``Layered`` spec's groups in those terms."""
    if isinstance(spec, remat.Layered):
        return " + ".join(f"{count}x{label(group)}" for count, group in spec.groups)
    name = plan.spec_name(spec)
    if name != "solved":
        return name
    tags = ",".join(sorted(str(t).removesuffix("_proj") for t in spec.save))
    return f"save{{{tags}}}" + ("+dots" if spec.save_dots else "")


def print_table(result: dict, console: Console) -> None:
    columns = (
        "budget MiB",
        "uniform (recompute, pred/meas MiB)",
        "per-layer (recompute, pred/meas MiB)",
        "less recompute",
        "hull",
    )
    table = harness.table(
        "per-layer plans against the best uniform spec (XLA:CPU compiled)", "between", columns
    )
    for row in result["rows"]:
        u, p = row["uniform"], row["per_layer"]
        table.add_row(
            row["interval"],
            f"{row['budget_bytes'] / MIB:.2f}",
            _cell(u),
            _cell(p),
            f"{row['reduction']:.0%}",
            f"{row['hull']:.0%}",
        )
    console.print(table)


def _cell(figures: dict) -> str:
    return (
        f"{figures['remat']} ({figures['recompute_fraction']:.1%}, "
        f"{figures['predicted_bytes'] / MIB:.2f}/{figures['measured_bytes'] / MIB:.2f})"
    )


def goals(result: dict) -> dict:
    """The gain per interval between uniform specs, the budgets meeting the goal, how close
    the per-layer predictions were, and whether every plan fit."""
    rows = result["rows"]
    reductions = [r["reduction"] for r in rows]
    errors = [abs(r["per_layer"]["predicted_bytes"] / r["per_layer"]["measured_bytes"] - 1) for r in rows]
    intervals = {}
    for r in rows:
        intervals.setdefault(r["interval"], []).append(round(r["reduction"], 3))
    return {
        "median_reduction": statistics.median(reductions),
        "best_reduction": max(reductions),
        "budgets_meeting_goal": sum(x >= GOAL_REDUCTION for x in reductions),
        "budgets": len(rows),
        "reduction_by_interval": intervals,
        "max_prediction_error": max(errors),
        "within_budget": all(r["per_layer"]["measured_bytes"] <= r["budget_bytes"] for r in rows),
    }


def plot(result: dict, path: Path) -> None:
    """Recompute share against budget, uniform and per-layer, the uniform specs' measured
    peaks marked."""
    rows = result["rows"]
    budgets = [r["budget_bytes"] / MIB for r in rows]
    fig, ax = plt.subplots(figsize=(7.2, 4.2))
    for key, name, style in (("uniform", "best uniform spec", "o-"), ("per_layer", "per-layer plan", "s-")):
        ax.plot(budgets, [100 * r[key]["recompute_fraction"] for r in rows], style, label=name)
    for spec in result["uniform_specs"]:
        if spec["measured_bytes"] is not None and spec["remat"] in ("full", "save_attn", "minimal"):
            ax.axvline(spec["measured_bytes"] / MIB, color="grey", lw=0.8, ls=":")
            ax.annotate(spec["remat"], (spec["measured_bytes"] / MIB, 1), rotation=90, fontsize=8, ha="right")
    ax.set_xscale("log")
    ax.set_xlabel("memory budget (MiB, XLA:CPU, log scale)")
    ax.set_ylabel("recompute (% of the step's FLOPs)")
    ax.set_title("Recompute at each budget: one spec for all layers vs per layer")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 layers, B2 T512, one budget per interval")
    parser.add_argument(
        "--per-interval", type=int, default=None, help="budgets between two specs (default 2; --quick 1)"
    )
    parser.add_argument("--layers", type=int, default=None, help="layers (default 6; --quick 4)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/per_layer.json"))
    parser.add_argument(
        "--table-from",
        type=Path,
        metavar="JSON",
        help="print the table (and draw --plot) of a written result",
    )
    parser.add_argument("--plot", type=Path, default=Path("docs/assets/per_layer_plans.png"))
    args = parser.parse_args(argv)
    console = Console(width=max(Console().width, 190))  # the table's rows unwrapped
    if args.table_from is not None:
        result = json.loads(args.table_from.read_text())
        print_table(result, console)
        console.print(result["goals"])
        plot(result, args.plot)
        return
    w = workload(args.quick, args.layers)
    c = w.config
    console.print(f"tiny: {c.n_layers} layers, d {c.d_model}, V {c.vocab_size}, B{w.batch} T{w.seq}")
    result = sweep(w, args.per_interval or (1 if args.quick else 2), console)
    print_table(result, console)
    result["goals"] = goals(result)
    console.print(result["goals"])
    plot(result, args.plot)
    payload = {
        "config": c.to_dict(),
        "B": w.batch,
        "T": w.seq,
        "backend": jax.default_backend(),
        "cpu_count": os.cpu_count(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "versions": {"jax": jax.__version__, "python": platform.python_version()},
        **result,
    }
    harness.write_json(args.out, payload, default=str)
    console.print(f"wrote {args.out} and {args.plot}")


if __name__ == "__main__":
    main()
