"""Pairwise covering designs for the suite's grids (the planner's accuracy, context parallelism).

A grid of cases over several factors (model, rank, targets, quantization, remat, ...) runs in
``make test`` as a subset that still meets every value of every factor and every pair of
values the full grid meets; the full grid's other cases are marked ``grid`` and run with
``pytest --grid`` (``docs/contributing.md``). ``grid_params`` builds the parameters and
``assert_covers_every_pair`` is the check a cheap test makes on them::

    >>> full = [("tiny", 4), ("tiny", 16), ("small", 4), ("small", 16)]
    >>> sorted(value_pairs(full[:2]))
    [(0, 1, 'tiny', 4), (0, 1, 'tiny', 16)]
    >>> assert_covers_every_pair([full[0], full[3]], full)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    AssertionError: the covering misses 2 pairs of values of the full grid: [(0, 1, 'small', 4), ...]
"""

import itertools
from collections.abc import Hashable, Sequence

import pytest

Row = tuple[Hashable, ...]


def value_pairs(rows: Sequence[Row]) -> set[tuple]:
    """Every ``(i, j, row[i], row[j])`` with ``i < j`` of ``rows``: the pairs of values met."""
    return {(i, j, row[i], row[j]) for row in rows for i, j in itertools.combinations(range(len(row)), 2)}


def assert_covers_every_pair(covering: Sequence[Row], full: Sequence[Row]) -> None:
    """``covering`` is cases of ``full`` that meet every value and every pair of values ``full``
    meets (the values are in the pairs, once a row has two factors)."""
    outside = [row for row in covering if row not in full]
    assert not outside, f"covering rows not in the full grid: {outside}"
    missed = sorted(value_pairs(full) - value_pairs(covering), key=repr)
    assert not missed, f"the covering misses {len(missed)} pairs of values of the full grid: {missed}"


def grid_params(full: Sequence[Row], covering: Sequence[Row], marks=(), name=None) -> list:
    """``pytest.param`` of each row of ``full``, in its order: the rows of ``covering`` as they
    are, the others marked ``grid`` (run with ``pytest --grid`` only). ``marks``: on every row;
    ``name``: a row's test id (``name(*row)``), pytest's own when None."""
    missing = [row for row in covering if row not in full]
    if missing:
        raise ValueError(f"grid_params: covering rows {missing} are not rows of full")
    return [
        pytest.param(
            *row,
            marks=[*marks, *([pytest.mark.grid] if row not in covering else [])],
            id=None if name is None else name(*row),
        )
        for row in full
    ]
