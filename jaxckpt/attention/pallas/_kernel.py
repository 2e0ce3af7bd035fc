"""``implementation="pallas"``: FlashAttention-2 written in Pallas, Triton on a GPU.

Every feature of the contract (bias with its gradient, boolean mask, causal, windows,
lengths, segment ids, soft cap, dropout from ``dropout_mask``'s hash, GQA without
repeating K/V), fp32 accumulators for every input dtype, work skipping from the tile
classification, named residuals (``flash_vjp``). On a GPU backend (or while compiling
for a GPU target) the kernels lower to Triton; on any other backend the very same
kernels run in the Pallas interpreter (``pallas_call(interpret=True)``): slow, for
testing.

Padding: T and S to whole blocks, H to a power of two (``pallas._layout``). The blocks
are :func:`~jaxckpt.attention.pallas._blocks.pallas_blocks` unless ``block_sizes`` is
given, which then sets all three kernels' ``(block_q, block_k)``.
"""

import jax
import jax.numpy as jnp

from jaxckpt.attention import _dropout
from jaxckpt.attention._block_sizes import BlockSizes
from jaxckpt.attention._flash_vjp import Residuals, flash_vjp
from jaxckpt.attention._platform import platform
from jaxckpt.attention._validate import AttentionInputs, MaskArrays
from jaxckpt.attention._vma import varying_axes
from jaxckpt.attention.pallas import _bwd as bwd
from jaxckpt.attention.pallas._blocks import MAX_HEAD_DIM, PallasBlocks, padded_head_dim, pallas_blocks
from jaxckpt.attention.pallas._fwd import forward
from jaxckpt.attention.pallas._layout import (
    Layout,
    block_bounds,
    pad_keys,
    pad_pairwise,
    pad_rows,
    pad_stats,
    position_ids,
)
from jaxckpt.attention.pallas._tile import Extras


def _extras(lay: Layout, bias, arrays: MaskArrays, seed) -> Extras:
    q_ids, kv_ids = position_ids(arrays, lay) or (None, None)
    return Extras(
        q_ids=q_ids,
        kv_ids=kv_ids,
        bias=pad_pairwise(bias, lay),
        mask=pad_pairwise(arrays.mask, lay, jnp.int8),
        seed=seed,
    )


def _rows(x: jax.Array, lay: Layout, h: int) -> jax.Array:
    return x[:, : lay.static.mask.t, :, :h]


def _keys(x: jax.Array, lay: Layout, h: int) -> jax.Array:
    return x[:, : lay.static.mask.s, :, :h]


def _forward(lay: Layout, q, k, v, bias, arrays, seed):
    h = q.shape[-1]
    bounds = block_bounds(arrays, lay, lay.fwd, over_keys=True)
    out, lse = forward(
        lay, pad_rows(q, lay), pad_keys(k, lay), pad_keys(v, lay), bounds, _extras(lay, bias, arrays, seed)
    )
    return _rows(out, lay, h), lse[..., : lay.static.mask.t]


def _dbias(ds: jax.Array, lay: Layout, bias: jax.Array) -> jax.Array:
    """The bias gradient: ``dS`` cut to ``[B, N, T, S]`` and summed over the bias's broadcast axes."""
    ds = ds[:, :, : lay.static.mask.t, : lay.static.mask.s]
    axes = tuple(a for a in range(4) if bias.shape[a] == 1 and ds.shape[a] > 1)
    return ds.sum(axes, keepdims=True).astype(bias.dtype)


def _backward(lay: Layout, res: Residuals, d_out):
    h = res.q.shape[-1]
    ex = _extras(lay, res.bias, res.arrays, res.seed)
    q, k, v = pad_rows(res.q, lay), pad_keys(res.k, lay), pad_keys(res.v, lay)
    do = pad_rows(d_out.astype(res.out.dtype), lay)
    lse = pad_stats(jnp.where(res.lse == -jnp.inf, jnp.inf, res.lse), lay, jnp.inf)  # P = 0 there
    dlt = bwd.delta(lay, pad_rows(res.out, lay), do)
    kv_bounds = block_bounds(res.arrays, lay, lay.dkdv, over_keys=False)
    dk, dv = bwd.dkdv(lay, q, k, v, do, lse, dlt, kv_bounds, ex)
    q_bounds = block_bounds(res.arrays, lay, lay.dq, over_keys=True)
    dq, *ds = bwd.dq(lay, q, k, v, do, lse, dlt, q_bounds, ex, need_ds=res.need_dbias)
    dbias = _dbias(ds[0], lay, res.bias) if ds else None
    return _rows(dq, lay, h), _keys(dk, lay, h), _keys(dv, lay, h), dbias


_call = flash_vjp(_forward, _backward)


def _blocks(p: AttentionInputs, block_sizes: BlockSizes | None, interpret: bool) -> PallasBlocks:
    blocks = pallas_blocks(padded_head_dim(p.query.shape[-1]), p.query.dtype)
    if block_sizes is not None:
        pair = (block_sizes.block_q, block_sizes.block_k)
        blocks = PallasBlocks(pair, pair, pair, blocks.num_warps, blocks.num_stages)
    blocks = blocks.clamp(p.static.mask.t, p.static.mask.s, interpret=interpret)
    if not interpret:
        blocks.check_for_gpu()
    return blocks


def pallas_attention(p: AttentionInputs, block_sizes: BlockSizes | None = None):
    """The Pallas kernel on canonical inputs.

    Returns:
        ``(out [B, T, N, H], lse [B, N, T] fp32)``; the lse is not differentiated.
    """
    interpret = platform() != "gpu"
    if interpret and any(
        varying_axes(x) for x in jax.tree.leaves((p.query, p.key, p.value, p.bias, p.arrays))
    ):
        raise NotImplementedError(
            "implementation='pallas' runs the Pallas interpreter here (no GPU), which JAX "
            f"{jax.__version__} cannot run inside jax.shard_map with check_vma=True (the GPU's "
            "Triton kernel can). Pass check_vma=False to jax.shard_map, or use "
            "implementation='blockwise'."
        )
    blocks = _blocks(p, block_sizes, interpret)
    lay = Layout.create(
        p,
        (blocks.fwd, blocks.dkdv, blocks.dq),
        interpret=interpret,
        num_warps=blocks.num_warps,
        num_stages=blocks.num_stages,
    )
    if not interpret and lay.h_pad > MAX_HEAD_DIM:
        raise ValueError(
            f"implementation='pallas' on a GPU takes head dims up to {MAX_HEAD_DIM}; got "
            f"H={p.query.shape[-1]}. Use implementation='blockwise'."
        )
    seed = None if p.dropout_rng is None else _dropout.rng_seed(p.dropout_rng).reshape(1)
    return _call(lay, p.query, p.key, p.value, p.bias, p.arrays, seed)


def pallas_fits(p: AttentionInputs) -> bool:
    """Whether ``implementation=None`` takes the Pallas kernel: a GPU, a head dim <= 256."""
    return platform() == "gpu" and p.query.shape[-1] <= MAX_HEAD_DIM


def pallas_note() -> str:
    """How ``implementation="pallas"`` runs on this backend (``jaxckpt info`` prints it)."""
    if platform() == "gpu":
        return "Triton kernel"
    return f"Pallas interpreter on {platform()!r}: the GPU kernel's numerics, slow, for testing"
