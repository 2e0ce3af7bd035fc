"""Argument and value checks shared by every layer (this module imports nothing from jaxckpt)."""

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

CHUNK = 1 << 22
"""Elements per step when a numpy array's values are checked (bounds the temporary mask)."""


def require_positive_int(name: str, value, where: str = "") -> None:
    """Raises ``ValueError("{where}{name}={value!r} must be a positive int")`` unless
    ``value`` is an ``int`` (not a ``bool``) of at least 1.

    The message names the argument as ``name=value``: the command line rewrites that
    into its flag (``jaxckpt.cli``), so ``name`` must be the Python argument's name.

    Example:
        >>> require_positive_int("steps", 3)
        >>> require_positive_int("steps", 0)
        Traceback (most recent call last):
        ...
        ValueError: steps=0 must be a positive int
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}{name}={value!r} must be a positive int")


def known_fields(cls, fields: Mapping, where: str) -> dict:
    """``fields`` as the keyword arguments of the dataclass ``cls``: the one check of every
    ``from_dict`` and every part given as a dict. A TypeError names a non-mapping; a ValueError
    names each unknown key and lists the valid ones.

    Example:
        >>> @dataclasses.dataclass
        ... class Point:
        ...     x: int = 0
        >>> known_fields(Point, {"x": 1}, "Point")
        {'x': 1}
        >>> known_fields(Point, {"y": 1}, "Point")
        Traceback (most recent call last):
        ...
        ValueError: Point: unknown field(s) ['y']; valid: ['x']
    """
    if not isinstance(fields, Mapping):
        raise TypeError(f"{where}: expected a mapping of fields, got {type(fields).__name__}")
    known = [f.name for f in dataclasses.fields(cls) if f.init]
    unknown = sorted(set(fields) - set(known))
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; valid: {known}")
    return dict(fields)


@jax.jit
def _finite_flags(leaves: list) -> list:
    """One fused all-finite reduction per array: no mask is materialised."""
    return [jnp.isfinite(x).all() for x in leaves]


def _is_float(x) -> bool:
    return hasattr(x, "dtype") and hasattr(x, "shape") and jnp.issubdtype(x.dtype, jnp.inexact)


def _numpy_finite(array) -> bool:
    """Whether a numpy ``array`` is all finite, read ``CHUNK`` values at a time."""
    flat = np.asarray(array).reshape(-1)  # a view for C-ordered arrays
    return all(np.isfinite(flat[i : i + CHUNK]).all() for i in range(0, flat.size, CHUNK))


def _key_name(key) -> str:
    for field in ("key", "name", "idx"):
        if hasattr(key, field):
            return str(getattr(key, field))
    return str(key)


def _path_name(path) -> str:
    """``blocks/attn/q_proj/kernel``: a tree path's keys, without an ``nnx.Variable``'s ``.value``."""
    names = [_key_name(k) for k in path]
    if names and names[-1] == "value" and type(path[-1]).__name__ == "GetAttrKey":
        names.pop()
    return "/".join(names)


def require_finite(tree, source: str) -> None:
    """Raises a ValueError when a float array of ``tree`` holds a NaN or an Inf.

    The message names ``source`` (the file or directory the values came from), the first
    offending array by its path in ``tree`` (``blocks/attn/q_proj/kernel``; a flat dict's
    key as it is, a Hugging Face tensor name say), how many of its values are NaN and Inf,
    and how many other arrays are bad too. Arrays that are not floats (ids, int8 weights,
    PRNG keys) are skipped.

    Cost: one fused reduction per array, read in place: JAX arrays in one jitted call
    (on their devices, sharded or not), numpy arrays ``CHUNK`` values at a time (no device
    copy, no model-sized mask). The values are counted only for the arrays found bad.

    Args:
        tree: a pytree of arrays (a pure dict of parameters, an ``nnx.State``).
        source: names where ``tree`` came from, in the message.

    Raises:
        ValueError: ``"{source}: tensor {path!r} holds N NaN and M Inf value(s) of its S..."``.

    Example:
        >>> import numpy as np
        >>> params = {"attn": {"q": {"kernel": np.ones((3, 5), np.float32)}}, "ids": np.arange(3)}
        >>> require_finite(params, "ckpt")
        >>> params["attn"]["q"]["kernel"][1, 2] = np.nan
        >>> require_finite(params, "ckpt")
        Traceback (most recent call last):
        ...
        ValueError: ckpt: tensor 'attn/q/kernel' holds 1 NaN and 0 Inf value(s) of its 15; \
a checkpoint with non-finite weights is refused (it is corrupt, or was saved from a diverged run)
    """
    leaves = [(p, x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0] if _is_float(x)]
    on_device = [i for i, (_, x) in enumerate(leaves) if isinstance(x, jax.Array)]
    flags = jax.device_get(_finite_flags([leaves[i][1] for i in on_device]))
    finite = dict(zip(on_device, map(bool, flags), strict=True))
    bad = [(p, x) for i, (p, x) in enumerate(leaves) if not (finite[i] if i in finite else _numpy_finite(x))]
    if not bad:
        return
    path, array = bad[0]
    module = jnp if isinstance(array, jax.Array) else np
    nan, inf = int(module.isnan(array).sum()), int(module.isinf(array).sum())
    more = f" ({len(bad) - 1} more tensor(s) hold some too)" if len(bad) > 1 else ""
    raise ValueError(
        f"{source}: tensor {_path_name(path)!r} holds {nan} NaN and {inf} Inf value(s) of its "
        f"{array.size}{more}; a checkpoint with non-finite weights is refused (it is corrupt, or "
        "was saved from a diverged run)"
    )
