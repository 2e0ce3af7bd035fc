"""The one ``jax.custom_vjp`` that the flash kernels (blockwise, Pallas) are wrapped in.

A kernel gives ``forward(cfg, q, k, v, bias, arrays, seed) -> (out [B, T, N, H],
lse [B, N, T] fp32)`` and ``backward(cfg, res, d_out) -> (dq, dk, dv, dbias | None)``;
``cfg`` is its hashable static configuration. Residuals saved for the backward pass are
the inputs (q, k, v, bias, the small mask arrays, the dropout seed), the output and the
fp32 log-sum-exp: O(T), never T x S. The output and the lse are tagged ``Tag.ATTN_OUT``
/ ``Tag.ATTN_LSE`` inside the forward rule, so a remat policy that saves those two names
keeps the attention forward out of the recomputation (and the compressed remat, which
records them as they come out of the call, gives its stored values to that rule).

The VJP is defined twice over the same rules: with symbolic zeros, so that a bias that
is not differentiated costs no gradient, and without, for ``jax.shard_map``, which
supports no symbolic zeros (there a given bias always gets its gradient).
"""

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from jaxckpt._tags import Tag, record, tag
from jaxckpt.attention._validate import MaskArrays
from jaxckpt.attention._vma import varying_axes


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["q", "k", "v", "bias", "arrays", "seed", "out", "lse"],
    meta_fields=["need_dbias"],
)
@dataclasses.dataclass
class Residuals:
    """What a flash kernel's backward receives besides the output cotangent."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    bias: jax.Array | None
    arrays: MaskArrays
    seed: jax.Array | None
    out: jax.Array
    lse: jax.Array
    need_dbias: bool


def _in_shard_map(*trees) -> bool:
    """Inside ``jax.shard_map`` (manual mesh axes, or inputs varying over some)."""
    if jax.sharding.get_abstract_mesh().manual_axes:
        return True
    return any(varying_axes(x) for x in jax.tree.leaves(trees))


def flash_vjp(forward: Callable, backward: Callable) -> Callable:
    """``call(cfg, q, k, v, bias, arrays, seed) -> (out, lse)`` with the tagged residuals
    above and ``backward`` as its VJP; the lse is not differentiated."""

    def tagged(cfg, q, k, v, bias, arrays, seed):
        out, lse = forward(cfg, q, k, v, bias, arrays, seed)
        # recorded outside the custom_vjp, in ``call``: the primal rule runs in a trace of its own
        return tag(out, Tag.ATTN_OUT, record=False), tag(lse, Tag.ATTN_LSE, record=False)

    def fwd(cfg, q, k, v, bias, arrays, seed, *, need_dbias: bool):
        out, lse = tagged(cfg, q, k, v, bias, arrays, seed)
        return (out, lse), Residuals(q, k, v, bias, arrays, seed, out, lse, need_dbias)

    def fwd_symbolic(cfg, q, k, v, bias, arrays, seed):
        need_dbias = bias is not None and bias.perturbed
        q, k, v, bias, arrays, seed = jax.tree.map(lambda x: x.value, (q, k, v, bias, arrays, seed))
        return fwd(cfg, q, k, v, bias, arrays, seed, need_dbias=need_dbias)

    def fwd_plain(cfg, q, k, v, bias, arrays, seed):
        return fwd(cfg, q, k, v, bias, arrays, seed, need_dbias=bias is not None)

    def bwd(cfg, res: Residuals, cts):
        d_out = cts[0]  # the lse is not differentiated: its cotangent is ignored
        if isinstance(d_out, SymbolicZero):
            d_out = jnp.zeros(d_out.shape, d_out.dtype)
        dq, dk, dv, dbias = backward(cfg, res, d_out)
        zeros = jax.tree.map(lambda _: None, (res.arrays, res.seed))
        return dq, dk, dv, dbias, *zeros

    symbolic = jax.custom_vjp(tagged, nondiff_argnums=(0,))
    symbolic.defvjp(fwd_symbolic, bwd, symbolic_zeros=True)
    plain = jax.custom_vjp(tagged, nondiff_argnums=(0,))
    plain.defvjp(fwd_plain, bwd)

    def call(cfg, q, k, v, bias, arrays, seed):
        args = (q, k, v, bias, arrays, seed)
        out, lse = (plain if _in_shard_map(args) else symbolic)(cfg, *args)
        return record(out, Tag.ATTN_OUT), jax.lax.stop_gradient(record(lse, Tag.ATTN_LSE))

    return call
