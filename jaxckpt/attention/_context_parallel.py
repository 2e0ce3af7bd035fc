"""Context parallelism: attention over a sequence sharded along a mesh axis.

Each device of the ``axis_name`` axis holds a chunk of the sequence: its queries, keys
and values ``[B, T/n, heads, H]`` and the tokens' **positions** in the whole sequence
(any order: contiguous chunks, or the load-balanced :func:`zigzag_order`). Masks are
the kernels' own predicate (:func:`jaxckpt.attention._masks.visible`), comparing those
positions, so the result equals attention over the whole sequence whatever the order.
Two strategies, as MaxText and the ``ringattention`` package offer them:

- ``"all_gather"``: K and V (with their positions and segment ids) are all-gathered
  over the axis; each device runs the blockwise kernel of its queries against every
  key. The backward's dK and dV are reduce-scattered back (the all-gather's transpose).
- ``"ring"``: the K/V blocks travel around the ring with ``jax.lax.ppermute`` while
  each device runs the blockwise forward on the block it holds, merging the partial
  ``(out, lse)`` by the online softmax. The backward (a custom VJP) runs the blockwise
  backward per block with the saved ``out`` and ``lse`` and sends each block's dK/dV
  accumulators around the ring with it, home after a full turn.

Both save only the local q, k, v, out and lse (tagged ``Tag.ATTN_OUT`` /
``Tag.ATTN_LSE`` as in ``flash_attention``) and skip the tiles (and whole blocks) that
the mask hides: the tile classification takes its bounds from the positions.
"""

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxckpt.attention._block_sizes import BlockSizes
from jaxckpt.attention._blockwise_bwd import backward, backward_tiles
from jaxckpt.attention._blockwise_fwd import forward
from jaxckpt.attention._flash_vjp import Residuals, flash_vjp
from jaxckpt.attention._tiles import Tiling, lse_to_rows, tiles_t_to_keys, tiles_to_rows, to_tiles
from jaxckpt.attention._validate import MaskArrays, Static, finish, normalize
from jaxckpt.attention._vma import vary_like


class _Masks(NamedTuple):
    """The traced mask of one (query chunk, key block) pair: a pytree."""

    arrays: MaskArrays
    q_pos: jax.Array  # [B, T] int32
    kv_pos: jax.Array  # [B, S] int32

    def with_keys(self, kv_pos: jax.Array, kv_seg: "jax.Array | None") -> "_Masks":
        return _Masks(self.arrays._replace(kv_segments=kv_seg), self.q_pos, kv_pos)


def _tiles(tl: Tiling, q, k, v, m: _Masks):
    return to_tiles(q, k, v, None, m.arrays, None, tl, positions=(m.q_pos, m.kv_pos))


def _block_forward(tl: Tiling, q, k, v, m: _Masks, out_dtype=None):
    """The blockwise forward of local queries against one key block: ``(out, lse [B, N, T])``."""
    out, lse = forward(tl, _tiles(tl, q, k, v, m), out_dtype)
    return tiles_to_rows(out, tl), lse_to_rows(lse, tl)


def _block_backward(tl: Tiling, q, k, v, m: _Masks, out, lse, d_out, grad_dtype=None):
    """The blockwise backward of one key block, from the whole row's ``out`` and ``lse``:
    this block's share of dq, and its dk, dv."""
    d = _tiles(tl, q, k, v, m)
    dq, dk_t, dv_t, _ = backward(tl, d, backward_tiles(tl, d, out, lse, d_out), False, grad_dtype)
    return tiles_to_rows(dq, tl), tiles_t_to_keys(dk_t, tl), tiles_t_to_keys(dv_t, tl)


# --- all-gather: the kernel on the local queries and every key, under the shared VJP ---


def _local_forward(tl: Tiling, q, k, v, bias, m: _Masks, seed):
    del bias, seed
    return _block_forward(tl, q, k, v, m)


def _local_backward(tl: Tiling, res: Residuals, d_out):
    return (*_block_backward(tl, res.q, res.k, res.v, res.arrays, res.out, res.lse, d_out), None)


_local = flash_vjp(_local_forward, _local_backward)


def _all_gather(q, k, v, m: _Masks, cp: "_Config"):
    """K, V, their positions and segment ids gathered over the axis (tiled along S)."""
    gather = lambda x: None if x is None else lax.all_gather(x, cp.axis, axis=1, tiled=True)
    k, v, kv_pos, kv_seg = (gather(x) for x in (k, v, m.kv_pos, m.arrays.kv_segments))
    tl = cp.tiling(q.shape, k.shape, q.dtype)
    return _local(tl, q, k, v, None, m.with_keys(kv_pos, kv_seg), None)


# --- ring: K/V blocks passed around with ppermute, (out, lse) merged online ---


def _pass(tree, cp: "_Config"):
    """Every leaf of ``tree`` sent to the next device of the ring (i -> i + 1)."""
    perm = [(i, (i + 1) % cp.size) for i in range(cp.size)]
    return jax.tree.map(lambda x: lax.ppermute(x, cp.axis, perm), tree)


def _merge(out, lse, block_out, block_lse):
    """The online softmax of two partial results: fp32 ``out [B, T, N, H]``, ``lse [B, N, T]``."""
    new = jnp.logaddexp(lse, block_lse)
    safe = jnp.where(new == -jnp.inf, 0.0, new)
    weight = lambda x: jnp.swapaxes(jnp.exp(x - safe), 1, 2)[..., None]
    return out * weight(lse) + block_out.astype(jnp.float32) * weight(block_lse), new


def _ring_forward(cp: "_Config", q, k, v, bias, m: _Masks, seed):
    del bias, seed
    tl = cp.tiling(q.shape, k.shape, q.dtype)

    def attend(carry, block):
        out, lse = carry
        k, v, kv_pos, kv_seg = block
        return _merge(out, lse, *_block_forward(tl, q, k, v, m.with_keys(kv_pos, kv_seg), jnp.float32))

    def step(carry, _):
        out_lse, block = carry
        sent = _pass(block, cp)  # issued before the compute: the transfer can overlap it
        return (attend(out_lse, block), sent), None

    b, t, n, h = q.shape
    init = (jnp.zeros((b, t, n, h), jnp.float32), jnp.full((b, n, t), -jnp.inf, jnp.float32))
    init = vary_like(init, q, k)
    block = (k, v, m.kv_pos, m.arrays.kv_segments)
    (out_lse, block), _ = lax.scan(step, (init, block), None, length=cp.size - 1)
    out, lse = attend(out_lse, block)
    return out.astype(q.dtype), lse


def _ring_backward(cp: "_Config", res: Residuals, d_out):
    q, m = res.q, res.arrays
    tl = cp.tiling(q.shape, res.k.shape, q.dtype)

    def grads(carry, block):
        dq, (dk, dv) = carry
        k, v, kv_pos, kv_seg = block
        masks = m.with_keys(kv_pos, kv_seg)
        got = _block_backward(tl, q, k, v, masks, res.out, res.lse, d_out, jnp.float32)
        return dq + got[0], (dk + got[1], dv + got[2])

    def step(carry, _):
        dq, dkv, block = carry
        dq, dkv = grads((dq, dkv), block)
        dkv, block = _pass((dkv, block), cp)  # each block's accumulators travel with it
        return (dq, dkv, block), None

    zeros = lambda x: jnp.zeros(x.shape, jnp.float32)
    init = vary_like((zeros(q), (zeros(res.k), zeros(res.v))), q, res.k, d_out)
    block = (res.k, res.v, m.kv_pos, m.arrays.kv_segments)
    (dq, dkv, block), _ = lax.scan(step, (*init, block), None, length=cp.size - 1)
    dq, dkv = grads((dq, dkv), block)
    dk, dv = _pass(dkv, cp)  # the last block's accumulators go home
    return dq.astype(q.dtype), dk.astype(res.k.dtype), dv.astype(res.v.dtype), None


_ring_call = flash_vjp(_ring_forward, _ring_backward)


def _ring(q, k, v, m: _Masks, cp: "_Config"):
    return _ring_call(cp, q, k, v, None, m, None)


CONTEXT_PARALLEL_STRATEGIES: dict[str, Callable] = {"all_gather": _all_gather, "ring": _ring}
"""The context-parallel strategies by name (``context_parallel_attention(strategy=...)``)."""


def check_strategy(strategy: str, name: str = "strategy") -> None:
    """Raises a ValueError naming ``name`` unless ``strategy`` is one of
    ``CONTEXT_PARALLEL_STRATEGIES``: the one check of every place that takes a strategy (the
    kernel, the train step, the run and the planner's workload).

    Example:
        >>> check_strategy("ring")
        >>> check_strategy("zigzag", "context_parallel")
        Traceback (most recent call last):
        ...
        ValueError: context_parallel must be one of all_gather, ring; got 'zigzag'
    """
    if strategy not in CONTEXT_PARALLEL_STRATEGIES:
        raise ValueError(f"{name} must be one of {', '.join(CONTEXT_PARALLEL_STRATEGIES)}; got {strategy!r}")


@dataclasses.dataclass(frozen=True)
class _Config:
    """The static part of a call: the mask and scalars, the axis, its size, the blocks."""

    static: Static  # of the local call; t and s are set per block by tiling()
    axis: str
    size: int
    block_sizes: BlockSizes

    def tiling(self, q_shape, k_shape, dtype) -> Tiling:
        mask = dataclasses.replace(self.static.mask, t=q_shape[1], s=k_shape[1])
        static = dataclasses.replace(self.static, mask=mask)
        return Tiling.create(static, self.block_sizes, q_shape, k_shape, dtype)


def _axis_size(axis_name: str) -> int:
    try:
        return lax.axis_size(axis_name)
    except NameError:
        raise ValueError(
            f"context_parallel_attention runs inside jax.shard_map over a mesh axis named "
            f"axis_name={axis_name!r}, which is not bound here; e.g. jax.shard_map(f, mesh=mesh, "
            f"in_specs=P(None, {axis_name!r}), out_specs=P(None, {axis_name!r}))"
        ) from None


def _positions(positions, b: int, t: int, s: int) -> tuple[jax.Array, jax.Array]:
    """``[T]``, ``[B, T]`` or a ``(q [B, T], kv [B, S])`` pair -> two int32 ``[B, T|S]``."""
    pair = positions if isinstance(positions, tuple | list) else (positions, positions)
    if len(pair) != 2:
        raise ValueError(f"positions must be [B, T], [T] or a (q, kv) pair; got {len(pair)} items.")
    out = []
    for name, x, length in (("positions (query)", pair[0], t), ("positions (key)", pair[1], s)):
        x = jnp.asarray(x)
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise TypeError(f"{name} must have an integer dtype; got {x.dtype}.")
        if x.shape not in ((length,), (b, length)):
            raise ValueError(f"{name} must have shape ({length},) or ({b}, {length}); got {x.shape}.")
        out.append(jnp.broadcast_to(x.astype(jnp.int32), (b, length)))
    return out[0], out[1]


def context_parallel_attention(
    query,
    key,
    value,
    positions,
    *,
    axis_name: str = "seq",
    strategy: str = "all_gather",
    segment_ids=None,
    is_causal: bool = False,
    local_window_size=None,
    logits_soft_cap=None,
    scale=None,
    block_sizes: "BlockSizes | None" = None,
    return_residual: bool = False,
):
    """Attention over a sequence sharded along the mesh axis ``axis_name``; call it inside
    ``jax.shard_map``.

    Each device passes its chunk: ``query [B, T, N, H]``, ``key`` and ``value``
    ``[B, S, K, H]`` (T and S the local lengths; GQA/MQA when K divides N, without
    repeating K/V) and the **global positions** of its tokens. The result is the local
    rows of attention over the whole sequence: equal, to fp32 rounding, to
    ``flash_attention`` on the gathered arrays, whatever order the chunks are in (for
    causal masks, :func:`to_zigzag` gives every device an equal share of the work).
    Forward and gradients (q, k, v) run blockwise: O(local T) memory, masked tiles and
    blocks skipped.

    Args:
        query, key, value: the local chunk, jax.nn layout (``[B, T, N, H]``).
        positions: int positions of the local tokens in the whole sequence, ``[B, T]``
            or ``[T]`` (shared by queries and keys), or a ``(q_pos, kv_pos)`` pair. The
            causal and window rules compare them. Packed rows may restart them at 0 in
            each document (with ``segment_ids``).
        axis_name: the ``jax.shard_map`` mesh axis the sequence is split over.
        strategy: ``"all_gather"`` (gather K/V, then local attention; cheapest for few
            devices and for GQA's small K/V) or ``"ring"`` (K/V blocks passed around with
            ``ppermute``; a device never holds more than two blocks); see ``CONTEXT_PARALLEL_STRATEGIES``.
        segment_ids: int ``[B, T]`` document ids of the local tokens (packed rows), or a
            ``(q_ids, kv_ids)`` pair; a query sees keys of its own document only.
        is_causal: a query sees keys at positions ``<=`` its own.
        local_window_size: ``(left, right)`` or one int: keys at positions
            ``p - left .. p + right``.
        logits_soft_cap: ``cap * tanh(logits / cap)``.
        scale: logit scale; default ``1 / sqrt(H)``.
        block_sizes: tiles of the local blockwise kernel; None: ``BlockSizes.auto``.
        return_residual: also return the fp32 log-sum-exp ``[B, T, N]`` (not differentiated).

    Returns:
        The local output ``[B, T, N, H]`` in ``query``'s dtype (``(out, lse)`` with
        ``return_residual``); a query that sees no key gets 0.

    Raises:
        ValueError: outside ``shard_map`` over ``axis_name``, for an unknown ``strategy``,
            or bad shapes (named, as ``flash_attention`` names them).
        TypeError: bad dtypes.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import PartitionSpec as P
        >>> from jaxckpt.attention import attention_reference, context_parallel_attention
        >>> devices = jax.devices()[:4]  # up to 4: T = 12 splits over any of 1 to 4
        >>> auto = (jax.sharding.AxisType.Auto,)
        >>> mesh = jax.make_mesh((len(devices),), ("seq",), axis_types=auto, devices=devices)
        >>> q, k, v = jax.random.normal(jax.random.key(0), (3, 2, 12, 2, 8))  # [B, T, N, H] each
        >>> f = lambda q, k, v, pos: context_parallel_attention(q, k, v, pos, strategy="ring", is_causal=True)
        >>> spec = P(None, "seq")  # T split over the devices; pos [T] split alike
        >>> sharded = jax.shard_map(f, mesh=mesh, in_specs=(spec, spec, spec, P("seq")), out_specs=spec)
        >>> ring = jax.jit(sharded)  # one compiled program (an eager shard_map runs op by op)
        >>> out = ring(q, k, v, jnp.arange(12))
        >>> bool(jnp.allclose(out, attention_reference(q, k, v, is_causal=True), atol=1e-5))
        True
    """
    check_strategy(strategy)
    size = _axis_size(axis_name)
    p = normalize(
        query,
        key,
        value,
        scale=scale,
        is_causal=is_causal,
        local_window_size=local_window_size,
        segment_ids=segment_ids,
        logits_soft_cap=logits_soft_cap,
    )
    b, t, n, _ = p.query.shape
    q_pos, kv_pos = _positions(positions, b, t, p.key.shape[1])
    if block_sizes is None:
        block_sizes = BlockSizes.auto(b * n)
    cp = _Config(p.static, axis_name, size, block_sizes)
    masks = _Masks(p.arrays, q_pos, kv_pos)
    out, lse = CONTEXT_PARALLEL_STRATEGIES[strategy](p.query, p.key, p.value, masks, cp)
    return finish(out, lse, p.unbatched, return_residual)


def zigzag_order(length: int, n: int) -> np.ndarray:
    """The load-balanced order of a causal sequence over ``n`` devices: the sequence cut
    in ``2n`` chunks, device ``i`` holding chunks ``i`` and ``2n - 1 - i`` (an early and
    a late one, so every device has the same number of visible key blocks).

    Returns:
        Int ``[length]``: position ``j`` of the reordered sequence holds token
        ``order[j]`` of the original (``x[:, order]`` reorders; it is also each token's
        global position).

    Raises:
        ValueError: unless ``2 * n`` divides ``length``.

    Example:
        >>> zigzag_order(8, 2).tolist()
        [0, 1, 6, 7, 2, 3, 4, 5]
    """
    if n < 1 or length % (2 * n):
        raise ValueError(f"zigzag_order: length={length} must be a multiple of 2 * n = {2 * n}.")
    chunks = np.arange(length).reshape(2 * n, length // (2 * n))
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * n - 1 - i]]) for i in range(n)])


def to_zigzag(x, n: int, axis: int = 1):
    """``x`` (``[B, T, ...]``) with axis ``axis`` put in :func:`zigzag_order` for ``n``
    devices; :func:`from_zigzag` undoes it.

    Example:
        >>> import jax.numpy as jnp
        >>> to_zigzag(jnp.arange(8)[None], 2).tolist()
        [[0, 1, 6, 7, 2, 3, 4, 5]]
    """
    return jnp.take(x, zigzag_order(x.shape[axis], n), axis=axis)


def from_zigzag(x, n: int, axis: int = 1):
    """The inverse of :func:`to_zigzag`: ``x`` back in the original order.

    Example:
        >>> import jax.numpy as jnp
        >>> x = jnp.arange(24).reshape(2, 12)
        >>> bool((from_zigzag(to_zigzag(x, 3), 3) == x).all())
        True
    """
    return jnp.take(x, np.argsort(zigzag_order(x.shape[axis], n)), axis=axis)
