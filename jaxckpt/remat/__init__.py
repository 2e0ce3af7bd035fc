"""Remat policies over named activations.

``Tag`` lists every ``checkpoint_name`` jaxckpt places, ``RematSpec`` says which are
saved, offloaded to host or recomputed (and how many layers form one remat segment),
and ``PRESETS`` names the common choices.

Example:
    >>> from jaxckpt import remat
    >>> sorted(map(str, remat.get("save_attn").save))
    ['attn_lse', 'attn_out']
"""

from jaxckpt._tags import Tag
from jaxckpt.remat._describe import RematReport, Residual, describe
from jaxckpt.remat._presets import AUTO, PRESETS, get
from jaxckpt.remat._spec import RematSpec, has_pinned_host

__all__ = [
    "AUTO",
    "PRESETS",
    "RematReport",
    "RematSpec",
    "Residual",
    "Tag",
    "describe",
    "get",
    "has_pinned_host",
]
