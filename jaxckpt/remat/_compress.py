"""int8 / fp8 compression of a stored activation: per-group absmax scales along the features.

A compressed residual is what a remat spec stores in place of an activation it keeps
(``RematSpec.compress``): the forward pass uses the exact value, and the backward pass
reads :func:`dequantize` of the stored one. The last (feature) axis is cut into groups of
``group`` elements (the last group shorter when ``group`` does not divide it); each group
has one float32 scale, its absmax over the format's largest value, stored beside the
one-byte values, groups-major: ``[groups, rows]``, the rows (every axis but the last,
flattened) along the minor dimension:

- ``int8``: symmetric, ``round(x / scale)`` clipped to ``[-127, 127]``, ``scale = absmax / 127``;
- ``fp8``: ``float8_e4m3fn`` values of ``x / scale``, ``scale = absmax / 448``.

The scales are groups-major for XLA:TPU, which tiles the two minor dimensions of an array in
(8, 128) blocks: rows-major ``[rows, groups]`` float32 scales with one group a row (d_model
128) were padded to 128 lanes, 512 bytes a row beside 128 bytes of int8 values; groups-major
they are padded to 8 sublanes, 32 bytes a row (``plan``'s ``tpu_compressed_bytes``). XLA:CPU
and XLA:GPU store either without padding.

An all-zero group has scale 0 and dequantizes to exact zeros. A group holding a
non-finite value gets a NaN scale, so all of it dequantizes to NaN, never to a finite
wrong value; called on concrete arrays (eagerly), :func:`quantize` refuses such input.
"""

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

FORMATS = ("int8", "fp8")
"""The storage formats of a compressed residual."""
DEFAULT_GROUP = 128
"""Features per scale."""

_STORAGE = {"int8": jnp.dtype(jnp.int8), "fp8": jnp.dtype(jnp.float8_e4m3fn)}
_LARGEST = {"int8": 127.0, "fp8": 448.0}
_SCALE = jnp.dtype(jnp.float32)


class ErrorBound(NamedTuple):
    """``|dequantize(quantize(x)) - x| <= element * |x| + absmax * (the group's absmax)``,
    per element, before the result is rounded to ``x``'s dtype (see :func:`error_bound`).

    Example:
        >>> from jaxckpt import remat
        >>> remat.error_bound("fp8") == (2**-4, 2**-10 / 448)
        True
    """

    element: float
    absmax: float


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Compressed:
    """An activation stored in one byte per element and one float32 scale per group.

    Attributes:
        values: the one-byte values (``int8`` or ``float8_e4m3fn``), the activation's shape.
        scales: float32 ``[ceil(features / group), rows]``, one per group of the last axis
            and row (``rows``: the product of the other axes), groups-major.
        fmt: ``"int8"`` or ``"fp8"``. group: features per scale.
        dtype: the activation's dtype, which :func:`dequantize` returns.
        features: the size of the last axis.

    Example:
        >>> import jax.numpy as jnp
        >>> c = quantize(jnp.ones((2, 200), jnp.bfloat16), "int8")
        >>> c.values.shape, c.scales.shape, c.fmt, str(c.dtype), c.nbytes
        ((2, 200), (2, 2), 'int8', 'bfloat16', 416)
        >>> quantize(jnp.ones((3, 5, 200)), "fp8").scales.shape  # 2 groups of 15 rows
        (2, 15)
    """

    values: jax.Array
    scales: jax.Array
    fmt: str = dataclasses.field(metadata={"static": True})
    group: int = dataclasses.field(metadata={"static": True})
    dtype: np.dtype = dataclasses.field(metadata={"static": True})
    features: int = dataclasses.field(metadata={"static": True})

    @property
    def shape(self) -> tuple[int, ...]:
        """The activation's shape."""
        return tuple(self.values.shape)

    @property
    def nbytes(self) -> int:
        """Bytes stored: the values and the scales."""
        return compressed_bytes(self.shape, self.dtype, self.fmt, self.group)


def _check(fmt: str, group: int, shape: tuple[int, ...], dtype) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"compression format must be one of {', '.join(FORMATS)}; got {fmt!r}")
    if isinstance(group, bool) or not isinstance(group, int) or group < 1:
        raise ValueError(f"compression group must be a positive int, got {group!r}")
    if len(shape) < 1:
        raise ValueError(f"compression needs a feature axis (the last); got a scalar, {shape=}")
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"only floating activations can be compressed; got {jnp.dtype(dtype)}")


def _groups(x: jax.Array, group: int) -> jax.Array:
    """``[..., D] -> [..., n, group]`` float32, the last group padded with zeros."""
    d = x.shape[-1]
    n = -(-d // group)
    x = x.astype(_SCALE)
    if n * group != d:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, n * group - d)])
    return x.reshape(*x.shape[:-1], n, group)


def quantize(x: jax.Array, fmt: str, group: int = DEFAULT_GROUP, *, check_finite: bool = True) -> Compressed:
    """Compresses ``x [..., D]`` to ``fmt`` with one scale per ``group`` features.

    Args:
        x: a floating array with at least one axis; its last axis is the features.
        fmt: ``"int8"`` or ``"fp8"`` (``float8_e4m3fn``).
        group: features per scale; the last group is shorter when it does not divide D.
        check_finite: refuse a concrete ``x`` with non-finite values (False: its groups
            dequantize to NaN, as they do under a trace).

    Returns:
        A :class:`Compressed` of ``x``'s shape.

    Raises:
        ValueError: for an unknown format, a bad group, a scalar or non-floating ``x``, and,
            when ``x`` is concrete, for non-finite values (the message counts them). Under a
            trace a non-finite group dequantizes to NaN instead.

    Example:
        >>> import jax.numpy as jnp
        >>> x = jnp.array([[0.5, -1.0, 0.25], [0.0, 0.0, 0.0]])
        >>> c = quantize(x, "int8", group=2)
        >>> c.values.tolist(), c.scales.shape  # [groups, rows]
        ([[64, -127, 127], [0, 0, 0]], (2, 2))
        >>> c.scales[:, 1].tolist()  # the second row's groups: all zero
        [0.0, 0.0]
        >>> dequantize(c).tolist()[1]  # an all-zero group comes back exactly
        [0.0, 0.0, 0.0]
    """
    x = jnp.asarray(x) if not isinstance(x, jax.Array) else x
    _check(fmt, group, x.shape, x.dtype)
    if check_finite and not isinstance(x, jax.core.Tracer):
        bad = int(np.sum(~np.isfinite(np.asarray(x, np.float32))))
        if bad:
            raise ValueError(
                f"quantize({fmt!r}): x holds {bad} non-finite value(s) (inf or nan) of {x.size}; "
                "a compressed residual must be finite"
            )
    g = _groups(x, group)
    finite = jnp.all(jnp.isfinite(g), axis=-1, keepdims=True)
    absmax = jnp.max(jnp.abs(jnp.where(jnp.isfinite(g), g, 0)), axis=-1, keepdims=True)
    scale = jnp.where(finite, absmax / _LARGEST[fmt], jnp.nan)
    q = jnp.where(finite & (absmax > 0), g / jnp.where(absmax > 0, scale, 1), 0)
    q = jnp.clip(q, -_LARGEST[fmt], _LARGEST[fmt])
    if fmt == "int8":
        q = jnp.round(q)
    d = x.shape[-1]
    values = q.astype(_STORAGE[fmt]).reshape(*x.shape[:-1], -1)[..., :d]
    scales = scale.reshape(-1, scale.shape[-2]).T  # [rows, groups, 1] -> [groups, rows]
    return Compressed(values, scales, fmt, group, jnp.dtype(x.dtype), d)


def dequantize(c: Compressed) -> jax.Array:
    """The array ``c`` stores, in its original dtype and shape.

    Example:
        >>> import jax.numpy as jnp
        >>> x = jnp.linspace(-1.0, 1.0, 7)
        >>> err = jnp.abs(dequantize(quantize(x, "int8")) - x).max()
        >>> bool(err <= error_bound("int8").absmax * 1.0)
        True
    """
    lead = c.values.shape[:-1]
    scales = c.scales.T.reshape(*lead, -1, 1)  # [groups, rows] -> [..., groups, 1]
    g = _groups(c.values, c.group) * scales
    return g.reshape(*g.shape[:-2], -1)[..., : c.features].astype(c.dtype)


def compressed_bytes(shape: tuple[int, ...], dtype, fmt: str, group: int = DEFAULT_GROUP) -> int:
    """Bytes of an activation of ``shape`` stored in ``fmt``: one byte a value plus one
    float32 scale per group of the last axis.

    Example:
        >>> compressed_bytes((3, 5, 200), "bfloat16", "int8")  # 3000 values + 30 scales
        3120
    """
    shape = tuple(shape)
    _check(fmt, group, shape, dtype)
    rows, d = math.prod(shape[:-1]), shape[-1]
    return rows * d * _STORAGE[fmt].itemsize + rows * -(-d // group) * _SCALE.itemsize


def error_bound(fmt: str) -> ErrorBound:
    """The largest round-trip error of one element, relative to the element and to its
    group's absmax: int8 rounds to half a step of ``absmax / 127``; fp8 (e4m3, 3 mantissa
    bits) to ``2**-4`` of the element, and below its smallest normal (``2**-6``) to half
    its subnormal step (``2**-10`` of ``absmax / 448``). The float32 arithmetic adds about
    ``1e-7`` relative, and the cast back to the activation's dtype its own rounding.

    Example:
        >>> error_bound("int8").absmax == 0.5 / 127, error_bound("fp8").element
        (True, 0.0625)
    """
    if fmt not in FORMATS:
        raise ValueError(f"compression format must be one of {', '.join(FORMATS)}; got {fmt!r}")
    if fmt == "int8":
        return ErrorBound(0.0, 0.5 / _LARGEST["int8"])
    return ErrorBound(2.0**-4, 2.0**-10 / _LARGEST["fp8"])
