"""Argument checking and normalisation, shared by every attention implementation.

Every public attention function first calls :func:`normalize`. It checks shapes
and dtypes at trace time, raises a ``ValueError``/``TypeError`` that names the
argument and shows the shapes, and returns the inputs in one canonical form:
rank-4 ``BTNH`` arrays, rank-4 mask/bias, and a hashable :class:`MaskConfig`.
"""

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

_LAYOUT_HINT = "Use the jax.nn layout: query [B, T, N, H], key/value [B, S, K, H] (or drop B)."


@dataclasses.dataclass(frozen=True)
class MaskConfig:
    """The static part of the attention mask (hashable, so it can be a jit static)."""

    t: int
    s: int
    is_causal: bool = False
    window: tuple[int, int] | None = None


@dataclasses.dataclass(frozen=True)
class Static:
    """Everything about a call that is known at trace time."""

    mask: MaskConfig
    scale: float
    logits_soft_cap: float | None
    dropout_rate: float


class MaskArrays(NamedTuple):
    """The traced (array) part of the attention mask; unused fields are None."""

    q_lengths: jax.Array | None  # [B] int32
    kv_lengths: jax.Array | None  # [B] int32
    q_segments: jax.Array | None  # [B, T] int32
    kv_segments: jax.Array | None  # [B, S] int32
    mask: jax.Array | None  # [Bm, Nm, Tm, Sm] bool, each dim 1 or full


class AttentionInputs(NamedTuple):
    """Canonical inputs: rank-4 q/k/v, bias and mask, plus static config.

    What :func:`normalize` returns and every registered implementation receives.

    Example:
        >>> import jax.numpy as jnp
        >>> from jaxckpt.attention import normalize
        >>> q = jnp.ones((2, 5, 6, 8))
        >>> p = normalize(q, q[:, :, :3], q[:, :, :3], mask=jnp.ones((5, 5), bool))
        >>> p.key.shape, p.arrays.mask.shape, round(p.static.scale, 4)
        ((2, 5, 3, 8), (1, 1, 5, 5), 0.3536)
    """

    query: jax.Array
    key: jax.Array
    value: jax.Array
    bias: jax.Array | None
    arrays: MaskArrays
    dropout_rng: jax.Array | None
    static: Static
    unbatched: bool


def _floating(name: str, x) -> jax.Array:
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(
            f"{name} must have a floating dtype (float32, bfloat16 or float16); "
            f"got {name}.dtype={x.dtype}. Cast it first, e.g. {name}.astype(jnp.float32)."
        )
    return x


def _integer(name: str, x, shape: tuple[int, ...]) -> jax.Array:
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must have an integer dtype; got {name}.dtype={x.dtype}.")
    if x.shape != shape:
        raise ValueError(f"{name} must have shape {shape}; got {name}.shape={x.shape}.")
    return x.astype(jnp.int32)


def _qkv(query, key, value):
    query, key, value = (
        _floating(n, x) for n, x in zip(("query", "key", "value"), (query, key, value), strict=True)
    )
    ranks = {query.ndim, key.ndim, value.ndim}
    if ranks not in ({4}, {3}):
        raise ValueError(
            f"query, key and value must all be rank 4 (BTNH) or all rank 3 (TNH); got "
            f"{query.shape=}, {key.shape=}, {value.shape=}. {_LAYOUT_HINT}"
        )
    unbatched = query.ndim == 3
    if unbatched:
        query, key, value = query[None], key[None], value[None]
    if key.shape != value.shape:
        raise ValueError(f"key and value must have the same shape; got {key.shape=}, {value.shape=}.")
    (b, _, n, h), (bk, _, k, hk) = query.shape, key.shape
    if b != bk:
        raise ValueError(f"query and key must have the same batch size B; got {query.shape=}, {key.shape=}.")
    if h != hk:
        raise ValueError(
            f"query and key must have the same head dim H (last axis); got {query.shape=}, {key.shape=}."
        )
    if n % k:
        raise ValueError(
            f"the number of query heads N={n} must be a multiple of the number of key/value "
            f"heads K={k} (GQA); got {query.shape=}, {key.shape=}."
        )
    if not query.dtype == key.dtype == value.dtype:
        raise TypeError(
            f"query, key and value must share one dtype; got {query.dtype=}, {key.dtype=}, {value.dtype=}."
        )
    return query, key, value, unbatched


def _broadcastable(name: str, x, full: tuple[int, int, int, int]) -> jax.Array:
    x = jnp.asarray(x)
    if x.ndim > 4:
        raise ValueError(f"{name} must have at most rank 4 (BNTS); got {name}.shape={x.shape}.")
    x = x.reshape((1,) * (4 - x.ndim) + x.shape)
    if any(d not in (1, f) for d, f in zip(x.shape, full, strict=True)):
        raise ValueError(
            f"{name} must broadcast to (B, N, T, S)={full}: each axis 1 or full size; "
            f"got {name}.shape={x.shape}."
        )
    return x


def _window(local_window_size) -> tuple[int, int] | None:
    if local_window_size is None:
        return None
    if isinstance(local_window_size, int | np.integer):
        local_window_size = (int(local_window_size), int(local_window_size))
    try:
        left, right = (int(w) for w in local_window_size)
    except (TypeError, ValueError):
        raise TypeError(
            f"local_window_size must be an int or a (left, right) pair of ints; got {local_window_size!r}."
        ) from None
    if left < 0 or right < 0:
        raise ValueError(f"local_window_size must be non-negative; got {(left, right)}.")
    return left, right


def _segments(segment_ids, b: int, t: int, s: int):
    if segment_ids is None:
        return None, None
    if isinstance(segment_ids, tuple | list):
        if len(segment_ids) != 2:
            raise ValueError(
                f"segment_ids must be (q_ids [B, T], kv_ids [B, S]); got {len(segment_ids)} items."
            )
        q_ids, kv_ids = segment_ids
    else:
        if t != s:
            raise ValueError(
                f"a single segment_ids array needs T == S; got T={t}, S={s}. Pass (q_ids, kv_ids) instead."
            )
        q_ids = kv_ids = segment_ids
    return _integer("segment_ids[0] (query ids)", q_ids, (b, t)), _integer(
        "segment_ids[1] (key/value ids)", kv_ids, (b, s)
    )


def _scalars(scale, logits_soft_cap, dropout_rate, dropout_rng, h: int):
    scale = 1.0 / math.sqrt(h) if scale is None else float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be a finite float; got {scale=}.")
    if logits_soft_cap is not None:
        logits_soft_cap = float(logits_soft_cap)
        if not logits_soft_cap > 0:
            raise ValueError(f"logits_soft_cap must be positive; got {logits_soft_cap=}.")
    dropout_rate = float(dropout_rate)
    if not 0.0 <= dropout_rate < 1.0:
        raise ValueError(f"dropout_rate must be in [0, 1); got {dropout_rate=}.")
    if dropout_rate > 0 and dropout_rng is None:
        raise ValueError(f"{dropout_rate=} needs dropout_rng, e.g. dropout_rng=jax.random.key(0).")
    return scale, logits_soft_cap, dropout_rate


def normalize(
    query,
    key,
    value,
    bias=None,
    mask=None,
    *,
    scale=None,
    is_causal=False,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    local_window_size=None,
    segment_ids=None,
    logits_soft_cap=None,
    dropout_rate=0.0,
    dropout_rng=None,
) -> AttentionInputs:
    """Checks every argument of ``flash_attention`` and returns the canonical form.

    This signature is the one place where the contract's arguments are written:
    ``flash_attention``, ``attention_reference`` and every registered implementation
    are built from it (``jaxckpt.attention._signature``). To add an argument, add it
    here, with its check, and to :class:`AttentionInputs`.

    The arguments (``query``, ``key``, ``value``, ``bias``, ``mask``, ``scale``, ``is_causal``,
    ``query_seq_lengths``, ``key_value_seq_lengths``, ``local_window_size``, ``segment_ids``,
    ``logits_soft_cap``, ``dropout_rate``, ``dropout_rng``) are those of
    ``jaxckpt.flash_attention``.

    Returns:
        :class:`AttentionInputs`: rank-4 ``BTNH`` arrays, rank-4 bias and mask, int32
        lengths and segment ids, and the hashable static configuration.

    Raises:
        ValueError: a shape, rank or value is wrong (the message shows the shapes).
        TypeError: a dtype is wrong (integer query, float mask, ...).

    Example:
        >>> import jax.numpy as jnp
        >>> from jaxckpt.attention import normalize
        >>> p = normalize(jnp.ones((5, 3, 8)), jnp.ones((7, 1, 8)), jnp.ones((7, 1, 8)), is_causal=True)
        >>> p.query.shape, p.static.mask, p.unbatched
        ((1, 5, 3, 8), MaskConfig(t=5, s=7, is_causal=True, window=None), True)
    """
    query, key, value, unbatched = _qkv(query, key, value)
    (b, t, n, h), s = query.shape, key.shape[1]
    full = (b, n, t, s)
    if bias is not None:
        bias = _broadcastable("bias", _floating("bias", bias), full)
    if mask is not None:
        mask = jnp.asarray(mask)
        if mask.dtype != jnp.bool_:
            raise TypeError(
                f"mask must be boolean (True = attend); got {mask.dtype=}. For an additive mask use bias."
            )
        mask = _broadcastable("mask", mask, full)
    q_len = None if query_seq_lengths is None else _integer("query_seq_lengths", query_seq_lengths, (b,))
    kv_len = (
        None
        if key_value_seq_lengths is None
        else _integer("key_value_seq_lengths", key_value_seq_lengths, (b,))
    )
    q_seg, kv_seg = _segments(segment_ids, b, t, s)
    scale, logits_soft_cap, dropout_rate = _scalars(scale, logits_soft_cap, dropout_rate, dropout_rng, h)
    static = Static(
        mask=MaskConfig(t=t, s=s, is_causal=bool(is_causal), window=_window(local_window_size)),
        scale=scale,
        logits_soft_cap=logits_soft_cap,
        dropout_rate=dropout_rate,
    )
    arrays = MaskArrays(q_len, kv_len, q_seg, kv_seg, mask)
    rng = dropout_rng if dropout_rate > 0 else None
    return AttentionInputs(query, key, value, bias, arrays, rng, static, unbatched)


def finish(out: jax.Array, lse: jax.Array, unbatched: bool, return_residual: bool):
    """Puts canonical results back in the caller's layout (drops B, lse as [B, T, N])."""
    lse = jnp.swapaxes(lse, 1, 2)
    if unbatched:
        out, lse = out[0], lse[0]
    return (out, lse) if return_residual else out
