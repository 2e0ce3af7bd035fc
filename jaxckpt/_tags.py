"""The names of every activation that jaxckpt tags, and :func:`tag`, which tags one.

A remat policy refers to activations by these names, so a tag string is written
exactly once, here. The attention kernels place ``ATTN_OUT`` and ``ATTN_LSE``;
the ``jaxckpt.nn`` modules place the others. This module is on the ground floor
(it imports no layer), so the kernels can tag without importing ``jaxckpt.remat``,
which re-exports :class:`Tag`.

:func:`tag` is ``jax.ad_checkpoint.checkpoint_name`` plus a hook for the compressed
remat (``RematSpec.compress``, ``jaxckpt.nn``'s block stack), which ``jax.checkpoint``
policies cannot express (a policy saves the very value the forward pass used):

- under :func:`recording`, the forward pass of a layer, the values of the named tags
  are collected in the order they are placed;
- under :func:`substituting`, the layer run again for its backward pass, the i-th
  placement of a named tag returns the i-th stored value instead of the recomputed
  one (:func:`use_saved`: its tangent still flows through the recomputed expression,
  whose value XLA then drops).

With neither active, :func:`tag` is ``checkpoint_name`` alone: the jaxpr is unchanged.
"""

import contextlib
import enum
import threading
from collections.abc import Iterable, Iterator

import jax
from jax.ad_checkpoint import checkpoint_name
from jax.extend.core import get_opaque_trace_state


class Tag(enum.StrEnum):
    """``checkpoint_name`` tags placed by jaxckpt.

    Example:
        >>> from jaxckpt.remat import Tag
        >>> str(Tag.ATTN_OUT)
        'attn_out'
    """

    LAYER_INPUT = "layer_input"
    """The residual stream entering a block ``[B, T, D]``."""
    NORM_OUT = "norm_out"
    """The output of each pre-norm (before attention and before the MLP) ``[B, T, D]``."""
    Q_PROJ = "q_proj"
    """Query projection ``[B, T, N, H]`` (before RoPE)."""
    K_PROJ = "k_proj"
    """Key projection ``[B, S, K, H]`` (before RoPE)."""
    V_PROJ = "v_proj"
    """Value projection ``[B, S, K, H]``."""
    ATTN_OUT = "attn_out"
    """Attention output ``[B, T, N, H]`` (before the output projection)."""
    ATTN_LSE = "attn_lse"
    """Attention log-sum-exp, fp32, kept for the flash backward pass."""
    OUT_PROJ = "out_proj"
    """Attention output projection ``[B, T, D]``."""
    MLP_GATE = "mlp_gate"
    """Gate projection of a gated MLP (SwiGLU) ``[B, T, F]``."""
    MLP_UP = "mlp_up"
    """Up projection of the MLP ``[B, T, F]``."""
    MLP_ACT = "mlp_act"
    """Hidden activation of the MLP, the input of the down projection ``[B, T, F]``."""
    MLP_DOWN = "mlp_down"
    """Down projection of the MLP ``[B, T, D]``."""
    LINEAR_OUT = "linear_out"
    """Every dense projection's matmul output, before its bias (what ``save_dots`` saves)."""


PROJECTIONS = frozenset(
    {Tag.Q_PROJ, Tag.K_PROJ, Tag.V_PROJ, Tag.OUT_PROJ, Tag.MLP_GATE, Tag.MLP_UP, Tag.MLP_DOWN}
)
"""The tags that are matmul outputs (what ``minimal`` keeps besides the attention residuals)."""
QKV = frozenset({Tag.Q_PROJ, Tag.K_PROJ, Tag.V_PROJ})
ATTENTION_RESIDUALS = frozenset({Tag.ATTN_OUT, Tag.ATTN_LSE})


_LOCAL = threading.local()


class _Recorder:
    """Collects the values of ``names`` placed at the trace where it was opened."""

    def __init__(self, names: Iterable[str]):
        self.names = frozenset(map(str, names))
        self.trace = get_opaque_trace_state()
        self.values: dict[str, list[jax.Array]] = {name: [] for name in self.names}

    def __call__(self, x, name: str, record: bool):
        if record and name in self.names:
            if get_opaque_trace_state() != self.trace:
                raise ValueError(
                    f"compressed remat: the kept tag {name!r} is placed inside a nested "
                    "transformation of the layer (a lax.map, scan, switch or shard_map: "
                    "TransformerConfig.mlp_chunk, layers of several attention windows, or "
                    "context parallelism), out of which its value cannot be kept; recompute "
                    f"{name!r} (take it out of save and offload) or turn that option off"
                )
            self.values[name].append(x)
        return x


class _Substitute:
    """Returns the stored values in place of the recomputed ones, in placement order."""

    def __init__(self, saved: "dict[str, list[jax.Array]]"):
        self.saved = saved
        self.used = dict.fromkeys(saved, 0)

    def __call__(self, x, name: str, record: bool):
        del record
        if name not in self.saved:
            return x
        i = self.used[name]
        if i >= len(self.saved[name]):
            raise RuntimeError(
                f"compressed remat: tag {name!r} is placed more often when the layer is recomputed "
                f"than in its forward pass ({len(self.saved[name])}); the layer is not deterministic"
            )
        self.used[name] = i + 1
        return use_saved(x, self.saved[name][i])


def tag(x: jax.Array, name: str, *, record: bool = True) -> jax.Array:
    """``checkpoint_name(x, name)``, through the compressed remat's hook when one is active.

    Args:
        x: the activation.
        name: its ``Tag``.
        record: False where the caller records ``x`` itself at an outer trace (the attention
            kernels tag their output inside a ``custom_vjp``, and :func:`record` it outside).

    Example:
        >>> import jax.numpy as jnp
        >>> with recording([Tag.ATTN_OUT]) as values:
        ...     y = tag(jnp.ones(2), Tag.ATTN_OUT)
        >>> values["attn_out"][0].tolist()
        [1.0, 1.0]
    """
    x = checkpoint_name(x, str(name))
    hook = getattr(_LOCAL, "hook", None)
    return x if hook is None else hook(x, str(name), record)


def record(x: jax.Array, name: str) -> jax.Array:
    """Records ``x`` as the value of ``name`` for an active :func:`recording` (nothing else):
    for a value tagged inside a ``custom_vjp`` that comes out of it unchanged.

    Example:
        >>> import jax.numpy as jnp
        >>> record(jnp.ones(2), Tag.ATTN_LSE).shape  # no recording: x itself
        (2,)
    """
    hook = getattr(_LOCAL, "hook", None)
    return x if not isinstance(hook, _Recorder) else hook(x, str(name), True)


@contextlib.contextmanager
def _hooked(hook) -> Iterator:
    previous = getattr(_LOCAL, "hook", None)
    _LOCAL.hook = hook
    try:
        yield hook
    finally:
        _LOCAL.hook = previous


@contextlib.contextmanager
def recording(names: Iterable[str]) -> Iterator[dict[str, list[jax.Array]]]:
    """Collects, per name in ``names``, the values :func:`tag` places while it is open.

    Raises:
        ValueError: from :func:`tag`, for a name placed inside a nested trace (a loop or a
            ``shard_map`` of the traced function), whose value cannot leave it.

    Example:
        >>> import jax.numpy as jnp
        >>> with recording(["norm_out"]) as values:
        ...     y = tag(tag(jnp.ones(2), "norm_out") + 1, "norm_out")
        >>> [v.tolist() for v in values["norm_out"]]
        [[1.0, 1.0], [2.0, 2.0]]
    """
    with _hooked(_Recorder(names)) as hook:
        yield hook.values


@contextlib.contextmanager
def substituting(saved: "dict[str, list[jax.Array]]") -> Iterator[None]:
    """While open, the i-th :func:`tag` of a name in ``saved`` returns ``saved[name][i]``
    (through :func:`use_saved`).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> def f(x):
        ...     return (tag(jnp.sin(x), "mlp_act") ** 2).sum()
        >>> with substituting({"mlp_act": [jnp.full(2, 3.0)]}):
        ...     y, g = jax.value_and_grad(f)(jnp.zeros(2))
        >>> float(y), g.tolist()  # the value is the saved one; d/dx sin at 0 is 1, times 2 * 3
        (18.0, [6.0, 6.0])
    """
    with _hooked(_Substitute(saved)):
        yield


@jax.custom_jvp
def use_saved(value: jax.Array, saved: jax.Array) -> jax.Array:
    """``saved``, with the tangent of ``value``: a stored activation standing in for the
    recomputed one, whose value is then unused (XLA removes its computation) while
    autodiff still differentiates through it.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> y, dy = jax.jvp(lambda x: use_saved(2 * x, jnp.float32(7.0)), (1.0,), (1.0,))
        >>> float(y), float(dy)
        (7.0, 2.0)
    """
    del value
    return saved


@use_saved.defjvp
def _use_saved_jvp(primals, tangents):
    _, saved = primals
    d_value, _ = tangents
    return saved, d_value
