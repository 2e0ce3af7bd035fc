"""The registry of attention implementations, and how ``implementation=`` resolves.

An implementation is a function ``fn(inputs: AttentionInputs, block_sizes) ->
(out [B, T, N, H], lse [B, N, T] fp32)`` plus the set of features it supports and
a probe saying whether it can run here. Nothing falls back silently: an unknown
name, an unavailable backend or an unsupported feature raises an error.
"""

import dataclasses
from collections.abc import Callable

from jaxckpt.attention._validate import AttentionInputs

FEATURES = frozenset({"bias", "mask", "causal", "lengths", "window", "segments", "softcap", "dropout"})
"""Every optional feature of the contract, as :func:`features_used` names them."""


def _always() -> str | None:
    return None


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One registered attention implementation.

    Attributes:
        name: the ``implementation=`` string.
        fn: ``fn(inputs, block_sizes) -> (out, lse)`` on canonical inputs.
        supports: the subset of :data:`FEATURES` it handles.
        unavailable: returns None when it can run here, else the reason it cannot.
        shares_dropout_mask: its dropout drops exactly ``dropout_mask(rng, ...)``; False
            for a backend whose kernel draws its own mask (e.g. the NPU's generator).
        materializes_scores: whether it holds the ``[B, N, T, S]`` logits/probabilities
            in JAX device memory (O(T * S), like "reference" and "xla"), rather than
            O(T) as a flash kernel does. The memory planner reads it.
        note: returns None, or a few words on how it runs here (``jaxckpt info`` prints
            them: "pallas" off a GPU runs the Pallas interpreter, slow, for testing).

    Example:
        >>> from jaxckpt.attention import implementations
        >>> impl = implementations()["blockwise"]
        >>> impl.name, impl.materializes_scores
        ('blockwise', False)
    """

    name: str
    fn: Callable
    supports: frozenset = FEATURES
    unavailable: Callable[[], str | None] = _always
    shares_dropout_mask: bool = True
    materializes_scores: bool = False
    note: Callable[[], str | None] = _always


_REGISTRY: dict[str, Implementation] = {}


def register_implementation(
    name: str,
    fn: Callable,
    *,
    supports=FEATURES,
    unavailable: Callable[[], str | None] = _always,
    shares_dropout_mask: bool = True,
    materializes_scores: bool = False,
    note: Callable[[], str | None] = _always,
) -> None:
    """Makes ``fn`` callable as ``flash_attention(..., implementation=name)``.

    Args:
        name: the implementation string.
        fn: ``fn(inputs: AttentionInputs, block_sizes: BlockSizes | None)`` returning
            ``(out [B, T, N, H] in the input dtype, lse [B, N, T] float32)``. Rows
            that see no key must return 0 (and ``lse = -inf``).
        supports: the features of :data:`FEATURES` that ``fn`` handles; a call
            using another raises ``NotImplementedError``.
        unavailable: a probe returning None when ``fn`` can run on this machine,
            else a sentence saying why not.
        shares_dropout_mask: False when ``fn`` draws its own dropout mask (a kernel's
            generator) instead of ``jaxckpt.attention.dropout_mask``: the same rate, a
            different mask, so dropout results are not comparable across backends.
        materializes_scores: True when ``fn`` holds the ``[B, N, T, S]`` scores in JAX
            device memory (naive softmax attention); False for an O(T) flash kernel,
            or one whose scores live outside JAX (a host callback). The memory planner
            budgets O(T * S) attention activations for the implementations marked True.
        note: a probe returning None or a few words on how ``fn`` runs on this machine.

    Example:
        >>> from jaxckpt.attention import register_implementation, attention_reference
        >>> from jaxckpt.attention._reference import reference_normalized
        >>> register_implementation(
        ...     "my_ref", lambda inputs, bs: reference_normalized(inputs), materializes_scores=True
        ... )
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty string; got {name!r}.")
    unknown = set(supports) - FEATURES
    if unknown:
        raise ValueError(f"supports has unknown features {sorted(unknown)}; known: {sorted(FEATURES)}.")
    _REGISTRY[name] = Implementation(
        name, fn, frozenset(supports), unavailable, shares_dropout_mask, bool(materializes_scores), note
    )


def implementations() -> dict[str, Implementation]:
    """A copy of the registry, name -> :class:`Implementation`.

    Example:
        >>> from jaxckpt.attention import implementations
        >>> sorted(n for n, i in implementations().items() if i.materializes_scores)[:2]
        ['reference', 'xla']
    """
    return dict(_REGISTRY)


def available_implementations() -> list[str]:
    """Names of the implementations that can run on this machine.

    Example:
        >>> from jaxckpt.attention import available_implementations
        >>> "blockwise" in available_implementations()
        True
    """
    return [name for name, impl in _REGISTRY.items() if impl.unavailable() is None]


def features_used(p: AttentionInputs) -> set[str]:
    """Which optional features a call uses (names from :data:`FEATURES`).

    Example:
        >>> import jax.numpy as jnp
        >>> from jaxckpt.attention import features_used, normalize
        >>> q = jnp.ones((1, 5, 3, 8))
        >>> sorted(features_used(normalize(q, q, q, is_causal=True, logits_soft_cap=5.0)))
        ['causal', 'softcap']
    """
    a, st = p.arrays, p.static
    used = {
        "bias": p.bias is not None,
        "mask": a.mask is not None,
        "causal": st.mask.is_causal,
        "lengths": a.q_lengths is not None or a.kv_lengths is not None,
        "window": st.mask.window is not None,
        "segments": a.q_segments is not None,
        "softcap": st.logits_soft_cap is not None,
        "dropout": st.dropout_rate > 0,
    }
    return {name for name, on in used.items() if on}


def lookup(name: str, p: AttentionInputs) -> Implementation:
    """The implementation called ``name``, checked to be available and to support ``p``."""
    if name not in _REGISTRY:
        raise ValueError(
            f"unknown implementation={name!r}; registered: {sorted(_REGISTRY)}, "
            f"available here: {available_implementations()}."
        )
    impl = _REGISTRY[name]
    reason = impl.unavailable()
    if reason is not None:
        raise ValueError(
            f"implementation={name!r} is unavailable here: {reason} "
            f"Available here: {available_implementations()}."
        )
    missing = features_used(p) - impl.supports
    if missing:
        raise NotImplementedError(
            f"implementation={name!r} does not support {sorted(missing)}; "
            f"use implementation='blockwise' (supports every feature)."
        )
    return impl
