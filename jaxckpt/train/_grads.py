"""The loss and its gradients: next-token cross-entropy, micro-batch accumulation, packed
batches, loss scaling."""

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxckpt.nn import constrain
from jaxckpt.remat import RematSpec
from jaxckpt.train._loss import chunk_count, chunked_loss_sum, is_packed, weighted_loss_sum


def next_token_loss(
    model: nnx.Module,
    tokens: jax.Array,
    remat: "str | RematSpec | None" = None,
    dropout_key: "jax.Array | None" = None,
) -> jax.Array:
    """Mean cross-entropy of predicting ``tokens[:, 1:]`` from ``tokens[:, :-1]`` (fp32).

    As the packed loss does, it never holds the whole ``[B, T, V]`` fp32 logits when they
    exceed ``CHUNK_LOGITS_BYTES`` (``jaxckpt.train._loss``): the head then runs a chunk of
    positions at a time, each chunk's gradient taken in the forward pass (the same mean,
    fp32 rounding aside). At long T the logits are the step's largest buffer otherwise:
    ``llama3.1-8b`` at T=8192 holds 3.9 GiB of them in fp32, and their gradient.

    Args:
        model: a ``jaxckpt.nn.Transformer``.
        tokens: ``[B, T + 1]`` integer ids.
        remat: overrides the model's remat spec.
        dropout_key: turns on the LoRA adapters' dropout (``Transformer.__call__``).

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from jaxckpt import nn, train
        >>> model = nn.Transformer(nn.TransformerConfig.preset("tiny", n_layers=1), rngs=nnx.Rngs(0))
        >>> float(train.next_token_loss(model, jnp.zeros((2, 9), jnp.int32))) > 0
        True
    """
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    x = model.features(inputs, remat=remat, dropout_key=dropout_key)
    vocab = jax.eval_shape(model.logits, x[:, :1]).shape[-1]
    chunks = chunk_count(*targets.shape, vocab)
    if chunks > 1:
        weights = jnp.ones(targets.shape, jnp.float32)
        return chunked_loss_sum(model, x, targets, weights, chunks) / targets.size
    logits = constrain(model.logits(x), "batch", "seq", "vocab").astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def loss_and_grads(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    rest: nnx.State,
    batch: jax.Array,
    spec: RematSpec,
    dropout_key: "jax.Array | None" = None,
    loss_scale: "jax.Array | None" = None,
    accumulate_dtype=None,
):
    """Mean loss and gradient over micro-batches ``batch [M, B, T + 1]``, or over a packed
    batch (``jaxckpt.data.PackedBatch``, fields ``[M, B, T]``): the mean over its weighted
    targets, each document attended to alone.

    With ``M > 1`` the micro-batches are a ``lax.scan`` that accumulates fp32-param
    gradients, so only one micro-batch's activations are live at a time. ``params`` are
    the trainable variables (``nn.trainable``), ``rest`` the others (a LoRA model's frozen
    base among them). ``dropout_key`` turns on the LoRA adapters' dropout, a key per
    micro-batch folded from it.

    ``loss_scale`` (a float32 scalar): the gradients are taken of the loss times it
    (float16 gradients then keep small values) and divided by it again in float32; the
    loss returned is unscaled. A scale too large gives non-finite gradients.

    ``accumulate_dtype``: the micro-batches' gradients are summed in it (None: each
    parameter's own dtype), e.g. float32 for the 16-bit copies of host master weights.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from flax import nnx
        >>> from jaxckpt import nn, remat, train
        >>> model = nn.Transformer(nn.TransformerConfig.preset("tiny", n_layers=1), rngs=nnx.Rngs(0))
        >>> graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        >>> batch = jnp.zeros((2, 1, 9), jnp.int32)  # 2 micro-batches of 1 x 8 tokens
        >>> loss, grads = train.loss_and_grads(graphdef, params, rest, batch, remat.get("full"))
        >>> jax.tree.structure(grads) == jax.tree.structure(params)
        True
    """

    factor = 1.0 if loss_scale is None else loss_scale
    if is_packed(batch):
        # The step's loss is the mean over every weighted target of every micro-batch.
        total = jnp.maximum(jnp.sum(batch.weights.astype(jnp.float32)), 1.0)

        def one(params, micro, key):
            return weighted_loss_sum(nnx.merge(graphdef, params, rest), micro, spec, key) / total * factor

        m, scale = batch.inputs.shape[0], 1
    else:

        def one(params, tokens, key):
            return next_token_loss(nnx.merge(graphdef, params, rest), tokens, spec, key) * factor

        m = scale = batch.shape[0]
    grad_fn = jax.value_and_grad(one)

    def key_of(i):
        return None if dropout_key is None else jax.random.fold_in(dropout_key, i)

    if m == 1:
        loss, grads = grad_fn(params, jax.tree.map(lambda a: a[0], batch), key_of(0))
    else:

        def accumulate(carry, micro_and_index):
            micro, i = micro_and_index
            loss, grads = grad_fn(params, micro, key_of(i))
            return jax.tree.map(lambda total, g: total + g.astype(total.dtype), carry, (loss, grads)), None

        zeros = (
            jnp.zeros((), jnp.float32),
            jax.tree.map(lambda p: jnp.zeros_like(p, dtype=accumulate_dtype), params),
        )
        (loss, grads), _ = jax.lax.scan(accumulate, zeros, (batch, jnp.arange(m)))
    if loss_scale is not None:
        return _unscale(loss, grads, scale * loss_scale)
    if scale == 1:
        return loss, grads
    return loss / scale, jax.tree.map(lambda g: g / scale, grads)


def _unscale(loss, grads, divisor):
    """The loss and gradients divided by ``divisor`` (float32), each back in its dtype."""
    inverse = 1.0 / divisor.astype(jnp.float32)
    return loss * inverse, jax.tree.map(lambda g: (g.astype(jnp.float32) * inverse).astype(g.dtype), grads)
