"""The cuDNN route: jax.nn's cuDNN flash attention, with its residuals named.

``jax.nn.dot_product_attention(implementation="cudnn")`` has a custom VJP of its own,
whose forward keeps the inputs, the output and the fp32 softmax statistics (the
log-sum-exp, ``[B, N, T]``) for the cuDNN backward kernel. A remat policy never sees
them, so under ``save_attn`` and ``minimal`` the backward pass would run the cuDNN
forward again. Here the call is wrapped in one more ``jax.custom_vjp``: its forward
runs ``jax.vjp`` of the call, whose pullback is a pytree (``jax.tree_util.Partial``)
with exactly those residuals as leaves. The output and the statistics among them are
tagged ``Tag.ATTN_OUT`` / ``Tag.ATTN_LSE``, as the blockwise kernel tags its own, the
tagged output is also the primal one, and the pullback is the residual: a policy
that saves the two names keeps the cuDNN forward out of the recomputation.

The lse returned is cuDNN's fp32 statistics (jax.nn's ``return_residual`` gives them
rounded to the input dtype). No ``[T, S]`` buffer is built unless the caller passes
a mask: the rows that see no key come from the lengths, causal flag and window
(``seen_rows``); with a user mask they come from the full mask, because jax.nn makes
the mask an additive bias, under which cuDNN returns the mean of V for a fully masked
row, not the contract's 0.
"""

import jax
import jax.numpy as jnp

from jaxckpt._tags import Tag, record, tag
from jaxckpt.attention._jax_nn import jax_nn_call, seen_rows, zero_unseen
from jaxckpt.attention._platform import platform
from jaxckpt.attention._validate import AttentionInputs, MaskArrays, Static


def _cudnn_call(static: Static, q, k, v, bias, arrays: MaskArrays):
    """The output of jax.nn's cuDNN attention, ``[B, T, N, H]``."""
    return jax_nn_call(
        static, q, k, v, bias, arrays.mask, arrays, implementation="cudnn", return_residual=False
    )


def _named_positions(leaves: list, out, lse_shape: tuple, inputs: tuple) -> tuple[int, int]:
    """Where the output and the softmax statistics are among the pullback's leaves.

    The output is the leaf that *is* the primal output (the same traced value). The
    statistics are the one float32 leaf shaped ``[B, N, T]`` that is not an input: the
    other residuals are q, k, v and the output (the input dtype, rank 4), the bias
    (rank 4), int32 lengths ``[B]`` and empty placeholders.
    """
    at_out = [i for i, x in enumerate(leaves) if x is out]
    at_lse = [
        i
        for i, x in enumerate(leaves)
        if x.dtype == jnp.float32 and x.shape == lse_shape and not any(x is y for y in inputs)
    ]
    if len(at_out) != 1 or len(at_lse) != 1:
        found = [f"{x.dtype}{list(x.shape)}" for x in leaves]
        raise RuntimeError(
            f"the cuDNN attention residuals of this JAX ({jax.__version__}) are not the expected "
            f"ones (one output, one float32 {list(lse_shape)} softmax statistic); found {found}. "
            "Use implementation='blockwise', or report it to jaxckpt."
        )
    return at_out[0], at_lse[0]


def _tagged_pullback(call, static: Static, q, k, v, bias, arrays: MaskArrays):
    """``(out, lse [B, N, T] fp32, pullback)`` of ``call``, the two tagged in the pullback too."""
    primals = (q, k, v) if bias is None else (q, k, v, bias)
    out, pullback = jax.vjp(lambda *x: call(static, *x[:3], x[3] if x[3:] else None, arrays), *primals)
    leaves, treedef = jax.tree.flatten(pullback)
    b, t, n, _ = q.shape
    i_out, i_lse = _named_positions(leaves, out, (b, n, t), primals)
    # recorded outside the custom_vjp (named_residual_attention): the primal rule runs in a trace of its own
    leaves[i_out] = tag(out, Tag.ATTN_OUT, record=False)
    leaves[i_lse] = tag(leaves[i_lse], Tag.ATTN_LSE, record=False)
    return leaves[i_out], leaves[i_lse], jax.tree.unflatten(treedef, leaves)


def _attend(call, static, q, k, v, bias, arrays):
    out, lse, _ = _tagged_pullback(call, static, q, k, v, bias, arrays)
    return out, lse


def _fwd(call, static, q, k, v, bias, arrays):
    out, lse, pullback = _tagged_pullback(call, static, q, k, v, bias, arrays)
    return (out, lse), pullback


def _bwd(call, static, pullback, cts):
    del call, static
    dq, dk, dv, *dbias = pullback(cts[0])  # the lse is not differentiated: its cotangent is ignored
    return dq, dk, dv, dbias[0] if dbias else None, None


_named = jax.custom_vjp(_attend, nondiff_argnums=(0, 1))
_named.defvjp(_fwd, _bwd)


def named_residual_attention(call, p: AttentionInputs) -> tuple[jax.Array, jax.Array]:
    """``call(static, q, k, v, bias, arrays) -> out`` (a function with its own custom VJP
    that keeps ``out`` and an fp32 ``[B, N, T]`` lse as residuals), run so that those two
    are the ``Tag.ATTN_OUT`` / ``Tag.ATTN_LSE`` residuals; rows that see no key zeroed.

    Returns:
        ``(out [B, T, N, H], lse [B, N, T] fp32)``; the lse is not differentiated.
    """
    out, lse = _named(call, p.static, p.query, p.key, p.value, p.bias, p.arrays)
    out, lse = record(out, Tag.ATTN_OUT), record(lse, Tag.ATTN_LSE)
    return zero_unseen(out, jax.lax.stop_gradient(lse), seen_rows(p), p.query.dtype)


def cudnn_attention(p: AttentionInputs, block_sizes) -> tuple[jax.Array, jax.Array]:
    """cuDNN flash attention on canonical inputs -> ``(out, lse [B, N, T] fp32)``."""
    del block_sizes
    return named_residual_attention(_cudnn_call, p)


def cudnn_unavailable() -> str | None:
    """None on a GPU backend (or compiling for a GPU target), else why cuDNN attention cannot run."""
    backend = platform()
    return (
        None
        if backend == "gpu"
        else f"cuDNN needs a GPU backend or GPU compile target; this one is {backend!r}."
    )


def cudnn_fits(p: AttentionInputs) -> bool:
    """Whether cuDNN flash attention accepts this call (used by ``implementation=None``)."""
    h = p.query.shape[-1]
    window = p.static.mask.window
    # jax.nn takes a right window only with its CAUSAL mask, which lengths turn into
    # PADDING_CAUSAL: a right window > 0 needs causal and no lengths
    lengths = p.arrays.q_lengths is not None or p.arrays.kv_lengths is not None
    window_ok = window is None or window[1] == 0 or (p.static.mask.is_causal and not lengths)
    return (
        cudnn_unavailable() is None
        and p.query.dtype in (jnp.bfloat16, jnp.float16)
        and h <= 128
        and h % 8 == 0
        and window_ok
    )
