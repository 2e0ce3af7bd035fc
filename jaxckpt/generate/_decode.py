"""The decode loop over a ``KVCache``: one jitted prefill and one jitted decode, a
``lax.while_loop`` over single-token steps that stops on a stop id or after
``max_new_tokens``, on device, with one host transfer at the end.

Shapes are bucketed so that prompts of different lengths share compiled code: the prompt
is padded to a power of two (at least ``MIN_BUCKET``) and the cache holds a power of two
at least ``prompt + max_new_tokens`` positions, both capped at the model's ``max_len``.
The padding is causal-masked away from the prompt's tokens, and the cache's ``start`` is
reset to the prompt's true length, so the first decode step overwrites it. A model whose
RoPE tables depend on the call's length (``LENGTH_DEPENDENT_ROPE``: longrope picks its
factors by ``max(positions) + 1``, as transformers does) is prefilled unpadded, and
prefilled again, as transformers does, where its sequence passes ``original_max_len``
(``rope_switch``). Compiles: one prefill per (prompt bucket, cache bucket), one decode
per cache bucket (and number of stop ids); greedy and sampling compile apart, the
sampling knobs are traced.
"""

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxckpt.generate._sampling import Knobs, Sampling, next_token
from jaxckpt.nn import KVCache, RopeKind, Transformer, TransformerConfig

MIN_BUCKET = 16
"""The shortest padded prompt and cache (shorter ones would compile for nothing)."""

LENGTH_DEPENDENT_ROPE = frozenset({RopeKind.LONGROPE})
"""RoPE scalings whose tables depend on the length of the call: padding would change them."""


def bucket(n: int, cap: int) -> int:
    """The power of two ``>= max(n, MIN_BUCKET)``, at most ``cap`` (and at least ``n``).

    Example:
        >>> bucket(5, 64), bucket(17, 64), bucket(40, 48)
        (16, 32, 48)
    """
    return max(n, min(cap, max(MIN_BUCKET, 1 << (n - 1).bit_length())))


def prompt_bucket(n: int, cache_len: int, config: TransformerConfig) -> int:
    """The padded length of a prompt of ``n`` tokens (``n`` itself for ``LENGTH_DEPENDENT_ROPE``).

    Example:
        >>> from jaxckpt import nn
        >>> prompt_bucket(5, 64, nn.TransformerConfig.preset("tiny"))
        16
    """
    scaling = config.rope_scaling
    if scaling is not None and scaling.kind in LENGTH_DEPENDENT_ROPE:
        return n
    return bucket(n, cache_len)


@functools.partial(jax.jit, static_argnames=("graphdef", "cache_len", "greedy"))
def _prefill(graphdef, state, tokens, length, key, index, knobs: Knobs, *, cache_len: int, greedy: bool):
    """The prompt ``tokens [1, T]`` (its first ``length`` real) into a fresh cache; the first
    new token (new token number ``index``: its key is ``fold_in(key, index)``) and the cache,
    ``start`` at ``length``."""
    model = nnx.merge(graphdef, state)
    logits, cache = model(tokens, cache=model.init_cache(1, cache_len))
    last = jax.lax.dynamic_index_in_dim(logits[0], length - 1, keepdims=False)
    token = next_token(last, jax.random.fold_in(key, index), knobs, greedy=greedy)
    return token, cache._replace(start=length)


@functools.partial(jax.jit, static_argnames=("graphdef", "greedy"), donate_argnames=("cache",))
def _decode(graphdef, state, cache: KVCache, first, max_new, stop_ids, key, index, knobs: Knobs, *, greedy):
    """Decode steps from ``first`` (new token number ``index``) until a stop id or ``max_new``
    tokens in all; returns the tokens ``[cache.max_len]`` (the first ``count`` generated),
    ``count``, whether a stop id ended it, and the cache (donated: updated in place)."""

    def stopped(token):
        return jnp.any(token == stop_ids)

    def cond(carry):
        i, _, done, *_ = carry
        return (i < max_new) & ~done

    def body(carry):  # the state rides in the carry: nnx takes no module from an outer trace
        i, token, _, cache, out, state = carry
        logits, cache = nnx.merge(graphdef, state)(token.reshape(1, 1), cache=cache)
        token = next_token(logits[0, 0], jax.random.fold_in(key, index + i), knobs, greedy=greedy)
        return i + 1, token, stopped(token), cache, out.at[i].set(token), state

    out = jnp.zeros((cache.max_len,), jnp.int32).at[0].set(first)
    init = (jnp.int32(1), first, stopped(first), cache, out, state)
    count, _, done, cache, out, _ = jax.lax.while_loop(cond, body, init)
    return out, count, done, cache


def rope_switch(config: TransformerConfig, n: int, max_new_tokens: int) -> int | None:
    """The number of the new token before which a longrope model's sequence reaches
    ``original_max_len + 1`` tokens (None: it never does within ``max_new_tokens``, or the
    prompt is past it already, or the model has no ``LENGTH_DEPENDENT_ROPE``).

    There, as transformers' Phi-3 ``prepare_inputs_for_generation`` does, the cache is
    dropped and the whole sequence prefilled again: every cached key then takes the long
    factors, and the tokens after it equal the plain forward's.

    Example:
        >>> from jaxckpt import nn
        >>> scaling = nn.RopeScaling(kind="longrope", short_factor=(1.0,) * 16,
        ...                          long_factor=(2.0,) * 16, original_max_len=8)
        >>> cfg = nn.TransformerConfig.preset("tiny", rope_scaling=scaling)
        >>> rope_switch(cfg, 5, 8), rope_switch(cfg, 5, 4), rope_switch(cfg, 9, 8)
        (4, None, None)
    """
    scaling = config.rope_scaling
    if scaling is None or scaling.kind not in LENGTH_DEPENDENT_ROPE:
        return None
    cut = scaling.original_max_len + 1 - n
    return cut if 1 <= cut < max_new_tokens else None


def _run(model, prompt_ids, *, cache_len, max_new_tokens, sampling, key, index, stop_ids):
    """Prefill and decode: ``(new tokens, whether a stop id ended them)``."""
    cfg = model.config
    n = len(prompt_ids)
    padded = np.zeros((1, prompt_bucket(n, cache_len, cfg)), np.int32)
    padded[0, :n] = prompt_ids
    graphdef, state = nnx.split(model)
    knobs = sampling.knobs(cfg.vocab_size)
    index = jnp.asarray(index, jnp.int32)
    first, cache = _prefill(
        graphdef, state, padded, jnp.asarray(n, jnp.int32), key, index, knobs,
        cache_len=cache_len, greedy=sampling.greedy,
    )  # fmt: skip
    max_new = jnp.asarray(max_new_tokens, jnp.int32)
    out, count, done, _ = _decode(
        graphdef, state, cache, first, max_new, stop_ids, key, index, knobs, greedy=sampling.greedy
    )
    out, count, done = jax.device_get((out, count, done))
    return np.asarray(out[:count]), bool(done)


def decode_ids(
    model: Transformer,
    prompt_ids: np.ndarray,
    *,
    max_new_tokens: int,
    sampling: Sampling,
    seed: int = 0,
    stop_ids: Sequence[int] = (),
) -> tuple[np.ndarray, bool]:
    """The new tokens after ``prompt_ids`` (1-D, already checked to fit ``max_len`` with
    ``max_new_tokens`` more), and whether a stop id ended them (it is the last token).

    New token ``j`` is drawn with the key ``fold_in(key(seed), j)``. A longrope model whose
    sequence passes ``original_max_len`` is prefilled again there (``rope_switch``).

    Example:
        >>> import numpy as np
        >>> from flax import nnx
        >>> from jaxckpt import nn
        >>> model = nn.Transformer(nn.TransformerConfig.preset("tiny", n_layers=1), rngs=nnx.Rngs(0))
        >>> new, stopped = decode_ids(model, np.array([1, 2, 3]), max_new_tokens=4, sampling=Sampling())
        >>> new.shape, stopped
        ((4,), False)
    """
    n = len(prompt_ids)
    run = functools.partial(
        _run,
        model,
        cache_len=bucket(n + max_new_tokens, model.config.max_len),
        sampling=sampling,
        key=jax.random.key(seed),
        stop_ids=jnp.asarray(np.asarray(stop_ids, np.int32).reshape(-1)),
    )
    cut = rope_switch(model.config, n, max_new_tokens)
    if cut is None:
        return run(prompt_ids, max_new_tokens=max_new_tokens, index=0)
    head, stopped = run(prompt_ids, max_new_tokens=cut, index=0)
    if stopped:
        return head, True
    tail, stopped = run(np.concatenate([prompt_ids, head]), max_new_tokens=max_new_tokens - cut, index=cut)
    return np.concatenate([head, tail]), stopped
