"""``on_nonfinite``: what a step with a non-finite loss or gradients does to the run.

The step itself never applies such an update (``OptimizerConfig.skip_nonfinite``: params
and optimizer state stay as they were, and the step is counted); this decides, on the
host, whether the run goes on (``"skip"``) or stops there (``"stop"``).
"""

import math

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
