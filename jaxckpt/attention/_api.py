"""``flash_attention``: validate once, resolve ``implementation``, dispatch."""

from jaxckpt.attention._block_sizes import BlockSizes
from jaxckpt.attention._blockwise import blockwise_attention
from jaxckpt.attention._cudnn import cudnn_attention, cudnn_fits, cudnn_unavailable
from jaxckpt.attention._jax_nn import JAX_NN_FEATURES, jax_nn_attention
from jaxckpt.attention._reference import reference_normalized
from jaxckpt.attention._registry import features_used, implementations, lookup, register_implementation
from jaxckpt.attention._signature import entry_point
from jaxckpt.attention._splash import SPLASH_FEATURES, splash_attention, splash_fits, splash_note
from jaxckpt.attention._validate import AttentionInputs
from jaxckpt.attention.pallas import pallas_attention, pallas_fits, pallas_note

register_implementation("blockwise", blockwise_attention)
register_implementation("reference", lambda p, block_sizes: reference_normalized(p), materializes_scores=True)
register_implementation(
    "xla",
    lambda p, bs: jax_nn_attention(p, bs, implementation="xla"),
    supports=JAX_NN_FEATURES,
    materializes_scores=True,
)
register_implementation(
    "cudnn",
    cudnn_attention,
    supports=JAX_NN_FEATURES - {"segments"},
    unavailable=cudnn_unavailable,
)
register_implementation("pallas", pallas_attention, note=pallas_note)
register_implementation("splash", splash_attention, supports=SPLASH_FEATURES, note=splash_note)

MANUAL_PARTITIONING = frozenset({"splash"})
"""Implementations whose kernel XLA cannot partition over a mesh (a Mosaic TPU kernel):
a sharded caller runs them inside ``jax.shard_map`` (``jaxckpt.nn``'s attention does)."""


def _auto(p: AttentionInputs) -> str:
    """``implementation=None``: on a GPU, cuDNN where it accepts the call, else the Pallas
    kernel where it does (a head dim up to 256), else blockwise; on a TPU the Splash
    kernel where it supports every feature the call uses, else blockwise; elsewhere
    blockwise."""
    if cudnn_fits(p) and features_used(p) <= implementations()["cudnn"].supports:
        return "cudnn"
    if pallas_fits(p):
        return "pallas"
    if splash_fits(p):
        return "splash"
    return "blockwise"


def resolve_implementation(inputs: AttentionInputs, implementation: str | None = None) -> str:
    """The implementation ``flash_attention(..., implementation=implementation)`` runs for
    ``inputs`` (canonical, from :func:`normalize`), checked as the call would check it.

    Raises:
        ValueError, NotImplementedError: as ``flash_attention`` would.

    Example:
        >>> import jax.numpy as jnp
        >>> from jaxckpt.attention import compiling_for, normalize, resolve_implementation
        >>> p = normalize(jnp.ones((1, 8, 2, 16)), jnp.ones((1, 8, 1, 16)), jnp.ones((1, 8, 1, 16)))
        >>> with compiling_for("tpu"):
        ...     resolve_implementation(p), resolve_implementation(p._replace(bias=jnp.zeros((1, 1, 8, 8))))
        ('splash', 'blockwise')
    """
    return lookup(implementation or _auto(inputs), inputs).name


# The public signature (the contract's, from normalize, + these two + return_residual)
# is built by entry_point; the body runs on the canonical inputs normalize returns.
@entry_point(block_sizes=None, implementation=None)
def flash_attention(inputs: AttentionInputs, *, block_sizes, implementation):
    """Attention with O(T) memory: a drop-in for ``jax.nn.dot_product_attention``.

    Shapes use B batch, T query length, S key length, N query heads, K key/value
    heads (N a multiple of K: GQA/MQA), H head dim. Every argument shared with
    ``jax.nn.dot_product_attention`` has the same meaning there and here.

    Args:
        query: ``[B, T, N, H]`` (or ``[T, N, H]``), float32/bfloat16/float16.
        key: ``[B, S, K, H]``.
        value: ``[B, S, K, H]``.
        bias: added to the logits; broadcastable to ``[B, N, T, S]``. Differentiable.
        mask: bool, broadcastable to ``[B, N, T, S]``; True = attend.
        scale: logit scale; default ``1 / sqrt(H)``.
        is_causal: key ``s`` is visible from query ``t`` iff ``s <= t`` (top-left
            alignment when T != S).
        query_seq_lengths: int ``[B]``; rows past it see no key.
        key_value_seq_lengths: int ``[B]``; keys past it are masked.
        local_window_size: ``(left, right)`` or one int for both: query ``t`` sees
            keys ``t - left .. t + right``.
        segment_ids: packed sequences: ``(q_ids [B, T], kv_ids [B, S])``, or one
            ``[B, T]`` array when T == S; a query sees keys of its own segment.
        logits_soft_cap: ``cap * tanh(logits / cap)``, applied after scale and bias.
        dropout_rate: probability of dropping an attention probability.
        dropout_rng: a ``jax.random.key``; the mask is a pure function of
            ``(rng, b, n, t, s)`` (see ``jaxckpt.attention.dropout_mask``). Inside
            ``jax.shard_map`` those indices are the shard's own, so fold the shard's
            position in (``jax.random.fold_in(rng, jax.lax.axis_index("tp"))``) for
            masks that differ across shards.
        block_sizes: :class:`BlockSizes` for the blockwise and Pallas kernels (on a
            GPU the Pallas kernel takes powers of two >= 16; None: its tuned table; the
            Splash kernel rounds each up to a multiple of 128).
        implementation: None (auto: on a GPU cuDNN where it applies, else "pallas",
            else "blockwise"; on a TPU "splash" unless the call uses bias, mask or
            dropout, then "blockwise"; elsewhere "blockwise"), "blockwise", "pallas"
            (Triton on a GPU, the Pallas interpreter elsewhere), "splash" (JAX's Splash
            attention kernel: Mosaic on a TPU, the Pallas interpreter elsewhere; causal,
            windows, segment ids, lengths, soft cap, GQA/MQA; on a sharded TPU mesh call
            it inside ``jax.shard_map`` with ``check_vma=False``), "reference", "xla"
            (jax.nn), "cudnn", or a name added by ``register_implementation``.
        return_residual: also return the fp32 log-sum-exp ``[B, T, N]`` (not
            differentiated, as in jax.nn).

    Returns:
        The output, shaped and typed like ``query``; ``(out, lse)`` with
        ``return_residual``. A query row that sees no key gets 0 and zero gradients.

    It runs under ``jax_enable_x64`` and inside ``jax.shard_map`` (with ``check_vma``),
    forward and gradient, as jax.nn does.

    Raises:
        ValueError: bad shapes, an unknown or unavailable implementation.
        TypeError: bad dtypes.
        NotImplementedError: the implementation lacks a feature the call uses.

    Example:
        >>> import jax, jaxckpt
        >>> q = jax.random.normal(jax.random.key(0), (2, 7, 6, 16))
        >>> kv = jax.random.normal(jax.random.key(1), (2, 7, 3, 16))
        >>> jaxckpt.flash_attention(q, kv, kv, is_causal=True).shape
        (2, 7, 6, 16)
    """
    if block_sizes is not None and not isinstance(block_sizes, BlockSizes):
        raise TypeError(
            f"block_sizes must be a jaxckpt.BlockSizes or None; got {type(block_sizes).__name__}."
        )
    if implementation is not None and not isinstance(implementation, str):
        raise TypeError(f"implementation must be a string or None; got {implementation!r}.")
    return lookup(implementation or _auto(inputs), inputs).fn(inputs, block_sizes)
