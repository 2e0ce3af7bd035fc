"""The blockwise kernel: its forward and backward in tile layout, under ``flash_vjp``.

Residuals, their tags (``Tag.ATTN_OUT`` / ``Tag.ATTN_LSE``) and the bias gradient's
symbolic zeros are those of :func:`jaxckpt.attention._flash_vjp.flash_vjp`.
"""

from jaxckpt.attention import _dropout
from jaxckpt.attention._block_sizes import BlockSizes
from jaxckpt.attention._blockwise_bwd import backward, backward_tiles
from jaxckpt.attention._blockwise_fwd import forward
from jaxckpt.attention._flash_vjp import Residuals, flash_vjp
from jaxckpt.attention._tiles import (
    Tiling,
    lse_to_rows,
    tiles_t_to_keys,
    tiles_to_pairwise,
    tiles_to_rows,
    to_tiles,
)
from jaxckpt.attention._validate import AttentionInputs


def _forward(tl: Tiling, q, k, v, bias, arrays, seed):
    out, lse = forward(tl, to_tiles(q, k, v, bias, arrays, seed, tl))
    return tiles_to_rows(out, tl), lse_to_rows(lse, tl)


def _backward(tl: Tiling, res: Residuals, d_out):
    d = to_tiles(res.q, res.k, res.v, res.bias, res.arrays, res.seed, tl)
    e = backward_tiles(tl, d, res.out, res.lse, d_out)
    dq, dk_t, dv_t, dbias = backward(tl, d, e, res.need_dbias)
    if dbias is not None:
        dbias = tiles_to_pairwise(dbias, tl, res.bias.shape).astype(res.bias.dtype)
    return tiles_to_rows(dq, tl), tiles_t_to_keys(dk_t, tl), tiles_t_to_keys(dv_t, tl), dbias


_call = flash_vjp(_forward, _backward)


def blockwise_attention(p: AttentionInputs, block_sizes: BlockSizes | None = None):
    """Blockwise attention on canonical inputs.

    Returns:
        ``(out [B, T, N, H], lse [B, N, T] fp32)``; the lse is not differentiated.
    """
    if block_sizes is None:
        block_sizes = BlockSizes.auto(p.query.shape[0] * p.query.shape[2])
    tl = Tiling.create(p.static, block_sizes, p.query.shape, p.key.shape, p.query.dtype)
    seed = None if p.dropout_rng is None else _dropout.rng_seed(p.dropout_rng)
    return _call(tl, p.query, p.key, p.value, p.bias, p.arrays, seed)
