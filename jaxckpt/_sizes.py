"""Memory sizes written as text (``32GB``, ``30GiB``) and back."""

import os
import re

GB, GiB = 10**9, 2**30

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": GB,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": GiB,
    "tib": 2**40,
}


def host_memory() -> int:
    """This machine's physical memory in bytes (16 GiB where the OS does not say).

    Example:
        >>> host_memory() > 0
        True
    """
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX
        return 16 * GiB


def parse_size(text: "str | int", name: str = "size") -> int:
    """Bytes from ``"32GB"``, ``"30GiB"``, ``"1.5 TB"`` or a plain number of bytes.

    Raises:
        ValueError: for anything else, or a size that is not positive.

    Example:
        >>> parse_size("32GB"), parse_size("30GiB"), parse_size("4096")
        (32000000000, 32212254720, 4096)
    """
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
        unit = match.group(2).lower() if match else None
        if unit not in _UNITS:
            raise ValueError(
                f"{name} {text!r} is not understood; write a number of bytes or e.g. 32GB, 30GiB, 512MiB"
            )
        value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {text!r}")
    return value


def format_bytes(n: float) -> str:
    """``n`` bytes as GiB / MiB / KiB with two decimals.

    Example:
        >>> format_bytes(3 * 2**30), format_bytes(1536)
        ('3.00 GiB', '1.50 KiB')
    """
    for unit, size in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
