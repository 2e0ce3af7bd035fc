"""The stacked timeline of an ``Explanation``, by kind, as PyTorch's ``memory_viz`` draws one:
a self-contained HTML page (plotly, its JavaScript inline: it opens offline) with each program
point's largest buffers on hover, or a PNG (matplotlib). Both are imported when drawing, not
with ``jaxckpt``."""

import os
from pathlib import Path

from jaxckpt._sizes import format_bytes
from jaxckpt.plan._buffer_categories import KINDS
from jaxckpt.plan._explain import Explanation

PLOT_SUFFIXES = (".html", ".png")
"""The files ``save_timeline`` writes."""

_COLORS = dict(
    zip(
        KINDS,
        ("#4c78a8", "#f58518", "#54a24b", "#b279a2", "#e45756", "#72b7b2", "#eeca3b", "#9d755d"),
        strict=True,
    )
)
_MAX_POINTS = 4000
"""More program points than this are drawn one in every few (the page stays small)."""


def save_timeline(
    explanation: Explanation, path: "str | os.PathLike", *, force: bool = False, title: str = ""
) -> Path:
    """Draws ``explanation``'s timeline, stacked by kind, into ``path`` (``.html`` or ``.png``).

    Args:
        explanation: what ``plan.explain`` returned.
        path: the file; its suffix picks the format.
        force: replace an existing file (otherwise it is an error).
        title: the first line of the title (the peak follows it).

    Returns:
        The path written.

    Raises:
        ValueError: for a suffix other than ``.html`` or ``.png``.
        FileExistsError: when ``path`` exists and ``force`` is False.
        RuntimeError: for ``.html`` without plotly installed.

    Example:
        >>> import jax, jax.numpy as jnp, tempfile, pathlib
        >>> from jaxckpt import plan
        >>> from jaxckpt.plan._explain_plot import save_timeline
        >>> why = plan.explain(jnp.sin, jax.ShapeDtypeStruct((37, 40), jnp.float32))
        >>> with tempfile.TemporaryDirectory() as d:
        ...     save_timeline(why, pathlib.Path(d) / "sin.png").stat().st_size > 1000
        True
    """
    path = Path(path)
    if path.suffix.lower() not in PLOT_SUFFIXES:
        raise ValueError(f"plot: {str(path)!r} has the suffix {path.suffix!r}; give a .html or a .png file")
    if path.exists() and not force:
        raise FileExistsError(f"plot: {str(path)!r} exists; give --force (force=True) to replace it")
    heading = peak_title(explanation, title)
    if path.suffix.lower() == ".html":
        _html(explanation, path, heading)
    else:
        _png(explanation, path, heading)
    return path


def peak_title(explanation: Explanation, title: str = "") -> str:
    """The plot's title: ``title``, then the compiler's peak and the timeline's maximum.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jaxckpt import plan
        >>> why = plan.explain(jnp.sin, jax.ShapeDtypeStruct((37, 40), jnp.float32))
        >>> peak_title(why)
        'peak 11.56 KiB (xla-cpu); live at most 11.56 KiB, 100.0% named'
    """
    figures = (
        f"peak {format_bytes(explanation.peak_bytes)} ({explanation.measured_on}); live at most "
        f"{format_bytes(explanation.timeline_peak)}, {explanation.attributed:.1%} named"
    )
    return f"{title}: {figures}" if title else figures


def _byte_ticks(top: int) -> list[int]:
    """Four to eight round ticks from 0 to above ``top``, in binary units (MiB, not millions).

    Example:
        >>> [t // 2**20 for t in _byte_ticks(17_500_000)]
        [0, 4, 8, 12, 16, 20]
    """
    unit = 1
    while unit * 1024 <= top:
        unit *= 1024
    steps = [max(1, unit * f // 8) for f in (1, 2, 4)] + [unit * 2**k for k in range(10)]
    step = next(s for s in steps if top / s <= 7)
    return list(range(0, top + step, step))


def _series(explanation: Explanation) -> tuple[list[int], dict]:
    points = len(explanation.timeline)
    every = max(1, -(-points // _MAX_POINTS))
    xs = list(range(0, points, every))
    if explanation.peak_index not in xs:
        xs = sorted({*xs, explanation.peak_index})
    return xs, {
        kind: [explanation.by_kind[kind][x] for x in xs] for kind in KINDS if kind in explanation.by_kind
    }


def _html(explanation: Explanation, path: Path, heading: str) -> None:
    try:
        import plotly.graph_objects as go
    except ImportError as err:
        raise RuntimeError(
            "plot: a .html timeline needs plotly (pip install plotly); a .png needs matplotlib"
        ) from err
    xs, series = _series(explanation)
    points, largest = explanation.program_points, explanation.largest_at
    labels = [
        f"{points[x] if x < len(points) else x}<br>{largest[x] if x < len(largest) else ''}" for x in xs
    ]
    figure = go.Figure()
    for kind, ys in series.items():
        figure.add_trace(
            go.Scatter(
                x=xs,
                y=ys,
                name=kind,
                stackgroup="bytes",
                line=dict(width=0.5, color=_COLORS[kind]),
                customdata=[[format_bytes(y), label] for y, label in zip(ys, labels, strict=True)],
                hovertemplate=kind + ": %{customdata[0]}<br>point %{x}: %{customdata[1]}<extra></extra>",
            )
        )
    figure.add_hline(
        y=explanation.peak_bytes,
        line_dash="dash",
        line_color="black",
        annotation_text=f"compiler's peak {format_bytes(explanation.peak_bytes)}",
    )
    ticks = _byte_ticks(max(explanation.peak_bytes, explanation.timeline_peak))
    figure.update_layout(
        title=heading,
        xaxis_title="program point (XLA's schedule)",
        yaxis=dict(title="bytes live", tickvals=ticks, ticktext=[format_bytes(t) for t in ticks]),
        hovermode="x unified",
        template="plotly_white",
        height=520,
    )
    path.write_text(figure.to_html(include_plotlyjs=True, full_html=True, config={"displaylogo": False}))


def _png(explanation: Explanation, path: Path, heading: str) -> None:
    # A bare Figure draws through its own Agg canvas: no pyplot, and no backend switched under a
    # notebook's inline plotting.
    from matplotlib.figure import Figure

    xs, series = _series(explanation)
    figure = Figure(figsize=(10, 5), dpi=100)
    axes = figure.subplots()
    axes.stackplot(xs, *series.values(), labels=list(series), colors=[_COLORS[k] for k in series])
    axes.axhline(explanation.peak_bytes, color="black", linestyle="--", linewidth=1, label="compiler's peak")
    axes.set_title(heading, fontsize=10)
    axes.set_xlabel("program point (XLA's schedule)")
    axes.set_ylabel("bytes live")
    ticks = _byte_ticks(max(explanation.peak_bytes, explanation.timeline_peak))
    axes.set_yticks(ticks, [format_bytes(t) for t in ticks])
    axes.legend(loc="upper left", fontsize=8)
    figure.tight_layout()
    figure.savefig(path)
