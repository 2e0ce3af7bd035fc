"""``on_nonfinite``: what a step with a non-finite loss or gradients does to the run.

``"skip"``: the step itself never applies such an update (``OptimizerConfig.skip_nonfinite``:
params and optimizer state stay as they were, the step is counted) and the run goes on.
``"stop"``: the run stops at the first non-finite loss, on the host, and a checkpoint is
never written from non-finite params (``check_params_finite``), so the last one on disk is
the last good state; the step carries no select (it costs memory: see ``skip_nonfinite``).
"""

import dataclasses
import math

from flax import nnx

from jaxckpt.train._loss_scale import all_finite
from jaxckpt.train._optimizers import OptimizerConfig

ON_NONFINITE = ("stop", "skip")
"""``train(on_nonfinite=)``'s choices; ``"stop"`` is the default."""


class NonFiniteError(FloatingPointError):
    """A step's loss or gradients were not finite, and ``on_nonfinite="stop"``.

    Attributes:
        step: the step (0-based) that was not finite.

    Example:
        >>> NonFiniteError(7, "step 7: the loss is nan").step
        7
    """

    def __init__(self, step: int, message: str):
        super().__init__(message)
        self.step = step


def check_on_nonfinite(on_nonfinite: str) -> None:
    """Raises a ValueError naming ``on_nonfinite`` unless it is one of ``ON_NONFINITE``.

    Example:
        >>> check_on_nonfinite("halt")
        Traceback (most recent call last):
        ...
        ValueError: on_nonfinite='halt' must be 'stop' or 'skip'
    """
    if on_nonfinite not in ON_NONFINITE:
        raise ValueError(f"on_nonfinite={on_nonfinite!r} must be 'stop' or 'skip'")


def guard_step(
    on_nonfinite: str, step: int, loss: float, skipped: bool, dynamic_scale: bool, last_checkpoint: str
) -> None:
    """Raises ``NonFiniteError`` naming ``step`` when it was not finite and the policy is
    ``"stop"``.

    Not finite: the loss, or the gradients (the step was ``skipped``). Under dynamic loss
    scaling, non-finite gradients with a finite loss are the scale's overflow, which the
    scaler answers (it halves the scale): not a reason to stop. ``last_checkpoint`` says
    where the last good state is, for the message.

    Example:
        >>> guard_step("skip", 3, float("nan"), True, False, "")  # counted, not raised
        >>> guard_step("stop", 3, float("nan"), True, False, "none written")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        jaxckpt.train._nonfinite.NonFiniteError: step 3: the loss is nan; stopped (...), none written
    """
    finite_loss = math.isfinite(loss)
    if on_nonfinite == "skip" or (finite_loss and (not skipped or dynamic_scale)):
        return
    what = f"the loss is {loss}" if not finite_loss else "the gradients are not finite (NaN or Inf)"
    raise NonFiniteError(
        step,
        f"step {step}: {what}; stopped (on_nonfinite='stop'; 'skip' would skip such steps), "
        f"{last_checkpoint}",
    )


def optimizer_for(optimizer: "OptimizerConfig | None", on_nonfinite: str) -> "OptimizerConfig | None":
    """``optimizer`` with the in-step skip that ``on_nonfinite="skip"`` needs.

    Example:
        >>> optimizer_for(None, "skip").skip_nonfinite, optimizer_for(None, "stop") is None
        (True, True)
    """
    if on_nonfinite != "skip":
        return optimizer
    return dataclasses.replace(optimizer or OptimizerConfig(), skip_nonfinite=True)


def check_params_finite(model: nnx.Module, step: int, last_checkpoint: str) -> None:
    """Raises ``NonFiniteError`` when ``model``'s params hold a NaN or an Inf (a step with
    non-finite gradients but a finite loss updated them), before they are checkpointed.

    Example:
        >>> import jax.numpy as jnp
        >>> class M(nnx.Module):
        ...     def __init__(self): self.w = nnx.Param(jnp.array([1.0, jnp.nan]))
        >>> check_params_finite(M(), 4, "none written")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        jaxckpt.train._nonfinite.NonFiniteError: step 4: the params are not finite ...
    """
    if not bool(all_finite(nnx.state(model, nnx.Param))):
        raise NonFiniteError(
            step,
            f"step {step}: the params are not finite (a step up to this one had non-finite gradients); "
            f"stopped before checkpointing them (on_nonfinite='stop'), {last_checkpoint}",
        )
