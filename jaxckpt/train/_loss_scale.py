"""Loss scaling for float16 training (``jmp``'s loss scales) and the non-finite step skip.

The scaler's state (scale, good-step counter, skipped-step count) is a part of the
trainer's state (``TrainOptimizer.loss_scaler``): the step stays one jitted, donated
function, the state is saved with every checkpoint, and a resumed run continues its scale.

The skip is its own function (``keep_if_finite``), so a guard against non-finite values
without loss scaling composes the same way: a ``LossScaler("none", skip_nonfinite=True)``.
"""

import jax
import jax.numpy as jnp
import jmp
import optax
from flax import nnx

LOSS_SCALES = ("auto", "dynamic", "none")
"""``OptimizerConfig.loss_scale``'s names (a number is a static scale)."""

FLOAT16 = "float16"

GROWTH_FACTOR = 2
"""The dynamic scale halves on a non-finite step and doubles after ``period`` good ones."""


def loss_scale_mode(loss_scale: "str | float", config) -> str:
    """``"dynamic"``, ``"static"`` or ``"none"``: what ``loss_scale`` (``OptimizerConfig``'s)
    means for a model ``config``. ``"auto"`` scales dynamically when the model computes or
    stores its parameters in float16 (its gradients are float16 then), else not at all.

    Example:
        >>> from jaxckpt import nn
        >>> loss_scale_mode("auto", nn.TransformerConfig.preset("tiny", dtype="float16"))
        'dynamic'
        >>> loss_scale_mode("auto", nn.TransformerConfig.preset("tiny")), loss_scale_mode(128.0, None)
        ('none', 'static')
    """
    if loss_scale == "auto":
        return "dynamic" if FLOAT16 in (config.dtype, config.param_dtype) else "none"
    return loss_scale if isinstance(loss_scale, str) else "static"


class LossScaleState(nnx.Variable):
    """The loss scaler's state: not a parameter, not optimizer state."""


class LossScaler(nnx.Pytree):
    """The step's loss scale (a ``jmp`` loss scale rebuilt from this state in every step).

    Args:
        mode: ``"dynamic"`` (``jmp.DynamicLossScale``), ``"static"``
            (``jmp.StaticLossScale``) or ``"none"``.
        scale: the (first) scale; 1 for ``"none"``.
        period: good steps before a dynamic scale doubles.
        skip_nonfinite: skip a step whose loss or gradients are not finite (params and
            optimizer state unchanged, ``skipped`` counts it); default: with dynamic scaling.

    Attributes:
        scale, good_steps, skipped: ``LossScaleState`` scalars (float32, int32, int32).

    Example:
        >>> import jax.numpy as jnp
        >>> scaler = LossScaler("dynamic", 2.0**40, period=3)
        >>> scaler.adjust(jnp.bool_(False))  # an overflow: the scale halves
        >>> float(scaler.scale[...]), int(scaler.skipped[...])
        (549755813888.0, 1)
    """

    def __init__(self, mode: str, scale: float = 1.0, period: int = 2000, skip_nonfinite: bool | None = None):
        if mode not in ("dynamic", "static", "none"):
            raise ValueError(f"LossScaler: mode={mode!r} must be 'dynamic', 'static' or 'none'")
        self.mode = mode
        self.period = period
        self.skip_nonfinite = mode == "dynamic" if skip_nonfinite is None else skip_nonfinite
        self.scale = LossScaleState(jnp.asarray(1.0 if mode == "none" else scale, jnp.float32))
        self.good_steps = LossScaleState(jnp.zeros((), jnp.int32))
        self.skipped = LossScaleState(jnp.zeros((), jnp.int32))

    def loss_scale(self) -> jmp.LossScale:
        """The ``jmp`` loss scale of the current state."""
        if self.mode == "dynamic":
            scale = self.scale[...]
            return jmp.DynamicLossScale(scale, self.good_steps[...], self.period, GROWTH_FACTOR)
        if self.mode == "static":
            return jmp.StaticLossScale(self.scale[...])
        return jmp.NoOpLossScale()

    def adjust(self, finite: jax.Array) -> None:
        """After a step whose gradients were ``finite`` (a bool scalar): a dynamic scale
        shrinks or grows (``jmp.DynamicLossScale.adjust``), and a skipped step is counted."""
        with jax.numpy_dtype_promotion("standard"):  # jmp mixes bool and int32
            if self.mode == "dynamic":
                adjusted = self.loss_scale().adjust(finite)
                self.scale[...] = adjusted.loss_scale
                self.good_steps[...] = adjusted.counter
            if self.skip_nonfinite:
                self.skipped[...] = self.skipped[...] + jnp.logical_not(finite).astype(jnp.int32)


@jax.jit
def all_finite(tree) -> jax.Array:
    """Whether every element of every array of ``tree`` is finite (``jmp.all_finite``).

    Jitted: called eagerly (before every checkpoint write) it is one compiled program per
    tree structure, not one small program per leaf's reduction.

    Example:
        >>> import jax.numpy as jnp
        >>> bool(all_finite({"a": jnp.ones(3), "b": jnp.array([1.0, jnp.inf])}))
        False
    """
    return jmp.all_finite(tree)


def keep_if_finite(finite: jax.Array, new, old):
    """``new`` where ``finite`` (a bool scalar), else ``old``, leaf by leaf: the skip of a
    non-finite step. One select per leaf, fused into the update that computes ``new``: on
    the ``small`` preset (XLA:CPU) the step's compiled temp bytes are those of the step
    without the skip.

    Example:
        >>> import jax.numpy as jnp
        >>> keep_if_finite(jnp.bool_(False), {"w": jnp.zeros(2)}, {"w": jnp.ones(2)})["w"].tolist()
        [1.0, 1.0]
    """
    return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)


def keep_state_if_finite(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """``inner`` whose ``update`` takes ``finite=`` (a bool scalar): where it is False the
    state stays as it was (``keep_if_finite``); without it, ``inner``'s update.

    Example:
        >>> import jax.numpy as jnp, optax
        >>> tx = keep_state_if_finite(optax.adam(0.1))
        >>> state = tx.init({"w": jnp.ones(2)})
        >>> _, kept = tx.update({"w": jnp.full(2, jnp.nan)}, state, finite=jnp.bool_(False))
        >>> kept[0].mu["w"].tolist()
        [0.0, 0.0]
    """

    def update(updates, state, params=None, *, finite=None, **extra):
        del extra
        new_updates, new_state = inner.update(updates, state, params)
        return new_updates, new_state if finite is None else keep_if_finite(finite, new_state, state)

    return optax.GradientTransformationExtraArgs(inner.init, update)
