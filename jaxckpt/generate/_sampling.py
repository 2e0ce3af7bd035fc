"""Choosing the next token from logits: greedy, or sampled after transformers' logits
warpers (temperature, then top-k, then top-p), with the sampling knobs as traced values so
that changing them does not recompile.
"""

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp


class Knobs(NamedTuple):
    """The sampling knobs as arrays (traced inside the jitted prefill and decode): ``temperature``
    (float32, > 0 when sampling), ``top_k`` (int32, the vocabulary size when off) and ``top_p``
    (float32, 1.0 when off).

    Example:
        >>> Sampling(temperature=0.5, top_k=400).knobs(301).top_k.tolist()
        301
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is chosen, validated: greedy when ``temperature == 0`` (top-k and
    top-p are then ignored, as transformers ignores them without ``do_sample``), else sampled
    from ``softmax(logits / temperature)`` restricted to the top ``top_k`` tokens and then to
    the smallest set whose probability reaches ``top_p``.

    Args:
        temperature: ``>= 0``; 0 is greedy.
        top_k: ``>= 1``, or None (no top-k).
        top_p: in ``(0, 1]``, or None (no top-p; 1.0 is the same).

    Raises:
        ValueError: naming the argument that is out of range.

    Example:
        >>> Sampling(temperature=0.7, top_k=5).greedy
        False
        >>> Sampling(top_p=0.0)
        Traceback (most recent call last):
        ...
        ValueError: top_p=0.0 must be in (0, 1] (or None for no top-p)
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self):
        t, k, p = self.temperature, self.top_k, self.top_p
        if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature={t!r} must be a number >= 0 (0 is greedy)")
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"top_k={k!r} must be an int >= 1 (or None for no top-k)")
        if p is not None and (isinstance(p, bool) or not isinstance(p, int | float) or not 0 < p <= 1):
            raise ValueError(f"top_p={p!r} must be in (0, 1] (or None for no top-p)")

    @property
    def greedy(self) -> bool:
        """Whether the argmax is taken (``temperature == 0``)."""
        return self.temperature == 0

    def knobs(self, vocab_size: int) -> Knobs:
        """The knobs as arrays for a vocabulary of ``vocab_size`` (greedy: unused)."""
        k = vocab_size if self.top_k is None else min(self.top_k, vocab_size)
        return Knobs(
            jnp.asarray(self.temperature or 1.0, jnp.float32),
            jnp.asarray(k, jnp.int32),
            jnp.asarray(1.0 if self.top_p is None else self.top_p, jnp.float32),
        )


def warp_logits(logits: jax.Array, knobs: Knobs) -> jax.Array:
    """transformers' ``TemperatureLogitsWarper``, ``TopKLogitsWarper`` and ``TopPLogitsWarper``
    in that order, on float32 logits ``[V]``: removed tokens become ``-inf``.

    Top-k keeps every token at least as likely as the k-th (ties included); top-p removes the
    tokens, least likely first, whose cumulative probability stays ``<= 1 - top_p``, always
    keeping the most likely one, and is skipped at ``top_p == 1`` (as transformers skips it).

    Example:
        >>> import jax.numpy as jnp
        >>> logits = jnp.log(jnp.array([0.1, 0.5, 0.15, 0.25]))
        >>> knobs = Knobs(jnp.float32(1.0), jnp.int32(3), jnp.float32(0.7))
        >>> jnp.isfinite(warp_logits(logits, knobs)).tolist()
        [False, True, False, True]
    """
    scores = logits.astype(jnp.float32) / knobs.temperature
    v = scores.shape[-1]
    ascending = jnp.sort(scores)
    kth = jax.lax.dynamic_index_in_dim(ascending, v - knobs.top_k, keepdims=False)
    scores = jnp.where(scores < kth, -jnp.inf, scores)
    order = jnp.argsort(scores)
    cumulative = jnp.cumsum(jax.nn.softmax(scores[order]))
    remove_sorted = (cumulative <= 1 - knobs.top_p).at[-1].set(False)
    remove = jnp.zeros_like(remove_sorted).at[order].set(remove_sorted)
    return jnp.where((knobs.top_p < 1) & remove, -jnp.inf, scores)


def next_token(logits: jax.Array, key: jax.Array, knobs: Knobs, *, greedy: bool) -> jax.Array:
    """The next token (an int32 scalar) for logits ``[V]``: the argmax (the first one on a tie)
    when ``greedy``, else a draw from the warped distribution with ``key``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> knobs = Sampling(temperature=1.0, top_k=1).knobs(3)
        >>> logits = jnp.array([0.5, 2.0, 1.0])
        >>> int(next_token(logits, jax.random.key(0), knobs, greedy=False))
        1
    """
    if greedy:
        return jnp.argmax(logits).astype(jnp.int32)
    return jax.random.categorical(key, warp_logits(logits, knobs)).astype(jnp.int32)
