"""``jax.nn.dot_product_attention`` wrapped to the jaxckpt contract: the XLA route, and
what the cuDNN route (``_cudnn.py``) shares with it.

Two differences from calling jax.nn directly: segment ids become a mask (the
whole :func:`visible` predicate, evaluated by the reference's ``full_mask``), and
a query row that sees no key returns 0 (jax.nn returns the mean of V there).
Which rows see no key comes from :func:`seen_rows`: from the lengths, the causal
flag and the window in O(T) (``row_sees_a_key``), without a ``[T, S]`` grid.
"""

import jax
import jax.numpy as jnp
import numpy as np

from jaxckpt.attention._masks import row_sees_a_key
from jaxckpt.attention._platform import platform
from jaxckpt.attention._reference import full_mask
from jaxckpt.attention._validate import AttentionInputs, MaskArrays, Static

JAX_NN_FEATURES = frozenset({"bias", "mask", "causal", "lengths", "window", "segments"})


def jax_nn_call(
    static: Static, q, k, v, bias, mask, arrays: MaskArrays, *, implementation: str, return_residual: bool
):
    """``jax.nn.dot_product_attention`` on canonical pieces, with ``mask`` (None or bool
    ``[B|1, N|1, T|1, S|1]``) in place of ``arrays.mask``; returns what jax.nn returns."""
    # jax.nn computes its logits in float32 (float64 for float64 inputs) and adds the bias to
    # them: cast the bias to that dtype here (exact), so that its gradient needs no implicit
    # promotion either. jax.nn's forward calls jnp.promote_types(bf16, f32) itself, which
    # strict promotion refuses, hence the context.
    logits_dtype = jnp.float64 if q.dtype == jnp.float64 else jnp.float32
    bias = None if bias is None else bias.astype(logits_dtype)
    with jax.numpy_dtype_promotion("standard"):
        return jax.nn.dot_product_attention(
            q,
            k,
            v,
            bias,
            mask,
            scale=static.scale,
            is_causal=static.mask.is_causal,
            query_seq_lengths=arrays.q_lengths,
            key_value_seq_lengths=arrays.kv_lengths,
            local_window_size=static.mask.window,
            implementation=implementation,
            return_residual=return_residual,
        )


def seen_rows(p: AttentionInputs):
    """Which query rows see at least one key: bool ``[B|1, N|1, T]``, or None when every
    row does (known at trace time, e.g. causal with T <= S and no lengths).

    Without segment ids or a user mask it is ``row_sees_a_key`` on the lengths, the
    causal flag and the window: O(T), no ``[T, S]`` buffer. With either, whether a row
    sees a key depends on every key, so it is ``full_mask(p).any(-1)`` (a user mask is
    already ``[T, S]``; jax.nn turns it into a ``[T, S]`` bias for either backend).
    """
    cfg, a = p.static.mask, p.arrays
    if a.q_segments is not None or a.mask is not None:
        return full_mask(p).any(-1)
    traced = a.q_lengths is not None or a.kv_lengths is not None
    q_idx = (jnp if traced else np).arange(cfg.t, dtype=np.int32)[None, None, :]
    as_b = lambda x: None if x is None else x[:, None, None]
    seen = row_sees_a_key(cfg, q_idx, q_len=as_b(a.q_lengths), kv_len=as_b(a.kv_lengths))
    return None if isinstance(seen, np.ndarray) and seen.all() else seen


def zero_unseen(out: jax.Array, lse: jax.Array, seen, dtype) -> tuple[jax.Array, jax.Array]:
    """The contract's empty rows: ``out [B, T, N, H]`` 0 and ``lse [B, N, T]`` -inf where
    ``seen`` (from :func:`seen_rows`) is False; ``out`` cast to ``dtype``."""
    if seen is not None:
        out = jnp.where(jnp.swapaxes(seen, 1, 2)[..., None], out, 0)
        lse = jnp.where(seen, lse, -jnp.inf)
    return out.astype(dtype), lse


def jax_nn_attention(p: AttentionInputs, block_sizes, *, implementation: str = "xla"):
    """Runs jax.nn's ``implementation`` on canonical inputs -> ``(out, lse [B, N, T])``."""
    del block_sizes
    a = p.arrays
    q, k, v = p.query, p.key, p.value
    if q.dtype == jnp.float16 and platform() == "cpu":
        # XLA:CPU has no F16_F16_F32 dot algorithm, which jax.nn requests for float16
        # and which its gradient fails on; compute in float32 and round the output.
        q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    mask = a.mask if a.q_segments is None else full_mask(p)
    out, lse = jax_nn_call(
        p.static, q, k, v, p.bias, mask, a, implementation=implementation, return_residual=True
    )
    lse = jnp.swapaxes(lse, 1, 2).astype(jnp.float32)
    return zero_unseen(out, lse, seen_rows(p), p.query.dtype)
