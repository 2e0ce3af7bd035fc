"""What the Pallas kernels are given: the static :class:`Layout`, and the padded operands.

The wrapper pads once, so that every kernel sees whole blocks:

- q, k, v (and out, dO) along T / S to a multiple of every block size the three kernels
  use, and along H to a power of two (Triton's tensors are powers of two; zero columns
  change no logit and no output);
- lengths and segment ids become one int32 id per position, ``q_ids [B, Tp]`` and
  ``kv_ids [B, Sp]``: a query sees a key iff their ids are equal. A row past its query
  length gets :data:`Q_OUTSIDE`, a key past its key length :data:`KV_OUTSIDE`, which
  never match (so user segment ids must not take these two values);
- a bias or mask keeps its broadcast axes (size 1); its T and S axes, when full, are
  padded (a mask as int8, Triton loads no booleans);
- the work-skipping bounds: for each query block the first and one-past-last key block
  that holds a visible pair, from the same tile classification as the blockwise kernel
  (``_masks.classify_tiles``), and the same for each key block over the query blocks.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp

from jaxckpt.attention._masks import classify_tiles, loop_bounds
from jaxckpt.attention._validate import AttentionInputs, MaskArrays, Static
from jaxckpt.attention.pallas._blocks import padded_head_dim

Q_OUTSIDE = jnp.iinfo(jnp.int32).min
KV_OUTSIDE = jnp.iinfo(jnp.int32).min + 1


def _full_axes(x: jax.Array | None) -> tuple[bool, ...] | None:
    """Which of the (B, N, T, S) axes of a canonical bias or mask are full (not 1)."""
    return None if x is None else tuple(d > 1 for d in x.shape)


@dataclasses.dataclass(frozen=True)
class Layout:
    """The static shape of one Pallas attention call (hashable: a ``custom_vjp`` static).

    Attributes:
        static: the call's mask, scale, soft cap and dropout rate.
        fwd, dkdv, dq: ``(block_q, block_k)`` of the forward, dK/dV and dQ kernels.
        t_pad, s_pad, h_pad: the padded T, S and H.
        batch, num_heads, kv_heads: B, N, K.
        ids: q_ids / kv_ids are passed (lengths or segment ids are used).
        bias, mask: which (B, N, T, S) axes of the bias / mask are full; None if absent.
        dropout: whether dropout is applied.
        interpret: run with ``pallas_call(interpret=True)`` (no GPU).
        num_warps, num_stages: Triton launch parameters.
    """

    static: Static
    fwd: tuple[int, int]
    dkdv: tuple[int, int]
    dq: tuple[int, int]
    t_pad: int
    s_pad: int
    h_pad: int
    batch: int
    num_heads: int
    kv_heads: int
    ids: bool
    bias: tuple[bool, ...] | None
    mask: tuple[bool, ...] | None
    dropout: bool
    interpret: bool
    num_warps: int
    num_stages: int

    @property
    def groups(self) -> int:
        """G = N / K query heads per key/value head."""
        return self.num_heads // self.kv_heads

    @property
    def masked(self) -> bool:
        """Whether any logit may be masked (else the kernels compute no mask)."""
        st = self.static.mask
        padded = self.t_pad > st.t or self.s_pad > st.s
        return bool(st.is_causal or st.window is not None or self.ids or self.mask or padded)

    @classmethod
    def create(
        cls, p: AttentionInputs, blocks, *, interpret: bool, num_warps: int, num_stages: int
    ) -> "Layout":
        """The layout of canonical inputs ``p`` under ``blocks`` (fwd, dkdv, dq block pairs)."""
        (b, t, n, h), (_, s, k, _) = p.query.shape, p.key.shape
        fwd, dkdv, dq = blocks
        t_step = math.lcm(fwd[0], dkdv[0], dq[0])
        s_step = math.lcm(fwd[1], dkdv[1], dq[1])
        a = p.arrays
        ids = any(x is not None for x in (a.q_lengths, a.kv_lengths, a.q_segments))
        return cls(
            p.static,
            fwd,
            dkdv,
            dq,
            -(-t // t_step) * t_step,
            -(-s // s_step) * s_step,
            padded_head_dim(h),
            b,
            n,
            k,
            ids,
            _full_axes(p.bias),
            _full_axes(a.mask),
            p.static.dropout_rate > 0,
            interpret,
            num_warps,
            num_stages,
        )


def pad_axis(x: jax.Array, axis: int, size: int, value=0) -> jax.Array:
    """``x`` padded with ``value`` at the end of ``axis`` to ``size``."""
    if x.shape[axis] == size:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad, constant_values=value)


def pad_rows(x: jax.Array, lay: Layout) -> jax.Array:
    """``[B, T, N, H]`` (q, out, dO) -> ``[B, Tp, N, Hp]``."""
    return pad_axis(pad_axis(x, 1, lay.t_pad), 3, lay.h_pad)


def pad_keys(x: jax.Array, lay: Layout) -> jax.Array:
    """``[B, S, K, H]`` (k, v) -> ``[B, Sp, K, Hp]``."""
    return pad_axis(pad_axis(x, 1, lay.s_pad), 3, lay.h_pad)


def pad_stats(x: jax.Array, lay: Layout, value) -> jax.Array:
    """``[B, N, T]`` (lse) -> ``[B, N, Tp]``."""
    return pad_axis(x, 2, lay.t_pad, value)


def pad_pairwise(x: jax.Array | None, lay: Layout, dtype=None) -> jax.Array | None:
    """A ``[Bx, Nx, Tx, Sx]`` bias or mask with its full T / S axes padded (with 0)."""
    if x is None:
        return None
    x = x if dtype is None else x.astype(dtype)
    if x.shape[2] > 1:
        x = pad_axis(x, 2, lay.t_pad)
    if x.shape[3] > 1:
        x = pad_axis(x, 3, lay.s_pad)
    return x


def position_ids(a: MaskArrays, lay: Layout) -> tuple[jax.Array, jax.Array] | None:
    """``(q_ids [B, Tp], kv_ids [B, Sp])`` int32 from the lengths and segment ids, or None."""
    if not lay.ids:
        return None

    def ids(segments, lengths, size, padded, outside):
        pos = jnp.arange(padded, dtype=jnp.int32)[None, :]
        seg = jnp.zeros((lay.batch, padded), jnp.int32)
        if segments is not None:
            seg = pad_axis(segments, 1, padded)
        inside = pos < size
        if lengths is not None:
            inside &= pos < lengths[:, None]
        return jnp.where(inside, seg, outside)

    st = lay.static.mask
    return (
        ids(a.q_segments, a.q_lengths, st.t, lay.t_pad, Q_OUTSIDE),
        ids(a.kv_segments, a.kv_lengths, st.s, lay.s_pad, KV_OUTSIDE),
    )


def block_bounds(a: MaskArrays, lay: Layout, blocks: tuple[int, int], *, over_keys: bool):
    """Work-skipping loop bounds ``(lo, hi)`` int32 for one kernel's blocks.

    ``over_keys=True``: per query block, the key blocks to visit (forward, dQ), shaped
    ``[Tp / bq]``; False: per key block, the query blocks (dK/dV), ``[Sp / bk]``.
    """
    bq, bk = blocks
    visible, _ = classify_tiles(lay.static.mask, a, bq, bk)
    nq, nk = lay.t_pad // bq, lay.s_pad // bk
    visible = pad_axis(pad_axis(visible, 0, nq, False), 1, nk, False)
    return loop_bounds(visible if over_keys else visible.T)
