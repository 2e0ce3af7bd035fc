"""Planner: the analytic model against XLA, and the solver against the presets and the cost rule.

Four parts, in one run:

1. accuracy: predicted (``plan.predict``) against measured (``plan.measure``) peak, for every
   preset on three configs: ``tiny`` (B2 T256), ``small`` (B2 T512) and a 2-layer GPT-2 with
   a 512-token vocabulary (B2 T256; the full vocabulary's optimizer state would hide the
   activations).
2. pareto: on ``small``, measured temp memory against recompute FLOPs and against step
   time, for every preset and for ``plan_memory`` at budgets spread evenly from the
   full-remat peak to the no-remat peak (``results/pareto.png``).
3. cost rule: ``plan_memory`` given the measured peak of ``plan.by_cost(threshold)`` as its
   budget must never recompute more than the rule does; one threshold between each pair of
   adjacent per-tag FLOPs-per-byte ratios, so every spec the rule can return is tried.
4. targets: at each budget, the solver's step time over that of the fastest preset whose
   measured peak fits the same budget.

Memory is XLA's compiled memory analysis: exact and free of noise. Step times are medians
of steps interleaved round-robin over all rows (as ``jaxckpt compare`` does), so machine
noise hits every row alike; they are reported as ratios within the run, never bare. The
offload presets are skipped where host memory is not separate from device memory (CPU:
XLA counts the offloaded bytes as device memory there, as ``jaxckpt compare`` notes).

    python benchmarks/speed/bench_planner.py            # parts 2-4 on small: 8 budgets, 5 timed steps
    python benchmarks/speed/bench_planner.py --quick    # parts 2-4 on tiny: 3 budgets, 1 timed step
"""

import argparse
import dataclasses
import itertools
import os
import platform
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness
import harness
import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
from flax import nnx
from rich.console import Console
from rich.progress import track
from rich.table import Table

from jaxckpt import nn, plan, remat
from jaxckpt.remat import RematSpec
from jaxckpt.train import ByteBatches, Trainer, load_tokens, offload_saves_memory

matplotlib.use("Agg")
import matplotlib.pyplot as plt

MIB = 2**20
GOAL_ERROR = 0.05  # median |predicted - measured| / measured
GOAL_RATIO = 1.05  # solver step time / fastest fitting preset's
OFFLOAD_PRESETS = tuple(name for name, spec in remat.PRESETS.items() if spec.offload)
SHORT_TAGS = {"norm_out": "norm", "attn_out": "o", "attn_lse": "lse", "out_proj": "proj", "layer_input": "x"}


@dataclasses.dataclass(frozen=True)
class Case:
    """A config at one batch and sequence length."""

    name: str
    config: nn.TransformerConfig
    batch: int
    seq: int

    @property
    def workload(self) -> plan.Workload:
        """The planner's view of the case (one device, AdamW)."""
        return plan.Workload(self.config, self.batch, self.seq)

    def describe(self) -> str:
        c = self.config
        shape = f"{c.family}, {c.n_layers} layers, d {c.d_model}, V {c.vocab_size}"
        return f"{self.name} ({shape}) B{self.batch} T{self.seq}"


CASES = (
    Case("tiny", nn.TransformerConfig.preset("tiny"), 2, 256),
    Case("small", nn.TransformerConfig.preset("small"), 2, 512),
    Case("gpt2-2L", nn.TransformerConfig.preset("gpt2", n_layers=2, vocab_size=512), 2, 256),
)
PARETO_CASE = "small"


def _tags(tags) -> str:
    """Short tag names; ``all but {...}`` when that is shorter."""
    every = {t for t in remat.Tag if t != remat.Tag.LAYER_INPUT}
    name = lambda t: SHORT_TAGS.get(str(t), str(t).removesuffix("_proj").removeprefix("mlp_"))
    short = lambda ts: ",".join(sorted(map(name, ts)))
    rest = every - set(tags)
    if set(tags) == every:
        return "all"
    return f"all but {short(rest)}" if set(tags) <= every and len(rest) < len(tags) else short(tags)


def label(spec: RematSpec) -> str:
    """A preset's name, or the spec in short tag names (``save{q,k,v}``, ``save{all but norm}``)."""
    name = plan.spec_name(spec)
    if name != "solved":
        return name
    parts = [f"save{{{_tags(spec.save)}}}"]
    if spec.offload:
        parts.append(f"offload{{{_tags(spec.offload)}}}")
    if spec.save_dots:
        parts.append("dots")
    if spec.layers_per_checkpoint > 1:
        parts.append(f"k={spec.layers_per_checkpoint}")
    return "+".join(parts)


class Measured:
    """``plan.measure`` per (case, spec), each compiled once (``plan_memory``'s attempts count too)."""

    def __init__(self):
        self._reports = {}

    def __call__(self, case: Case, spec: RematSpec):
        key = (case.name, spec)
        if key not in self._reports:
            self._reports[key] = plan.measure(case.workload, spec)
        return self._reports[key]

    def add_attempts(self, case: Case, memory_plan) -> None:
        for spec, _, report in memory_plan.attempts:
            self._reports.setdefault((case.name, spec), report)


def preset_names(console: Console) -> list[str]:
    """Every preset, less the offload ones where host memory is not separate (as ``jaxckpt compare``)."""
    if offload_saves_memory():
        return list(remat.PRESETS)
    device = jax.devices()[0]
    console.print(
        f"skipped presets {', '.join(OFFLOAD_PRESETS)}: on {device.platform} there is no separate host "
        "memory to offload to (pinned_host, where present, is the same RAM and XLA counts the offloaded "
        "bytes as device memory), so their peak says nothing about offloading"
    )
    return [name for name in remat.PRESETS if name not in OFFLOAD_PRESETS]


# ----------------------------------------------------------------------------- 1. accuracy


def accuracy(measured: Measured, names: list[str], console: Console) -> list[dict]:
    """Predicted against measured peak for every preset x case."""
    rows = []
    for case in CASES:
        for name in names:
            with console.status(f"accuracy: {case.name} {name} ..."):
                report = measured(case, remat.get(name))
            predicted = plan.predict(case.workload, name).total
            rows.append(
                {
                    "config": case.name,
                    "remat": name,
                    "predicted_bytes": predicted,
                    "measured_bytes": report.peak,
                    "error": (predicted - report.peak) / report.peak,
                }
            )
    return rows


def accuracy_table(rows: list[dict]) -> Table:
    table = Table(title="1. peak memory: analytic prediction (plan.predict) vs XLA (plan.measure)")
    table.add_column("config")
    table.add_column("remat")
    for col in ("predicted MiB", "measured MiB", "error %"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            r["config"],
            r["remat"],
            f"{r['predicted_bytes'] / MIB:.1f}",
            f"{r['measured_bytes'] / MIB:.1f}",
            f"{100 * r['error']:+.1f}",
        )
    return table


# ----------------------------------------------------------------------------- 2. solver plans


def solver_plans(case: Case, budgets: list[int], measured: Measured, console: Console) -> list[dict]:
    """``plan_memory`` at each budget: ``{"budget", "plan"}`` or ``{"budget", "error"}``."""
    points = []
    for budget in budgets:
        with console.status(f"plan_memory {case.name} budget {budget / MIB:.1f} MiB ..."):
            try:
                memory_plan = plan.plan_memory(case.workload, budget)
            except plan.BudgetError as err:
                points.append({"budget": budget, "plan": None, "error": str(err)})
                continue
        measured.add_attempts(case, memory_plan)
        points.append({"budget": budget, "plan": memory_plan, "error": None})
    return points


# ----------------------------------------------------------------------------- 3. cost rule


def thresholds_between(case: Case) -> list[float]:
    """0, the geometric mean of each pair of adjacent tag ratios, and twice the largest ratio:
    one threshold for every distinct spec ``by_cost`` can return."""
    ratios = sorted(set(plan.tag_flops_per_byte(case.config, case.seq).values()))
    between = [float(np.sqrt(a * b)) for a, b in itertools.pairwise(ratios)]
    return [0.0, *between, 2.0 * ratios[-1]]


def cost_rule(case: Case, thresholds, measured: Measured, console: Console) -> list[dict]:
    """For each threshold: by_cost's spec and peak, and plan_memory's answer at that peak."""
    rows, solved = [], {}
    for threshold in thresholds:
        spec = plan.by_cost(threshold, case.config, case.seq)
        with console.status(f"cost rule: threshold {threshold:.4g} ..."):
            peak = measured(case, spec).peak
            if spec not in solved:
                try:
                    solved[spec] = plan.plan_memory(case.workload, peak)
                    measured.add_attempts(case, solved[spec])
                except plan.BudgetError:
                    solved[spec] = None
        answer = solved[spec]
        rule = plan.choice(case.workload, spec)
        rows.append(
            {
                "threshold": threshold,
                "by_cost": label(spec),
                "by_cost_spec": plan.spec_dict(spec),
                "by_cost_recompute_flops": rule.recompute_flops,
                "by_cost_predicted_bytes": rule.predicted.total,
                "by_cost_peak_bytes": peak,
                "solver": None if answer is None else label(answer.spec),
                "solver_spec": None if answer is None else plan.spec_dict(answer.spec),
                "solver_recompute_flops": None if answer is None else answer.recompute_flops,
                "solver_peak_bytes": None if answer is None else answer.measured.peak,
                "solver_not_worse": answer is not None and answer.recompute_flops <= rule.recompute_flops,
            }
        )
    return rows


def cost_table(rows: list[dict], case: Case) -> Table:
    title = f"3. solver (plan_memory) vs the cost rule plan.by_cost at equal budget, {case.describe()}"
    table = Table(title=title)
    table.add_column("threshold FLOP/B", justify="right")
    table.add_column("by_cost spec", overflow="fold")
    table.add_column("by_cost GFLOP", justify="right")
    table.add_column("by_cost pred/peak MiB", justify="right")
    table.add_column("solver spec (budget = by_cost peak)", overflow="fold")
    table.add_column("solver GFLOP", justify="right")
    table.add_column("solver peak MiB", justify="right")
    table.add_column("solver <= rule", justify="center")
    for r in rows:
        none = r["solver"] is None
        table.add_row(
            f"{r['threshold']:.4g}",
            r["by_cost"],
            f"{r['by_cost_recompute_flops'] / 1e9:.2f}",
            f"{r['by_cost_predicted_bytes'] / MIB:.1f}/{r['by_cost_peak_bytes'] / MIB:.1f}",
            "no fit" if none else r["solver"],
            "-" if none else f"{r['solver_recompute_flops'] / 1e9:.2f}",
            "-" if none else f"{r['solver_peak_bytes'] / MIB:.1f}",
            "yes" if r["solver_not_worse"] else "NO",
        )
    return table


# ----------------------------------------------------------------------------- timing


def time_specs(case: Case, specs: dict[str, RematSpec], steps: int, seed: int) -> dict[str, list[float]]:
    """Seconds of each timed step per label: every row compiled first, then one untimed
    warm-up step and ``steps`` timed steps, each round running every row once (round robin,
    as ``jaxckpt compare`` times its rows, so a slow spell of the machine hits every row)."""
    data = ByteBatches(load_tokens(None), case.batch, case.seq, seed=seed)
    shape = data.batch_at(0).shape
    trainers = {}
    for name, spec in specs.items():
        trainer = Trainer(nn.Transformer(case.config, rngs=nnx.Rngs(seed)), remat=spec)
        trainer.compile(shape)
        trainers[name] = trainer
    seconds: dict[str, list[float]] = {name: [] for name in specs}
    for step in track(range(steps + 1), description="training rows"):
        tokens = jnp.asarray(data.batch_at(step))
        for name, trainer in trainers.items():
            seconds[name] += harness.run_seconds(trainer.step, (tokens,), warmup=False)
    return {name: times[1:] for name, times in seconds.items()}


# ----------------------------------------------------------------------------- 4. targets


def targets(
    case: Case, presets: list[dict], points: list[dict], seconds: dict[str, list[float]]
) -> list[dict]:
    """At each budget: the solver's step time over the fastest preset's that fits it.

    "Fastest" and the ratio use the median step; the ratio of the best steps (minima) is a
    second estimate, less sensitive to noise that only ever adds time.
    """
    medians = {name: statistics.median(times) for name, times in seconds.items()}
    rows = []
    for point in points:
        budget, answer = point["budget"], point["plan"]
        fits = [p for p in presets if p["peak_bytes"] <= budget]
        best = min(fits, key=lambda p: medians[p["remat"]], default=None)
        solver = None if answer is None else label(answer.spec)
        ratio = min_ratio = None
        if solver is not None and best is not None:
            ratio = medians[solver] / medians[best["remat"]]
            min_ratio = min(seconds[solver]) / min(seconds[best["remat"]])
        rows.append(
            {
                "budget_bytes": budget,
                "solver": solver,
                "solver_peak_bytes": None if answer is None else answer.measured.peak,
                "solver_recompute_flops": None if answer is None else answer.recompute_flops,
                "solver_compiles": None if answer is None else len(answer.attempts),
                "fastest_preset": None if best is None else best["remat"],
                "fastest_preset_peak_bytes": None if best is None else best["peak_bytes"],
                "time_ratio": ratio,
                "min_time_ratio": min_ratio,
                "met": ratio is not None and ratio <= GOAL_RATIO,
            }
        )
    return rows


def targets_table(rows: list[dict], case: Case, steps: int) -> Table:
    title = (
        f"4. solver vs the fastest preset that fits, {case.describe()}; "
        f"step time ratio, median of {steps} interleaved steps after a warm-up"
    )
    table = Table(title=title)
    table.add_column("budget MiB", justify="right")
    table.add_column("solver spec", overflow="fold")
    table.add_column("peak MiB", justify="right")
    table.add_column("recompute GFLOP", justify="right")
    table.add_column("compiles", justify="right")
    table.add_column("fastest fitting preset")
    table.add_column("its peak MiB", justify="right")
    table.add_column("time solver/preset", justify="right")
    table.add_column("(best steps)", justify="right")
    for r in rows:
        table.add_row(
            f"{r['budget_bytes'] / MIB:.1f}",
            r["solver"] or "no fit",
            "-" if r["solver"] is None else f"{r['solver_peak_bytes'] / MIB:.1f}",
            "-" if r["solver"] is None else f"{r['solver_recompute_flops'] / 1e9:.1f}",
            "-" if r["solver"] is None else str(r["solver_compiles"]),
            r["fastest_preset"] or "none fits",
            "-" if r["fastest_preset"] is None else f"{r['fastest_preset_peak_bytes'] / MIB:.1f}",
            "-" if r["time_ratio"] is None else f"{r['time_ratio']:.3f}",
            "-" if r["min_time_ratio"] is None else f"{r['min_time_ratio']:.3f}",
        )
    return table


# ----------------------------------------------------------------------------- 2. pareto plot


def pareto_plot(presets: list[dict], solver: list[dict], case: Case, path: Path) -> None:
    """Temp MiB against recompute GFLOP (left) and against step time / no remat (right)."""
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.5), constrained_layout=True)
    for ax, key, xlabel in (
        (axes[0], "recompute_gflop", "recompute per step (GFLOP, analytic)"),
        (axes[1], "time_ratio", "step time / step time without remat (measured, median)"),
    ):
        for points, style, color, offset in (
            (presets, "o", "tab:blue", (5, 4)),
            (solver, "X", "tab:red", (5, -11)),
        ):
            ax.scatter(
                [p[key] for p in points], [p["temp_mib"] for p in points], marker=style, color=color, s=60
            )
            for p in points:
                ax.annotate(p["label"], (p[key], p["temp_mib"]), fontsize=7, color=color,
                            xytext=offset, textcoords="offset points")  # fmt: skip
        frontier = sorted(solver, key=lambda p: p["temp_mib"])
        ax.plot([p[key] for p in frontier], [p["temp_mib"] for p in frontier], color="tab:red", alpha=0.4)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("temp memory (MiB, XLA compiled)")
        ax.grid(alpha=0.3)
    axes[0].scatter([], [], marker="o", color="tab:blue", label="presets")
    axes[0].scatter([], [], marker="X", color="tab:red", label="plan_memory (budget in MiB)")
    axes[0].legend(loc="upper right")
    fig.suptitle(f"remat presets and solver plans, {case.describe()}, {jax.default_backend()}")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def pareto_points(case, names, points, measured, medians) -> tuple[list[dict], list[dict]]:
    """The presets' and the solver's points: label, temp MiB, peak, recompute GFLOP, time ratio."""
    base = medians["none"]

    def point(spec, name, text):
        report = measured(case, spec)
        flops = plan.choice(case.workload, spec).recompute_flops
        return {
            "label": text,
            "remat": name,
            "spec": plan.spec_dict(spec),
            "temp_mib": report.temp / MIB,
            "peak_bytes": report.peak,
            "recompute_gflop": flops / 1e9,
            "time_ratio": medians[name] / base,
        }

    presets = [point(remat.get(n), n, n) for n in names]
    by_spec: dict[RematSpec, list[int]] = {}
    for p in points:
        if p["plan"] is not None:
            by_spec.setdefault(p["plan"].spec, []).append(p["budget"])
    solver = []
    for spec, budgets in by_spec.items():
        text = "budget " + ",".join(f"{b / MIB:.0f}" for b in budgets)
        solver.append({**point(spec, label(spec), text), "budgets_bytes": budgets})
    return presets, solver


# ----------------------------------------------------------------------------- main


def budgets_between(case: Case, measured: Measured, n: int) -> list[int]:
    """``n`` budgets spread evenly from the full-remat peak to the no-remat peak (both measured)."""
    low = measured(case, remat.get("full")).peak
    high = measured(case, remat.get("none")).peak
    return [int(b) for b in np.linspace(low, high, n)]


def timed_specs(names: list[str], points: list[dict]) -> dict[str, RematSpec]:
    """Every preset, and each distinct solver spec that is not a preset."""
    specs = {name: remat.get(name) for name in names}
    for p in points:
        if p["plan"] is not None:
            specs.setdefault(label(p["plan"].spec), p["plan"].spec)
    return specs


def summary_lines(acc, cost, target_rows, seconds) -> tuple[list[str], dict]:
    """The goal lines (and the timing noise they should be read against), and their JSON."""
    errors = [abs(r["error"]) for r in acc]
    worst = max(acc, key=lambda r: abs(r["error"]))
    median = statistics.median(errors)
    goals = {"prediction": {"median_abs_error": median, "max_abs_error": abs(worst["error"])}}
    goals["prediction"]["met"] = median <= GOAL_ERROR
    lines = [
        f"prediction error: median {100 * median:.1f}%, max {100 * abs(worst['error']):.1f}% "
        f"({worst['remat']} on {worst['config']})",
        f"goal: median prediction error <= {100 * GOAL_ERROR:.0f}%: "
        f"{'met' if goals['prediction']['met'] else 'NOT met'} (measured {100 * median:.1f}%)",
    ]
    met = all(r["solver_not_worse"] for r in cost)
    goals["cost_rule"] = {
        "met": met,
        "thresholds": len(cost),
        "not_worse": sum(r["solver_not_worse"] for r in cost),
    }
    lines.append(
        f"goal: solver never recomputes more than by_cost at equal budget: {'met' if met else 'NOT met'} "
        f"({goals['cost_rule']['not_worse']}/{len(cost)} thresholds)"
    )
    ratios = [r["time_ratio"] for r in target_rows if r["time_ratio"] is not None]
    met = bool(ratios) and all(r["met"] for r in target_rows if r["solver"] is not None)
    goals["targets"] = {"max_ratio": max(ratios, default=None), "goal_ratio": GOAL_RATIO, "met": met}
    lines.append(
        f"goal: solver step time within {100 * (GOAL_RATIO - 1):.0f}% of the fastest fitting preset at "
        f"every budget: {'met' if met else 'NOT met'} (max ratio {max(ratios, default=float('nan')):.3f})"
    )
    spreads = sorted(max(times) / min(times) for times in seconds.values())
    goals["targets"]["step_spread_median"] = statistics.median(spreads)
    lines.append(
        f"timing noise: max/min of a row's timed steps is {statistics.median(spreads):.2f} (median over "
        f"{len(spreads)} rows, worst {spreads[-1]:.2f}); a time ratio inside that spread is not resolved"
    )
    return lines, goals


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: parts 2-4 on tiny, 3 budgets, 1 timed step"
    )
    parser.add_argument("--budgets", type=int, default=None, help="solver budgets (default 8; --quick 3)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per row (default 5; --quick 1)")
    parser.add_argument("--config", choices=[c.name for c in CASES], help="for parts 2-4 (default small)")
    parser.add_argument("--seed", type=int, default=0, help="parameter init and data order")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/planner.json"))
    parser.add_argument("--plot", type=Path, default=Path("benchmarks/results/pareto.png"))
    args = parser.parse_args(argv)
    n_budgets = args.budgets or (3 if args.quick else 8)
    steps = args.steps or (1 if args.quick else 5)
    if n_budgets < 2 or steps < 1:
        parser.error("--budgets must be >= 2 and --steps >= 1")
    console = Console(width=150)
    load_start = os.getloadavg()[0]
    measured = Measured()
    names = preset_names(console)
    case_name = args.config or ("tiny" if args.quick else PARETO_CASE)
    case = next(c for c in CASES if c.name == case_name)

    acc = accuracy(measured, names, console)
    console.print(accuracy_table(acc))
    console.log("accuracy done")
    points = solver_plans(case, budgets_between(case, measured, n_budgets), measured, console)
    console.log("solver plans done")
    cost = cost_rule(case, thresholds_between(case), measured, console)
    console.log("cost rule done")
    console.print(cost_table(cost, case))

    specs = timed_specs(names, points)
    console.print(f"timing {len(specs)} rows x {steps} steps, round-robin: {', '.join(specs)}")
    seconds = time_specs(case, specs, steps, args.seed)
    console.log("timing done")
    medians = {name: statistics.median(times) for name, times in seconds.items()}
    presets, solver = pareto_points(case, names, points, measured, medians)
    pareto_plot(presets, solver, case, args.plot)
    console.print(f"wrote {args.plot}")
    target_rows = targets(case, presets, points, seconds)
    console.print(targets_table(target_rows, case, steps))
    lines, goals = summary_lines(acc, cost, target_rows, seconds)
    for line in lines:
        console.print(line)
    load = {"start": load_start, "end": os.getloadavg()[0]}
    console.print(
        f"1-min load average: {load['start']:.2f} at start, {load['end']:.2f} at end, {os.cpu_count()} CPUs"
    )
    results = {"accuracy": acc, "points": points, "presets": presets, "solver": solver, "cost": cost}
    results |= {"targets": target_rows, "seconds": seconds, "goals": goals}
    write_json(args.out, case, names, steps, load, results)
    console.print(f"wrote {args.out}")


def write_json(path: Path, case: Case, names: list[str], steps: int, load: dict, r: dict) -> None:
    """Everything measured, as JSON (written atomically)."""
    payload = {
        "cases": [{"name": c.name, "config": c.config.to_dict(), "B": c.batch, "T": c.seq} for c in CASES],
        "pareto_case": case.name,
        "backend": jax.default_backend(),
        "skipped_presets": [n for n in remat.PRESETS if n not in names],
        "steps": steps,
        "cpu_count": os.cpu_count(),
        "load_average_1min": load,
        "versions": {"jax": jax.__version__, "python": platform.python_version()},
        "accuracy": r["accuracy"],
        "solver_plans": [
            {"budget_bytes": p["budget"], "error": p["error"], **(p["plan"].to_dict() if p["plan"] else {})}
            for p in r["points"]
        ],
        "pareto": {"presets": r["presets"], "solver": r["solver"]},
        "cost_rule": r["cost"],
        "targets": r["targets"],
        "step_seconds": r["seconds"],
        "goals": r["goals"],
    }
    harness.write_json(path, payload, default=str)


if __name__ == "__main__":
    main()
