"""The training losses: next-token cross-entropy on plain windows, and its token-weighted
sum on packed rows (``jaxckpt.data.PackedBatch``: segment ids, positions restarting per
document, a weight per target)."""

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxckpt.remat import RematSpec

PACKED_FIELDS = ("inputs", "targets", "weights", "segment_ids", "positions")
"""The arrays of a packed batch, each ``[..., B, T]``."""


def is_packed(batch) -> bool:
    """Whether ``batch`` is a packed batch (it has ``PACKED_FIELDS``) rather than a token array.

    Example:
        >>> import numpy as np
        >>> is_packed(np.zeros((1, 2, 9), np.int32))
        False
    """
    return all(hasattr(batch, name) for name in PACKED_FIELDS)


def weighted_loss_sum(model: nnx.Module, batch, remat: "str | RematSpec | None" = None) -> jax.Array:
    """``sum(weights * cross_entropy(model(inputs), targets))`` over one packed micro-batch
    (fields ``[B, T]``), in fp32. Attention stays inside each document (``segment_ids``)
    and positions restart in each (``positions``), so a packed row's sum equals the sum
    of its documents' losses, each run alone.

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
    x = model.features(batch.inputs, positions=batch.positions, segment_ids=batch.segment_ids, remat=remat)
    logits = model.logits(x).astype(jnp.float32)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch.targets)
    return jnp.sum(losses * batch.weights.astype(jnp.float32))
