"""Plot helpers shared by the notebooks: one figure style, three kinds of chart.

Import from a notebook in this folder with ``import plots``. Every function draws on
a fresh ``matplotlib`` figure and returns its axes, so a notebook cell can add to it.
"""

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt

MIB = 2**20


def axes(title: str, xlabel: str, ylabel: str, *, loglog: bool = False, logx: bool = False, size=(6, 4)):
    """A titled, labelled, gridded axes on a new figure (log axes on request).

    Example:
        >>> ax = axes("t", "x", "y", loglog=True)
        >>> ax.get_xscale(), ax.get_yscale()
        ('log', 'log')
    """
    _, ax = plt.subplots(figsize=size)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    if loglog or logx:
        ax.set_xscale("log", base=2)
    if loglog:
        ax.set_yscale("log", base=2)
    ax.grid(True, which="both", alpha=0.3)
    return ax


def lines(
    x: Sequence[float], series: Mapping[str, Sequence[float]], title: str, xlabel: str, ylabel: str, **kw
):
    """One line with markers per series over the same ``x``; ``kw`` go to ``axes``.

    Example:
        >>> ax = lines([1, 2, 4], {"a": [1, 4, 16], "b": [1, 2, 4]}, "t", "T", "bytes", loglog=True)
        >>> len(ax.get_lines())
        2
    """
    ax = axes(title, xlabel, ylabel, **kw)
    for name, ys in series.items():
        ax.plot(list(x)[: len(ys)], ys, marker="o", label=name)
    ax.legend()
    return ax


def labelled_scatter(points: Mapping[str, tuple[float, float]], title: str, xlabel: str, ylabel: str, **kw):
    """A scatter with each point labelled by its name (e.g. memory against time per preset).

    Example:
        >>> ax = labelled_scatter({"full": (1.0, 2.0), "none": (3.0, 1.0)}, "t", "MiB", "s")
        >>> len(ax.texts)
        2
    """
    ax = axes(title, xlabel, ylabel, **kw)
    for name, (x, y) in points.items():
        ax.scatter([x], [y])
        ax.annotate(name, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    return ax


def bars(values: Mapping[str, float], title: str, ylabel: str, *, hline: float | None = None, **kw):
    """Vertical bars, one per name; ``hline`` draws a reference level (a budget, say).

    Example:
        >>> ax = bars({"a": 1.0, "b": 2.5}, "t", "GiB", hline=2.0)
        >>> len(ax.patches)
        2
    """
    ax = axes(title, "", ylabel, **kw)
    names = list(values)
    ax.bar(names, [values[n] for n in names])
    if hline is not None:
        ax.axhline(hline, color="red", linestyle="--")
    ax.tick_params(axis="x", rotation=30)
    return ax
