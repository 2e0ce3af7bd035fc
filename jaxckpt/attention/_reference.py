"""The ground truth: naive attention in float32, materialising the [B, N, T, S] logits."""

import jax
import jax.numpy as jnp

from jaxckpt.attention import _dropout
from jaxckpt.attention._masks import visible
from jaxckpt.attention._signature import entry_point
from jaxckpt.attention._validate import AttentionInputs


def full_mask(p: AttentionInputs) -> jax.Array:
    """The one mask predicate (``visible``) on the whole grid: bool ``[B|1, N|1, T, S]``.

    True where query ``t`` may attend key ``s`` given every masking argument of the
    call (causal, window, lengths, segment ids, the boolean mask). Routes whose
    kernel takes an explicit mask (``jax.nn``, the NPU's ``atten_mask``) build it here,
    so no backend re-derives the rules.

    Args:
        p: canonical inputs, from :func:`jaxckpt.attention.normalize`.

    Example:
        >>> import jax.numpy as jnp
        >>> from jaxckpt.attention import full_mask, normalize
        >>> q = jnp.ones((1, 3, 2, 8))
        >>> full_mask(normalize(q, q, q, is_causal=True))[0, 0].astype(int).tolist()
        [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    """
    cfg, a = p.static.mask, p.arrays
    q_idx = jnp.arange(cfg.t, dtype=jnp.int32)[None, None, :, None]
    k_idx = jnp.arange(cfg.s, dtype=jnp.int32)[None, None, None, :]
    as_b = lambda x: None if x is None else x[:, None, None, None]
    return visible(
        cfg,
        q_idx,
        k_idx,
        q_len=as_b(a.q_lengths),
        kv_len=as_b(a.kv_lengths),
        q_seg=None if a.q_segments is None else a.q_segments[:, None, :, None],
        kv_seg=None if a.kv_segments is None else a.kv_segments[:, None, None, :],
        mask=a.mask,
    )


def reference_normalized(p: AttentionInputs) -> tuple[jax.Array, jax.Array]:
    """Reference on canonical inputs; returns ``(out [B,T,N,H], lse [B,N,T] fp32)``."""
    st = p.static
    q, k, v = (x.astype(jnp.float32) for x in (p.query, p.key, p.value))
    b, t, n, _ = q.shape
    groups = n // k.shape[2]
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    logits = jnp.einsum("btnh,bsnh->bnts", q, k, precision="highest") * st.scale
    if p.bias is not None:
        logits = logits + p.bias.astype(jnp.float32)
    if st.logits_soft_cap is not None:
        logits = st.logits_soft_cap * jnp.tanh(logits / st.logits_soft_cap)
    vis = full_mask(p)
    logits = jnp.where(vis, logits, -jnp.inf)
    row_max = jax.lax.stop_gradient(logits.max(-1, keepdims=True))
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    unnorm = jnp.exp(logits - row_max)
    denom = unnorm.sum(-1, keepdims=True)
    probs = unnorm / jnp.where(denom > 0, denom, 1.0)
    if st.dropout_rate > 0:
        keep = _dropout.dropout_mask(p.dropout_rng, (b, n, t, k.shape[1]), st.dropout_rate)
        probs = jnp.where(keep, probs / (1.0 - st.dropout_rate), 0.0)
    out = jnp.einsum("bnts,bsnh->btnh", probs, v, precision="highest")
    lse = jnp.where(denom[..., 0] > 0, jnp.log(jnp.where(denom[..., 0] > 0, denom[..., 0], 1.0)), -jnp.inf)
    return out.astype(p.query.dtype), lse + row_max[..., 0]


# The public signature is flash_attention's, built by entry_point (see _signature.py).
@entry_point(block_sizes=None, implementation=None)
def attention_reference(inputs: AttentionInputs, *, block_sizes, implementation):
    """Naive softmax attention in float32: the ground truth for every kernel.

    Same signature and meaning as :func:`jaxckpt.flash_attention`
    (``block_sizes`` and ``implementation`` are accepted and ignored). It
    materialises the ``[B, N, T, S]`` logits, so use it only on small inputs.

    Returns:
        ``out`` with the shape and dtype of ``query``; with ``return_residual``,
        ``(out, lse)`` where ``lse`` is the fp32 log-sum-exp, ``[B, T, N]``.

    Example:
        >>> import jax, jaxckpt
        >>> q = k = v = jax.random.normal(jax.random.key(0), (1, 5, 3, 8))
        >>> jaxckpt.attention_reference(q, k, v, is_causal=True).shape
        (1, 5, 3, 8)
    """
    del block_sizes, implementation
    return reference_normalized(inputs)
