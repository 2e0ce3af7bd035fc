"""The blockwise kernel as one ``jax.custom_vjp`` over canonical inputs.

Residuals saved for the backward pass are the inputs (q, k, v, bias, the small
mask arrays, the dropout seed), the output and the fp32 log-sum-exp: O(T), never
T x S. The output and the lse are tagged ``Tag.ATTN_OUT`` / ``Tag.ATTN_LSE``
inside the forward rule, so a remat policy that saves those two names keeps the
attention forward out of the recomputation.

The VJP is defined twice over the same rules: with symbolic zeros, so that a bias
that is not differentiated costs no gradient, and without, for ``jax.shard_map``,
which supports no symbolic zeros (there a given bias always gets its gradient).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.custom_derivatives import SymbolicZero

from jaxckpt._tags import Tag
from jaxckpt.attention import _dropout
from jaxckpt.attention._block_sizes import BlockSizes
from jaxckpt.attention._blockwise_bwd import backward, backward_tiles
from jaxckpt.attention._blockwise_fwd import forward
from jaxckpt.attention._tiles import (
    Tiling,
    lse_to_rows,
    tiles_t_to_keys,
    tiles_to_pairwise,
    tiles_to_rows,
    to_tiles,
)
from jaxckpt.attention._validate import AttentionInputs, MaskArrays
from jaxckpt.attention._vma import varying_axes


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["q", "k", "v", "bias", "arrays", "seed", "out", "lse"],
    meta_fields=["need_dbias"],
)
@dataclasses.dataclass
class _Residuals:
    q: jax.Array
    k: jax.Array
    v: jax.Array
    bias: jax.Array | None
    arrays: MaskArrays
    seed: jax.Array | None
    out: jax.Array
    lse: jax.Array
    need_dbias: bool


def _tagged_forward(tl: Tiling, q, k, v, bias, arrays: MaskArrays, seed):
    out, lse = forward(tl, to_tiles(q, k, v, bias, arrays, seed, tl))
    out = checkpoint_name(tiles_to_rows(out, tl), Tag.ATTN_OUT)
    lse = checkpoint_name(lse_to_rows(lse, tl), Tag.ATTN_LSE)
    return out, lse


def _fwd(tl: Tiling, q, k, v, bias, arrays, seed, *, need_dbias: bool):
    out, lse = _tagged_forward(tl, q, k, v, bias, arrays, seed)
    return (out, lse), _Residuals(q, k, v, bias, arrays, seed, out, lse, need_dbias)


def _fwd_symbolic(tl: Tiling, q, k, v, bias, arrays, seed):
    """With symbolic zeros: the bias gradient is computed only if the bias is differentiated."""
    need_dbias = bias is not None and bias.perturbed
    q, k, v, bias, arrays, seed = jax.tree.map(lambda x: x.value, (q, k, v, bias, arrays, seed))
    return _fwd(tl, q, k, v, bias, arrays, seed, need_dbias=need_dbias)


def _fwd_plain(tl: Tiling, q, k, v, bias, arrays, seed):
    """Without symbolic zeros (``jax.shard_map`` supports none): a bias always gets its gradient."""
    return _fwd(tl, q, k, v, bias, arrays, seed, need_dbias=bias is not None)


def _bwd(tl: Tiling, res: _Residuals, cts):
    d_out = cts[0]  # the lse is not differentiated: its cotangent is ignored
    if isinstance(d_out, SymbolicZero):
        d_out = jnp.zeros(d_out.shape, d_out.dtype)
    d = to_tiles(res.q, res.k, res.v, res.bias, res.arrays, res.seed, tl)
    e = backward_tiles(tl, d, res.out, res.lse, d_out)
    dq, dk_t, dv_t, dbias = backward(tl, d, e, res.need_dbias)
    if dbias is not None:
        dbias = tiles_to_pairwise(dbias, tl, res.bias.shape).astype(res.bias.dtype)
    zeros = jax.tree.map(lambda _: None, (res.arrays, res.seed))
    return (
        tiles_to_rows(dq, tl),
        tiles_t_to_keys(dk_t, tl),
        tiles_t_to_keys(dv_t, tl),
        dbias,
        *zeros,
    )


_symbolic = jax.custom_vjp(_tagged_forward, nondiff_argnums=(0,))
_symbolic.defvjp(_fwd_symbolic, _bwd, symbolic_zeros=True)
_plain = jax.custom_vjp(_tagged_forward, nondiff_argnums=(0,))
_plain.defvjp(_fwd_plain, _bwd)


def _in_shard_map(*trees) -> bool:
    """Inside ``jax.shard_map`` (manual mesh axes, or inputs varying over some)."""
    if jax.sharding.get_abstract_mesh().manual_axes:
        return True
    return any(varying_axes(x) for x in jax.tree.leaves(trees))


def blockwise_attention(p: AttentionInputs, block_sizes: BlockSizes | None = None):
    """Blockwise attention on canonical inputs.

    Returns:
        ``(out [B, T, N, H], lse [B, N, T] fp32)``; the lse is not differentiated.
    """
    if block_sizes is None:
        block_sizes = BlockSizes.auto(p.query.shape[0] * p.query.shape[2])
    tl = Tiling.create(p.static, block_sizes, p.query.shape, p.key.shape, p.query.dtype)
    seed = None if p.dropout_rng is None else _dropout.rng_seed(p.dropout_rng)
    args = (p.query, p.key, p.value, p.bias, p.arrays, seed)
    out, lse = (_plain if _in_shard_map(args) else _symbolic)(tl, *args)
    return out, jax.lax.stop_gradient(lse)
