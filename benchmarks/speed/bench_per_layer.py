"""Per-layer plans: the recompute of ``plan_memory(per_layer=True)`` against the best uniform
spec, over a sweep of budgets, every plan confirmed by XLA:CPU's compiled memory analysis.

A uniform spec steps between the presets' peaks: a budget between ``full`` and ``save_attn``
gets ``full`` (or a spec the MILP solves for) and leaves the rest unused. A per-layer plan
gives the first k layers a richer spec than the rest (``remat.Layered``), so the budget is
used. For each budget, spread evenly from ``full``'s measured peak to ``minimal``'s: the best
uniform spec that XLA confirms fits, and the per-layer plan, compiled until it fits (``sweep``);
the goal is a per-layer recompute at least ``GOAL_REDUCTION`` below the uniform one's.

Memory is XLA's compiled memory analysis: exact and free of noise; recompute is the
analytic FLOPs the backward pass repeats, as a share of the step's (``MemoryPlan``).

    python benchmarks/speed/bench_per_layer.py            # tiny, 8 layers, B2 T256: 8 budgets
    python benchmarks/speed/bench_per_layer.py --quick    # 4 layers, B2 T128: 3 budgets
"""

import argparse
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
from jaxckpt.plan._solver import MAX_ATTEMPTS, PREDICTION_MARGIN

matplotlib.use("Agg")
import matplotlib.pyplot as plt

MIB = 2**20
GOAL_REDUCTION = 0.20  # per-layer recompute at least 20% below the uniform plan's


def workload(quick: bool, n_layers: int | None = None) -> plan.Workload:
    """The planned step: ``tiny`` (d 128) at 8 layers, B2 T256 (``--quick``: 4 layers, T128)."""
    layers = n_layers or (4 if quick else 8)
    config = nn.TransformerConfig.preset("tiny", n_layers=layers)
    return plan.Workload(config, batch=2, seq=128 if quick else 256)


class Measured:
    """``plan.measure`` per spec, each compiled once."""

    def __init__(self, w: plan.Workload):
        self.workload, self.reports = w, {}

    def __call__(self, spec):
        if spec not in self.reports:
            self.reports[spec] = plan.measure(self.workload, spec)
        return self.reports[spec]


def sweep(w: plan.Workload, n_budgets: int, console: Console) -> dict:
    """At ``n_budgets`` budgets from ``full``'s measured peak to ``minimal``'s: the best uniform
    spec that XLA confirms fits, and the per-layer plan.

    The uniform specs are ``plan.uniform_candidates`` (the presets and the MILP's solutions
    across the range) and the MILP's solution at each budget (``plan.solve``, what
    ``plan_memory`` compiles first), each compiled once: the uniform answer at a budget is
    the one of least recompute whose measured peak fits. The per-layer plan is
    ``plan_memory(per_layer=True)``'s search over the same uniform specs: the splits
    predicted within 5% over the budget (``PREDICTION_MARGIN``), compiled cheapest first
    until one fits.
    """
    measured = Measured(w)
    low, high = measured(remat.get("full")).peak, measured(remat.get("minimal")).peak
    budgets = [int(b) for b in np.linspace(low, high, n_budgets + 2)[1:-1]]
    uniform = set(plan.uniform_candidates(w))
    for budget in budgets:
        spec = plan.solve(w, int(budget * (1 + PREDICTION_MARGIN)))
        if spec is not None and spec.enabled and not spec.offload:
            uniform.add(spec)
    uniform = sorted(uniform, key=lambda s: plan.choice(w, s).recompute_flops)
    step = plan.step_flops(w)
    rows = []
    for budget in budgets:
        best = next((s for s in uniform if measured(s).peak <= budget), remat.get("full"))
        choices = plan.layered_choices(w, int(budget * (1 + PREDICTION_MARGIN)), candidates=uniform)
        layered = next((c for c in choices[:MAX_ATTEMPTS] if measured(c.spec).peak <= budget), None)
        u = plan.choice(w, best)
        p = layered or u
        row = {
            "budget_bytes": budget,
            "uniform": {
                "remat": label(best),
                "recompute_fraction": u.recompute_flops / step,
                "predicted_bytes": u.predicted.total,
                "measured_bytes": measured(best).peak,
            },
            "per_layer": {
                "remat": label(p.spec),
                "recompute_fraction": p.recompute_flops / step,
                "predicted_bytes": p.predicted.total,
                "measured_bytes": measured(p.spec).peak,
            },
            "reduction": 1 - p.recompute_flops / u.recompute_flops if u.recompute_flops else 0.0,
        }
        rows.append(row)
        a, b = row["uniform"], row["per_layer"]
        console.print(
            f"{budget / MIB:8.2f} MiB: uniform {a['remat']} {a['recompute_fraction']:.3f}, "
            f"per-layer {b['remat']} {b['recompute_fraction']:.3f}"
        )
    return {"full_peak": low, "minimal_peak": high, "compiles": len(measured.reports), "rows": rows}


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
        "uniform recompute",
        "uniform peak MiB",
        "per-layer",
        "per-layer recompute",
        "predicted MiB",
        "measured MiB",
        "less recompute",
    )
    table = harness.table("per-layer plans against the uniform plan (XLA:CPU compiled)", "uniform", columns)
    for row in result["rows"]:
        u, p = row["uniform"], row["per_layer"]
        table.add_row(
            u["remat"],
            f"{row['budget_bytes'] / MIB:.2f}",
            f"{u['recompute_fraction']:.1%}",
            f"{u['measured_bytes'] / MIB:.2f}",
            p["remat"],
            f"{p['recompute_fraction']:.1%}",
            f"{p['predicted_bytes'] / MIB:.2f}",
            f"{p['measured_bytes'] / MIB:.2f}",
            f"{row['reduction']:.0%}",
        )
    console.print(table)


def goals(result: dict) -> dict:
    """The budgets where the uniform plan leaves the budget unused (its peak more than one
    layer's step below it: ``in_between``), and the per-layer reduction there."""
    rows = result["rows"]
    reductions = [r["reduction"] for r in rows]
    errors = [abs(r["per_layer"]["predicted_bytes"] / r["per_layer"]["measured_bytes"] - 1) for r in rows]
    return {
        "median_reduction": statistics.median(reductions),
        "budgets_meeting_goal": sum(x >= GOAL_REDUCTION for x in reductions),
        "budgets": len(rows),
        "max_prediction_error": max(errors),
        "within_budget": all(r["per_layer"]["measured_bytes"] <= r["budget_bytes"] for r in rows),
    }


def plot(result: dict, path: Path) -> None:
    """Recompute share against budget, uniform and per-layer."""
    rows = result["rows"]
    budgets = [r["budget_bytes"] / MIB for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for key, label, style in (("uniform", "best uniform spec", "o-"), ("per_layer", "per-layer plan", "s-")):
        ax.plot(budgets, [100 * r[key]["recompute_fraction"] for r in rows], style, label=label)
    for name, peak in (("full", result["full_peak"]), ("minimal", result["minimal_peak"])):
        ax.axvline(peak / MIB, color="grey", lw=0.8, ls=":")
        ax.annotate(name, (peak / MIB, ax.get_ylim()[1] * 0.95), rotation=90, fontsize=8, ha="right")
    ax.set_xlabel("memory budget (MiB, XLA:CPU)")
    ax.set_ylabel("recompute (% of the step's FLOPs)")
    ax.set_title("Recompute at each budget: one spec for all layers vs per layer")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 layers, T128, 3 budgets")
    parser.add_argument("--budgets", type=int, default=None, help="budgets (default 8; --quick 3)")
    parser.add_argument("--layers", type=int, default=None, help="layers (default 8; --quick 4)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/per_layer.json"))
    parser.add_argument("--plot", type=Path, default=Path("docs/assets/per_layer_plans.png"))
    args = parser.parse_args(argv)
    console = Console()
    w = workload(args.quick, args.layers)
    c = w.config
    console.print(f"tiny: {c.n_layers} layers, d {c.d_model}, V {c.vocab_size}, B{w.batch} T{w.seq}")
    result = sweep(w, args.budgets or (3 if args.quick else 8), console)
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
        "versions": {"jax": jax.__version__, "python": platform.python_version()},
        **result,
    }
    harness.write_json(args.out, payload, default=str)
    console.print(f"wrote {args.out} and {args.plot}")


if __name__ == "__main__":
    main()
