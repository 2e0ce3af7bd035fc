"""Remat policies over named activations.

``Tag`` lists every ``checkpoint_name`` jaxckpt places, ``RematSpec`` says which are
saved, offloaded to host, compressed (int8 / fp8) or recomputed (and how many layers form
one remat segment), and ``PRESETS`` names the common choices.

Example:
    >>> from jaxckpt import remat
    >>> sorted(map(str, remat.get("save_attn").save))
    ['attn_lse', 'attn_out']
"""

from jaxckpt._tags import Tag
from jaxckpt.remat._compress import (
    DEFAULT_GROUP,
    FORMATS,
    Compressed,
    ErrorBound,
    compressed_bytes,
    dequantize,
    error_bound,
    quantize,
)
from jaxckpt.remat._describe import RematReport, Residual, describe
from jaxckpt.remat._presets import AUTO, PRESETS, Layered, compressed, get
from jaxckpt.remat._spec import RematSpec, TagFormats, has_pinned_host

__all__ = [
    "AUTO",
    "DEFAULT_GROUP",
    "FORMATS",
    "PRESETS",
    "Compressed",
    "ErrorBound",
    "Layered",
    "RematReport",
    "RematSpec",
    "Residual",
    "Tag",
    "TagFormats",
    "compressed",
    "compressed_bytes",
    "dequantize",
    "describe",
    "error_bound",
    "get",
    "has_pinned_host",
    "quantize",
]
