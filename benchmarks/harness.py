"""What every benchmark script shares: where results go, writing a result's JSON, timing a
function's runs, and the rich table a result is printed as.

The scripts live in ``speed/`` and ``reliability/`` below this folder; each puts this folder on
``sys.path`` (:func:`sys.path` insert of its parent's parent) and imports this module as
``harness``. jax is imported only inside the timing helpers, so a script that measures a
process's memory without jax (``bench_convert``'s workers) does not pay for it.
"""

import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from rich.table import Table

BENCHMARKS = Path(__file__).resolve().parent
RESULTS = BENCHMARKS / "results"
REPO = BENCHMARKS.parent
SUPPORT = REPO / "tests" / "_support"


def add_test_support() -> None:
    """Puts ``tests/_support`` (the cases and harnesses the tests share with the benchmarks)
    first on ``sys.path``."""
    if str(SUPPORT) not in sys.path:
        sys.path.insert(0, str(SUPPORT))


def recorded_args(args) -> dict:
    """A run's command-line arguments as a results file records them: a path inside the
    repository relative to it, any other path by its file name only (a results file names no
    folder of the machine it ran on).

    Example:
        >>> import argparse
        >>> recorded_args(argparse.Namespace(out=str(RESULTS / "x.json"), reuse="/elsewhere/y.json", n=3))
        {'out': 'benchmarks/results/x.json', 'reuse': 'y.json', 'n': 3}
    """

    def recorded(value):
        if not isinstance(value, str) or not os.path.isabs(value):
            return value
        path = Path(value).resolve()
        return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else path.name

    return {k: recorded(v) for k, v in vars(args).items()}


def write_json(path: "str | os.PathLike", payload, **dump_options) -> Path:
    """Writes ``payload`` as indented JSON to ``path`` through a temporary file and a
    rename, so an interrupted run never leaves half a file; creates the folder.

    Example:
        >>> import tempfile
        >>> p = write_json(Path(tempfile.mkdtemp()) / "r" / "x.json", {"a": 1})
        >>> json.loads(p.read_text())
        {'a': 1}
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=2, **dump_options))
    os.replace(tmp, path)
    return path


def run_seconds(
    fn: Callable,
    args: Sequence = (),
    runs: int = 1,
    *,
    min_seconds: float = 0.0,
    deadline: float | None = None,
    warmup: bool = True,
) -> list[float]:
    """Wall seconds of each run of ``jax.block_until_ready(fn(*args))``.

    At least one run; then more while fewer than ``runs`` ran or they took less than
    ``min_seconds`` together, unless ``time.time()`` has passed ``deadline``. ``warmup`` runs
    (and, for a jitted ``fn``, compiles) once first, untimed.

    Example:
        >>> len(run_seconds(lambda: 1, runs=3, warmup=False))
        3
    """
    import jax

    if warmup:
        jax.block_until_ready(fn(*args))
    times: list[float] = []
    while not times or (
        (deadline is None or time.time() < deadline) and (len(times) < runs or sum(times) < min_seconds)
    ):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return times


def time_compiled(fn, args, min_runs: int, min_seconds: float, warmup: bool = True) -> float:
    """Best wall time of ``fn(*args)`` over at least ``min_runs`` runs and ``min_seconds``.

    The minimum, not the mean: on a shared machine noise only ever adds time.
    ``warmup=False`` suits an already compiled executable whose run is long.
    """
    return min(run_seconds(fn, args, min_runs, min_seconds=min_seconds, warmup=warmup))


def median_call_us(fn, args, calls: int) -> float:
    """Median wall time of ``fn(*args)`` in µs over ``calls`` calls, after a warm-up call.

    The median, not the minimum: the callback path has a long tail (Python GC, thread
    hand-offs) that is part of its real cost, but one-off hiccups should not count.
    """
    return 1e6 * statistics.median(run_seconds(fn, args, calls))


def table(title: str, first: str | None, columns: Iterable[str], **first_options) -> Table:
    """A rich table titled ``title``: the column ``first`` (left-justified unless
    ``first_options`` say otherwise; none where ``first`` is None), then ``columns``
    right-justified, as the figures are.

    Example:
        >>> t = table("t", "row", ("a", "b"), no_wrap=True)
        >>> [c.header for c in t.columns], [c.justify for c in t.columns]
        (['row', 'a', 'b'], ['left', 'right', 'right'])
    """
    out = Table(title=title)
    if first is not None:
        out.add_column(first, **first_options)
    for column in columns:
        out.add_column(column, justify="right")
    return out
