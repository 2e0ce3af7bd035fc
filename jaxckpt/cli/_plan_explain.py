"""``jaxckpt plan --explain`` and ``--plot FILE``: where the chosen step's peak comes from
(``plan.explain``), printed as a table of the top contributors, given in ``--json`` as
``explain``, and drawn as a stacked timeline (``plan.save_timeline``)."""

import argparse
from pathlib import Path

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

from jaxckpt import plan


def plot_path(args: argparse.Namespace):
    """``--plot``'s file, checked before anything is compiled: a ``.html`` or ``.png`` that does
    not exist yet (or ``--force``)."""
    if (args.explain or args.plot) and args.max_seq:
        raise ValueError("--explain and --plot show one step: give --seq N, not --max-seq")
    if args.plot is None:
        if args.force:
            raise ValueError("--force replaces the file --plot FILE draws: give --plot")
        return None
    path = Path(args.plot)
    if path.suffix.lower() not in plan.PLOT_SUFFIXES:
        raise ValueError(
            f"--plot {args.plot}: the suffix {path.suffix!r} is not one of {', '.join(plan.PLOT_SUFFIXES)}"
        )
    if path.exists() and not args.force:
        raise ValueError(f"--plot {args.plot} exists; give --force to replace it")
    return path


def show_explanation(args: argparse.Namespace, why: plan.Explanation, title: str) -> None:
    """``--explain`` and ``--plot``: the top contributors at the peak printed (``--json`` has
    them in its ``explain``), the timeline drawn."""
    if not args.json and args.explain:
        console = Console()
        t = explain_table(why)
        wide = console.options.update_width(1000)
        console.width = max(console.width, Measurement.get(console, wide, t).maximum)  # never wrap it
        console.print(t)
        console.print(why.describe())
    if args.plot:
        written = plan.save_timeline(why, args.plot, force=args.force, title=title)
        if not args.json:
            print(f"timeline drawn into {written}")


def explain_table(why: plan.Explanation, top: int = 10) -> Table:
    """The ``top`` largest categories at the peak: bytes, share of the compiler's peak, how
    many buffers, the largest of them and its source line."""
    t = Table(
        title=f"At the peak ({why.measured_on}, point {why.peak_index} of {len(why.timeline)})",
        caption=f"{why.attributed:.1%} of the compiler's peak {plan.format_bytes(why.peak_bytes)} named",
    )
    for column in ("category", "bytes", "of peak", "buffers", "largest buffer", "source"):
        t.add_column(column, justify="right" if column in ("bytes", "of peak", "buffers") else "left")
    for row in why.top(top):
        t.add_row(
            row["category"],
            plan.format_bytes(row["bytes"]),
            f"{row['share']:.1%}",
            str(row["buffers"]),
            row["largest"],
            row["source"],
        )
    return t


def explain_dict(why: plan.Explanation, top: int = 10) -> dict:
    """``--json``'s ``explain``: the figures and the top contributors, not the whole timeline."""
    return {
        "peak_bytes": why.peak_bytes,
        "timeline_peak": why.timeline_peak,
        "attributed": why.attributed,
        "measured_on": why.measured_on,
        "at_peak": why.at_peak,
        "top": why.top(top),
    }
