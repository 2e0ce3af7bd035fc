"""The residuals JAX saves for a backward pass, read through the public ``jax.ad_checkpoint`` API.

``jax.ad_checkpoint.print_saved_residuals`` is the public face of JAX's saved-residual
analysis; it prints one line per residual (``bf16[2,40,48] output of cos from ...``).
:func:`saved_residuals` captures those lines and parses them back into shapes and dtypes.
"""

import contextlib
import io
import math
import re
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import print_saved_residuals

_LINE = re.compile(r"^(?P<dtype>[a-z0-9_]+)\[(?P<shape>[^\]]*)\]\S* (?P<src>.*)$")
_SHORT = ((re.compile(r"^(b?)f(?=\d)"), r"\1float"), (re.compile(r"^u(?=\d)"), "uint"))
_SHORT += ((re.compile(r"^i(?=\d)"), "int"), (re.compile(r"^c(?=\d)"), "complex"))


class SavedResidual(NamedTuple):
    """One residual: its shape, its dtype, and JAX's sentence on where it comes from."""

    shape: tuple[int, ...]
    dtype: np.dtype
    src: str

    @property
    def nbytes(self) -> int:
        """Bytes of the residual."""
        return math.prod(self.shape) * self.dtype.itemsize


def _dtype(short: str) -> np.dtype:
    """``bf16`` -> bfloat16, ``f32`` -> float32, ``i32`` -> int32 (JAX's short dtype names)."""
    name = short
    for pattern, long in _SHORT:
        name = pattern.sub(long, name)
    return jnp.dtype(name)


def saved_residuals(fn, *args) -> list[SavedResidual]:
    """What the backward pass of ``fn(*args)`` keeps from its forward pass.

    Raises:
        ValueError: when a line of JAX's report cannot be read (the line is shown).

    Example:
        >>> import jax.numpy as jnp
        >>> [(r.shape, str(r.dtype)) for r in saved_residuals(lambda x: jnp.sin(x).sum(), jnp.ones(3))]
        [((3,), 'float32')]
    """
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        print_saved_residuals(fn, *args)
    found = []
    for line in text.getvalue().splitlines():
        match = _LINE.match(line)
        if match is None:
            raise ValueError(f"cannot read this line of jax.ad_checkpoint.print_saved_residuals: {line!r}")
        dims = [d for d in match["shape"].split(",") if d]
        shape = tuple(int(re.match(r"\d+", d).group()) for d in dims)
        found.append(SavedResidual(shape, _dtype(match["dtype"]), match["src"]))
    return found
