"""Device presets (memory, matmul rate, host link) and memory sizes written as text."""

import dataclasses
import os
import re
from types import MappingProxyType

GB, GiB = 10**9, 2**30


@dataclasses.dataclass(frozen=True)
class DevicePreset:
    """One accelerator as the planner sees it.

    Attributes:
        name: the preset's key in ``DEVICES``.
        memory: bytes of device memory (the vendor's figure).
        flops: dense 16-bit matmul FLOP/s (converts recompute FLOPs to seconds).
        host_bandwidth: bytes/s of the host link one way (prices an offload).
    """

    name: str
    memory: int
    flops: float
    host_bandwidth: float


def _host_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX
        return 16 * GiB


DEVICES: MappingProxyType[str, DevicePreset] = MappingProxyType(
    {
        "ascend-910": DevicePreset("ascend-910", 32 * GB, 256e12, 25e9),
        "ascend-910b": DevicePreset("ascend-910b", 64 * GB, 313e12, 25e9),
        "a100-40g": DevicePreset("a100-40g", 40 * GB, 312e12, 25e9),
        "a100-80g": DevicePreset("a100-80g", 80 * GB, 312e12, 25e9),
        "h100-80g": DevicePreset("h100-80g", 80 * GB, 989e12, 50e9),
        "h200-141g": DevicePreset("h200-141g", 141 * GB, 989e12, 50e9),
        "cpu": DevicePreset("cpu", _host_memory(), 1e11, 10e9),
    }
)
"""Device name -> ``DevicePreset`` (``cpu`` is this machine's RAM)."""

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


def parse_size(text: "str | int") -> int:
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
                f"size {text!r} is not understood; write a number of bytes or e.g. 32GB, 30GiB, 512MiB"
            )
        value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"size must be positive, got {text!r}")
    return value


def device_preset(name: str) -> DevicePreset:
    """The preset called ``name``; the error lists the valid names."""
    if name not in DEVICES:
        raise ValueError(f"unknown device {name!r}; valid devices: {', '.join(DEVICES)}")
    return DEVICES[name]


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
