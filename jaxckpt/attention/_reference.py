"""The ground truth: naive attention in float32, materialising the [B, N, T, S] logits."""

import jax
import jax.numpy as jnp

from jaxckpt.attention import _dropout
from jaxckpt.attention._masks import visible
from jaxckpt.attention._validate import AttentionInputs, finish, normalize


def full_mask(p: AttentionInputs) -> jax.Array:
    """``visible`` on the whole grid: bool ``[B|1, N|1, T, S]``."""
    cfg, a = p.static.mask, p.arrays
    q_idx = jnp.arange(cfg.t)[None, None, :, None]
    k_idx = jnp.arange(cfg.s)[None, None, None, :]
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


def attention_reference(
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
    block_sizes=None,
    implementation=None,
    return_residual=False,
):
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
    p = normalize(
        query,
        key,
        value,
        bias,
        mask,
        scale=scale,
        is_causal=is_causal,
        query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths,
        local_window_size=local_window_size,
        segment_ids=segment_ids,
        logits_soft_cap=logits_soft_cap,
        dropout_rate=dropout_rate,
        dropout_rng=dropout_rng,
    )
    out, lse = reference_normalized(p)
    return finish(out, lse, p.unbatched, return_residual)
