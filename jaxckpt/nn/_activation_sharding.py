"""Where activations live in a sharded step: logical names on activation axes.

The modules name the axes of the activations they produce (``batch``, ``seq``,
``embed``, ``heads``, ``head_dim``, ``mlp``, ``vocab``) with ``constrain``. Outside
``activation_sharding`` that is a no-op. Inside it (``jaxckpt.train`` enters it while
tracing a step on a mesh) each name is looked up in the rules and the activation is
pinned with ``jax.lax.with_sharding_constraint``. Without the pins XLA's partitioner
is free to keep activations whole on every device and split the matmuls along the
parameters' sharded axes instead, so per-device activation memory would not fall
with the number of devices.

When the rules split ``seq`` over a mesh axis of more than one device (context
parallelism), the attention runs ``jaxckpt.attention.context_parallel_attention`` across
the shards, with the strategy ``activation_sharding(..., context_parallel=...)`` names.
"""

import contextlib
import contextvars
from collections.abc import Iterator, Mapping

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxckpt.attention import check_strategy

_ACTIVE: contextvars.ContextVar["tuple[Mesh, dict] | None"] = contextvars.ContextVar(
    "jaxckpt_activation_sharding", default=None
)
CONTEXT_PARALLEL_DEFAULT = "all_gather"
"""The context-parallel strategy when none is named (MaxText's default too)."""
_STRATEGY: contextvars.ContextVar[str] = contextvars.ContextVar(
    "jaxckpt_context_parallel", default=CONTEXT_PARALLEL_DEFAULT
)


@contextlib.contextmanager
def activation_sharding(
    mesh: Mesh,
    rules: Mapping[str, "str | tuple[str, ...] | None"],
    *,
    context_parallel: str = CONTEXT_PARALLEL_DEFAULT,
) -> Iterator[None]:
    """While active, ``constrain`` pins activations to ``mesh`` by ``rules``
    (logical name -> mesh axis or axes; names not in ``rules`` are not split).

    ``context_parallel``: the strategy of the attention across the shards of a sequence
    the rules split (``seq`` over a mesh axis of more than one device): ``"all_gather"``
    or ``"ring"`` (``jaxckpt.attention.CONTEXT_PARALLEL_STRATEGIES``).

    Raises:
        ValueError: for an unknown ``context_parallel``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> mesh = jax.make_mesh((1,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
        >>> with activation_sharding(mesh, {"batch": "fsdp"}):
        ...     y = jax.jit(lambda x: constrain(x, "batch", "embed"))(jnp.ones((2, 3)))
        >>> y.shape
        (2, 3)
    """
    check_strategy(context_parallel, "context_parallel")
    token, strategy = _ACTIVE.set((mesh, dict(rules))), _STRATEGY.set(context_parallel)
    try:
        yield
    finally:
        _STRATEGY.reset(strategy)
        _ACTIVE.reset(token)


def active_sharding() -> "tuple[Mesh, dict] | None":
    """The ``(mesh, rules)`` of the active ``activation_sharding``, or None outside one
    (for code that must place a kernel XLA cannot partition itself: ``jax.shard_map``).

    Example:
        >>> active_sharding() is None
        True
    """
    return _ACTIVE.get()


def context_parallel_strategy() -> str:
    """The context-parallel strategy of the active ``activation_sharding`` (its default
    outside one).

    Example:
        >>> context_parallel_strategy()
        'all_gather'
    """
    return _STRATEGY.get()


def constrain(x: jax.Array, *names: str) -> jax.Array:
    """``x`` with its axes (one logical name each) pinned by the active rules; ``x``
    itself when no ``activation_sharding`` is active.

    Raises:
        ValueError: when the number of names is not ``x.ndim``.

    Example:
        >>> import jax.numpy as jnp
        >>> x = jnp.ones((2, 3))
        >>> constrain(x, "batch", "embed") is x  # no activation_sharding active
        True
    """
    active = _ACTIVE.get()
    if active is None:
        return x
    if len(names) != x.ndim:
        raise ValueError(f"constrain: {len(names)} names {names} for an array of shape {x.shape}")
    mesh, rules = active
    return jax.lax.with_sharding_constraint(
        x, NamedSharding(mesh, PartitionSpec(*(rules.get(n) for n in names)))
    )
