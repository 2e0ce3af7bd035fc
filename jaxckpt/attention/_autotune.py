"""``autotune_pallas_blocks``: time the Pallas kernel's candidate blocks on this GPU."""

import functools
import time
from collections.abc import Callable, Iterable

import jax
import jax.numpy as jnp

from jaxckpt.attention._api import flash_attention
from jaxckpt.attention._platform import platform
from jaxckpt.attention.pallas import PallasBlocks, padded_head_dim, set_pallas_blocks


def _seconds(fn: Callable, repeats: int) -> float:
    jax.block_until_ready(fn())  # compile and warm up
    start = time.perf_counter()
    for _ in range(repeats):
        jax.block_until_ready(fn())
    return (time.perf_counter() - start) / repeats


def autotune_pallas_blocks(
    query, key, value, candidates: Iterable[PallasBlocks], *, repeats: int = 10, **kwargs
) -> tuple[PallasBlocks, dict[PallasBlocks, float]]:
    """Times forward+backward of ``implementation="pallas"`` under each candidate on this
    GPU, records the fastest with :func:`set_pallas_blocks` and returns it with every time.

    Args:
        query, key, value: arrays shaped as ``flash_attention`` takes them.
        candidates: the :class:`PallasBlocks` to try.
        repeats: timed runs per candidate (after one warm-up run).
        **kwargs: other ``flash_attention`` arguments (``is_causal=True``, ...).

    Raises:
        ValueError: not on a GPU (timing the interpreter tunes nothing), or no candidates.

    On a GPU, ``autotune_pallas_blocks(q, k, v, [PallasBlocks((128, 64), (32, 128),
    (128, 32)), PallasBlocks((64, 64), (64, 64), (64, 64))], is_causal=True)`` returns
    the faster and both times. Elsewhere it refuses:

    Example:
        >>> import jax.numpy as jnp
        >>> from jaxckpt.attention import PallasBlocks, autotune_pallas_blocks
        >>> q = jnp.ones((1, 128, 2, 64), jnp.bfloat16)
        >>> blocks = [PallasBlocks((64, 64), (64, 64), (64, 64))]
        >>> autotune_pallas_blocks(q, q, q, blocks)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: autotune_pallas_blocks times the Triton kernel and needs a GPU; ...
    """
    if platform() != "gpu":
        raise ValueError(
            f"autotune_pallas_blocks times the Triton kernel and needs a GPU; this backend is "
            f"{platform()!r} (where implementation='pallas' runs the interpreter)."
        )
    candidates = list(candidates)
    if not candidates:
        raise ValueError("candidates is empty: give at least one PallasBlocks to time.")
    h_pad = padded_head_dim(query.shape[-1])

    def loss(q, k, v):
        return flash_attention(q, k, v, implementation="pallas", **kwargs).astype(jnp.float32).sum()

    times = {}
    for blocks in candidates:
        set_pallas_blocks(h_pad, query.dtype, blocks)
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))  # retrace: blocks are static
        times[blocks] = _seconds(functools.partial(step, query, key, value), repeats)
    best = min(times, key=times.get)
    set_pallas_blocks(h_pad, query.dtype, best)
    return best, times
