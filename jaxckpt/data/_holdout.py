"""Which records are held out for evaluation: a hash of ``(seed, record index)``.

The record index counts the records of the data in file order (a directory's files in
sorted order), from 0. The choice needs no other record and no pass over the data, so the
training stream and the evaluation pass agree on it while each streams the file.
"""

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _mix(z: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser (uint64 arrays wrap on overflow, silently)."""
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def held_out(seed: int, first: int, count: int, fraction: float | None) -> np.ndarray:
    """Whether each of records ``first .. first + count - 1`` is held out (``bool [count]``).

    Each record is held out with probability ``fraction``, independently, by a hash of
    ``(seed, index)``; ``fraction=None`` holds none out.

    Example:
        >>> mask = held_out(0, 0, 10_000, 0.25)
        >>> bool(0.23 < mask.mean() < 0.27), bool((held_out(0, 5000, 5000, 0.25) == mask[5000:]).all())
        (True, True)
    """
    if fraction is None:
        return np.zeros(count, bool)
    key = _mix(np.array([seed], np.uint64) * _GOLDEN + _GOLDEN)
    z = _mix((np.arange(first, first + count, dtype=np.uint64) + key) * _GOLDEN)
    return (z >> np.uint64(11)).astype(np.float64) < fraction * 2.0**53


def check_fraction(owner: str, name: str, value) -> float | None:
    """``value`` as a float in (0, 1), or None; a TypeError / ValueError naming ``name``.

    Example:
        >>> check_fraction("f", "eval_fraction", 0.1)
        0.1
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float | np.floating | np.integer):
        raise TypeError(f"{owner}: {name}={value!r} must be a float in (0, 1) or None")
    if not 0 < value < 1:
        raise ValueError(f"{owner}: {name}={value!r} must lie strictly between 0 and 1 (or be None)")
    return float(value)
