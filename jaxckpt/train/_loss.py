"""The training losses: next-token cross-entropy on plain windows, and its token-weighted
sum on packed rows (``jaxckpt.data.PackedBatch``: segment ids, positions restarting per
document, a weight per target).

No loss path holds the whole ``[B, T, V]`` fp32 logits when they exceed
``CHUNK_LOGITS_BYTES``: the head and loss of the packed loss and the held-out evaluation
(``token_loss_sum``), and of ``next_token_loss``, cut the rows along T into chunks
(``chunked_loss_sum``) and, when differentiated, compute each chunk's gradient (towards
the hidden states and the head's parameters) in the forward pass, so only one chunk's
logits and their gradient are live at a time, at the FLOPs of the plain loss (no
recomputed head).
"""

import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.extend.core import Var

from jaxckpt.nn import constrain, trainable
from jaxckpt.remat import RematSpec

PACKED_FIELDS = ("inputs", "targets", "weights", "segment_ids", "positions")
"""The arrays of a packed batch, each ``[..., B, T]``."""

CHUNK_LOGITS_BYTES = 64 * 2**20
"""The most bytes of fp32 logits one chunk of ``weighted_loss_sum`` holds (``B * chunk * V * 4``)."""


def is_packed(batch) -> bool:
    """Whether ``batch`` is a packed batch (it has ``PACKED_FIELDS``) rather than a token array.

    Example:
        >>> import numpy as np
        >>> is_packed(np.zeros((1, 2, 9), np.int32))
        False
    """
    return all(hasattr(batch, name) for name in PACKED_FIELDS)


def weighted_loss_sum(
    model: nnx.Module, batch, remat: "str | RematSpec | None" = None, dropout_key: "jax.Array | None" = None
) -> jax.Array:
    """``sum(weights * cross_entropy(model(inputs), targets))`` over one packed micro-batch
    (fields ``[B, T]``), in fp32. Attention stays inside each document (``segment_ids``)
    and positions restart in each (``positions``), so a packed row's sum equals the sum
    of its documents' losses, each run alone. Logits larger than ``CHUNK_LOGITS_BYTES``
    are computed a chunk of positions at a time (the same sum, fp32 rounding aside).

    Example:
        >>> import jax.numpy as jnp
        >>> from types import SimpleNamespace
        >>> from flax import nnx
        >>> from jaxckpt import nn
        >>> model = nn.Transformer(nn.TransformerConfig.preset("tiny", n_layers=1), rngs=nnx.Rngs(0))
        >>> ones = jnp.ones((1, 4), jnp.int32)
        >>> row = SimpleNamespace(inputs=ones, targets=ones, weights=jnp.zeros((1, 4)),
        ...                       segment_ids=ones, positions=jnp.arange(4)[None])
        >>> float(weighted_loss_sum(model, row))  # no weight, no loss
        0.0
    """
    x = model.features(
        batch.inputs,
        positions=batch.positions,
        segment_ids=batch.segment_ids,
        remat=remat,
        dropout_key=dropout_key,
    )
    return token_loss_sum(model, x, batch.targets, batch.weights)


def token_loss_sum(model: nnx.Module, x: jax.Array, targets: jax.Array, weights: jax.Array) -> jax.Array:
    """``sum(weights * cross_entropy(model.logits(x), targets))`` in fp32, over hidden states
    ``x [B, T, D]`` and ``targets``, ``weights`` ``[B, T]``: the head and the loss of every
    loss path (the plain, the packed, the held-out one). When the fp32 logits ``[B, T, V]``
    exceed ``CHUNK_LOGITS_BYTES`` they are never held whole: ``chunked_loss_sum`` runs the
    head ``chunk_count`` slices of positions at a time; otherwise the logits are computed at
    once (pinned to ``("batch", "seq", "vocab")``).

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from jaxckpt import nn
        >>> model = nn.Transformer(nn.TransformerConfig.preset("tiny", n_layers=1), rngs=nnx.Rngs(0))
        >>> x, t = jnp.zeros((1, 3, model.config.d_model)), jnp.zeros((1, 3), jnp.int32)
        >>> round(float(token_loss_sum(model, x, t, jnp.ones((1, 3)))), 3)  # uniform logits: 3 ln(256)
        16.636
    """
    vocab = jax.eval_shape(model.logits, x[:, :1]).shape[-1]
    chunks = chunk_count(*targets.shape, vocab)
    if chunks > 1:
        return chunked_loss_sum(model, x, targets, weights, chunks)
    logits = constrain(model.logits(x), "batch", "seq", "vocab").astype(jnp.float32)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return jnp.sum(losses * weights.astype(jnp.float32))


def chunk_count(batch: int, seq: int, vocab: int, limit: int | None = None) -> int:
    """How many chunks along T keep each chunk's fp32 logits within ``limit`` bytes: the
    fewest that do, or a few more if that divides ``seq`` (no padded positions).
    ``limit`` defaults to ``CHUNK_LOGITS_BYTES``.

    Example:
        >>> chunk_count(4, 256, 49152), chunk_count(4, 257, 49152), chunk_count(2, 64, 301)
        (4, 4, 1)
    """
    limit = CHUNK_LOGITS_BYTES if limit is None else limit
    need = min(seq, max(1, math.ceil(batch * seq * vocab * 4 / limit)))
    return next((n for n in range(need, min(2 * need, seq) + 1) if seq % n == 0), need)


def _read_leaves(fn, leaves: list, *args) -> list[bool]:
    """Which of ``leaves`` (the first arguments of ``fn``) its jaxpr reads."""
    closed = jax.make_jaxpr(fn)(leaves, *args)
    read = {v for eqn in closed.jaxpr.eqns for v in eqn.invars if isinstance(v, Var)}
    read |= {v for v in closed.jaxpr.outvars if isinstance(v, Var)}
    return [v in read for v in closed.jaxpr.invars[: len(leaves)]]


def chunked_loss_sum(model: nnx.Module, x: jax.Array, targets, weights, chunks: int) -> jax.Array:
    """``sum(weights * cross_entropy(model.logits(x), targets))`` over hidden states
    ``x [B, T, D]``, ``chunks`` slices of positions at a time (``lax.scan``).

    Under differentiation, each chunk's gradient towards its hidden states and the
    parameters that ``model.logits`` reads is taken in the forward pass and kept (fp32
    sums for the parameters); the backward pass scales them by the incoming cotangent and
    casts the parameters' to their dtype before it hands the hidden states' gradient on
    (an optimization barrier), so the fp32 sums are freed before the layers' backward
    runs, whatever XLA's scheduler would choose. Parameters the logits do not read get no
    gradient from here.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from flax import nnx
        >>> from jaxckpt import nn
        >>> cfg = nn.TransformerConfig.preset("tiny", n_layers=1, vocab_size=37, tie_embeddings=True)
        >>> graphdef, params, rest = nnx.split(nn.Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)
        >>> x = jax.random.normal(jax.random.key(0), (3, 11, cfg.d_model))
        >>> t = jax.random.randint(jax.random.key(1), (3, 11), 0, 37)
        >>> w = jax.random.uniform(jax.random.key(2), (3, 11))
        >>> def loss(params, x, chunks):
        ...     model = nnx.merge(graphdef, params, rest)
        ...     if chunks > 1:
        ...         return chunked_loss_sum(model, x, t, w, chunks)
        ...     lg = model.logits(x)
        ...     return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(lg, t) * w)
        >>> value_and_grad = jax.jit(jax.value_and_grad(loss, (0, 1)), static_argnums=2)
        >>> (a, ga), (b, gb) = (value_and_grad(params, x, c) for c in (1, 4))
        >>> rel = lambda u, v: float(jnp.abs(u - v).max() / (jnp.abs(u).max() + 1e-30))
        >>> bool(abs(a - b) / a < 1e-6), max(map(rel, jax.tree.leaves(ga), jax.tree.leaves(gb))) < 1e-5
        (True, True)
    """
    b, t, d = x.shape
    size = math.ceil(t / chunks)
    pad = chunks * size - t
    graphdef, params, rest = nnx.split(model, trainable(model.config), ...)  # a frozen head: no gradient
    leaves, treedef = jax.tree.flatten(params)

    def logits_of(leaves, rest, xc):
        return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves), rest).logits(xc).astype(jnp.float32)

    read = _read_leaves(logits_of, leaves, rest, x[:, :1])
    head = [leaf for leaf, r in zip(leaves, read, strict=True) if r]
    other = [leaf for leaf, r in zip(leaves, read, strict=True) if not r]

    def chunk_loss(head, other, rest, xc, tc, wc):
        it_head, it_other = iter(head), iter(other)
        merged = [next(it_head) if r else next(it_other) for r in read]
        losses = optax.softmax_cross_entropy_with_integer_labels(logits_of(merged, rest, xc), tc)
        return jnp.sum(losses * wc)

    def split(a):  # [B, T, ...] -> [chunks, B, size, ...]
        a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        return jnp.moveaxis(a.reshape(b, chunks, size, *a.shape[2:]), 1, 0)

    def pieces(x, targets, weights):
        return split(x), split(targets), split(weights.astype(jnp.float32))

    @jax.custom_vjp
    def loss_sum(head, other, rest, x, targets, weights):
        def body(total, c):
            return total + chunk_loss(head, other, rest, *c), None

        return jax.lax.scan(body, jnp.zeros((), jnp.float32), pieces(x, targets, weights))[0]

    def forward(head, other, rest, x, targets, weights):
        def grads_of(c):
            xc, tc, wc = c
            loss, vjp = jax.vjp(lambda h, xc: chunk_loss(h, other, rest, xc, tc, wc), head, xc)
            g_head, g_x = vjp(jnp.ones((), jnp.float32))
            return loss, [g.astype(jnp.float32) for g in g_head], g_x

        def body(carry, c):
            total, acc = carry
            loss, g_head, g_x = grads_of(c)
            return (total + loss, [a + g for a, g in zip(acc, g_head, strict=True)]), g_x

        xs = pieces(x, targets, weights)
        first = grads_of(jax.tree.map(lambda a: a[0], xs))  # starts the sums: no zero-filled pass
        (total, g_head), g_x = jax.lax.scan(body, first[:2], jax.tree.map(lambda a: a[1:], xs))
        g_x = jnp.concatenate([first[2][None], g_x])
        g_x = jnp.moveaxis(g_x, 0, 1).reshape(b, chunks * size, d)[:, :t]
        return total, (g_head, g_x)

    head_dtypes, x_dtype = [leaf.dtype for leaf in head], x.dtype

    def backward(residuals, g):
        g_head, g_x = residuals
        g_head = [(g * a).astype(dtype) for a, dtype in zip(g_head, head_dtypes, strict=True)]
        g_x = (g * g_x.astype(jnp.float32)).astype(x_dtype)
        if g_head:
            # The head's gradients in their own dtype before the layers' backward reads g_x, so
            # that the fp32 sums die here. Left free, XLA:TPU's scheduler sometimes kept them to
            # the end of the backward, where a tied head adds the embedding's gradient: gpt2
            # under save_attn held f32[50257,768] (147 MiB) through every layer's backward,
            # instead of 74 MiB in bf16. The same values either way.
            g_head, g_x = jax.lax.optimization_barrier((g_head, g_x))
        return g_head, None, None, g_x, None, None

    loss_sum.defvjp(forward, backward)
    return loss_sum(head, other, rest, x, targets, weights)
