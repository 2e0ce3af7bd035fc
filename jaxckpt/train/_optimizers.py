"""``OptimizerConfig``: AdamW, Adafactor or SGD with momentum, their state dtype and placement,
and the loss scaling of the step; one transformation for the trainer and the planner."""

import dataclasses
import math
from collections.abc import Callable
from types import MappingProxyType

import optax
from flax import nnx

from jaxckpt._checks import known_fields
from jaxckpt.nn import trainable
from jaxckpt.train._loss_scale import LOSS_SCALES, LossScaler, keep_state_if_finite, loss_scale_mode
from jaxckpt.train._offload import stream_to_host
from jaxckpt.train._transforms import (
    clip_by_global_norm,
    keep_state_dtypes,
    scale_by_adam_stored,
    trace_stored,
)

MOMENTS_DTYPES = ("float32", "bfloat16")
"""Dtypes ``OptimizerConfig.moments_dtype`` takes (None: optax's, the parameters' own)."""


def _adamw(c: "OptimizerConfig", lr) -> optax.GradientTransformation:
    if c.moments_dtype is None:  # optax's own, state in the params' dtype
        return optax.adamw(lr, b1=c.b1, b2=c.b2, eps=c.eps, weight_decay=c.weight_decay)
    # optax.adamw's chain and state, its moments stored in moments_dtype
    adam = scale_by_adam_stored(c.b1, c.b2, c.eps, c.moments_dtype)
    return optax.chain(adam, optax.add_decayed_weights(c.weight_decay), optax.scale_by_learning_rate(lr))


def _adafactor(c: "OptimizerConfig", lr) -> optax.GradientTransformation:
    return optax.adafactor(lr, weight_decay_rate=c.weight_decay or None)


def _sgd(c: "OptimizerConfig", lr) -> optax.GradientTransformation:
    if not c.momentum:
        sgd = optax.sgd(lr)
    elif c.moments_dtype is None:
        sgd = optax.sgd(lr, momentum=c.momentum)
    else:  # optax.sgd's chain and state, its trace stored in moments_dtype
        sgd = optax.chain(trace_stored(c.momentum, c.moments_dtype), optax.scale_by_learning_rate(lr))
    return optax.chain(optax.add_decayed_weights(c.weight_decay), sgd) if c.weight_decay else sgd


OPTIMIZERS: "MappingProxyType[str, Callable]" = MappingProxyType(
    {"adamw": _adamw, "adafactor": _adafactor, "sgd": _sgd}
)
"""``OptimizerConfig.name`` -> ``(config, schedule) -> optax transformation`` (before the
clip, the state dtypes and the offload that ``OptimizerConfig.transformation`` adds)."""


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer (linear warm-up, cosine decay, global-norm clipping), where its state
    lives, and the step's loss scaling.

    Attributes:
        learning_rate: peak learning rate. warmup_steps: linear warm-up length.
        decay_steps: cosine decay length after warm-up (0 = constant after warm-up).
        weight_decay: decoupled (AdamW, Adafactor's ``weight_decay_rate``), or L2 added to
            the gradient (SGD); 0 turns it off. b1, b2, eps: AdamW's.
        clip_norm: global gradient-norm clip; 0 disables it.
        name: ``"adamw"``, ``"adafactor"`` (optax's: factored second moments, no first
            moment, relative step sizes) or ``"sgd"`` (with ``momentum``), a key of ``OPTIMIZERS``.
        moments_dtype: the dtype of the optimizer's floating state (``"float32"``,
            ``"bfloat16"``); None: the parameters' own, but float32 for float16 ones
            (``keep_state_dtypes``). optax's ``mu_dtype`` covers AdamW's first moment only
            (its ``nu`` stays in the parameters' dtype), so AdamW and SGD's momentum store
            theirs through ``scale_by_adam_stored`` / ``trace_stored`` (optax's state and
            formula, updated in place); Adafactor's statistics through ``keep_state_dtypes``.
        momentum: SGD's momentum (0: plain SGD, no state).
        offload: keep the optimizer state in host memory (``pinned_host``) and stream the
            update leaf by leaf (``stream_to_host``). On CPU the host memory is the same RAM:
            it runs, and saves nothing. Parameters and gradients stay on the device.
        offload_master: keep a full fine-tuning's float32 master weights in host memory
            (``pinned_host``): the step computes with their 16-bit copies, brought over
            leaf by leaf, and the update streams master by master (``jaxckpt.train._master``).
            Needs float32 params with a 16-bit compute dtype and no LoRA (``Trainer``
            checks). Saves nothing on CPU either.
        loss_scale: ``"auto"`` (dynamic for a float16 model, compute or parameters; else
            none), ``"dynamic"``, ``"none"``, or a number, a static scale. Dynamic scaling
            skips a step whose gradients are not finite (params and optimizer state
            unchanged), halves the scale, and doubles it after ``loss_scale_period`` good steps.
        loss_scale_init: the dynamic scale's first value. loss_scale_period: good steps
            before it grows.
        skip_nonfinite: skip a step whose loss or gradients are not finite (params and
            optimizer state unchanged), counted in ``Trainer.loss_scale()["skipped_steps"]``.
            None (the default): with dynamic loss scaling only. True costs memory without
            loss scaling: the select keeps the old state beside the new one (``small``,
            XLA:CPU: a 20% higher peak), so ``train`` sets it only for
            ``on_nonfinite="skip"``.

    Raises:
        ValueError: naming the field, for a value out of its range or choices.

    Example:
        >>> import jax.numpy as jnp
        >>> tx = OptimizerConfig(learning_rate=1e-3, warmup_steps=0).transformation()
        >>> params = {"w": jnp.ones(2)}
        >>> updates, _ = tx.update(params, tx.init(params), params)  # gradient = params
        >>> bool((updates["w"] < 0).all())  # a step against the gradient
        True
        >>> OptimizerConfig(name="sgd", momentum=0.8).to_dict()["name"]
        'sgd'
    """

    learning_rate: float = 3e-3
    warmup_steps: int = 10
    decay_steps: int = 0
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip_norm: float = 1.0
    name: str = "adamw"
    moments_dtype: str | None = None
    momentum: float = 0.9
    offload: bool = False
    offload_master: bool = False
    loss_scale: str | float = "auto"
    loss_scale_init: float = 2.0**15
    loss_scale_period: int = 2000
    skip_nonfinite: bool | None = None

    def __post_init__(self):
        if not self.learning_rate > 0:
            raise ValueError(f"OptimizerConfig: learning_rate={self.learning_rate!r} must be > 0")
        for name in ("warmup_steps", "decay_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"OptimizerConfig: {name}={getattr(self, name)!r} must be >= 0")
        if self.name not in OPTIMIZERS:
            raise ValueError(f"OptimizerConfig: name={self.name!r} is not one of {', '.join(OPTIMIZERS)}")
        if self.moments_dtype is not None and self.moments_dtype not in MOMENTS_DTYPES:
            raise ValueError(
                f"OptimizerConfig: moments_dtype={self.moments_dtype!r} is not one of "
                f"{', '.join(MOMENTS_DTYPES)} (or None: the parameters' dtype)"
            )
        if not 0 <= self.momentum < 1:
            raise ValueError(f"OptimizerConfig: momentum={self.momentum!r} must be in [0, 1)")
        object.__setattr__(self, "loss_scale", _loss_scale_value(self.loss_scale))
        if not (self.loss_scale_init > 0 and math.isfinite(self.loss_scale_init)):
            raise ValueError(f"OptimizerConfig: loss_scale_init={self.loss_scale_init!r} must be > 0")
        if isinstance(self.loss_scale_period, bool) or not (
            isinstance(self.loss_scale_period, int) and self.loss_scale_period >= 1
        ):
            raise ValueError(
                f"OptimizerConfig: loss_scale_period={self.loss_scale_period!r} must be a positive int"
            )

    def schedule(self) -> "optax.Schedule | float":
        """The learning rate by step: linear warm-up to the peak, then constant or a cosine
        decay to a tenth of it."""
        peak = self.learning_rate
        if self.decay_steps:
            return optax.warmup_cosine_decay_schedule(
                peak / (self.warmup_steps + 1),
                peak,
                max(self.warmup_steps, 1),
                self.warmup_steps + self.decay_steps,
                end_value=peak / 10,
            )
        if self.warmup_steps:
            return optax.linear_schedule(peak / (self.warmup_steps + 1), peak, self.warmup_steps)
        return peak

    def base_transformation(self) -> optax.GradientTransformation:
        """``OPTIMIZERS[name]`` with its state in ``moments_dtype``: what ``transformation``
        clips before and streams (``offload``), and what the host master weights' update
        (``offload_master``) applies leaf by leaf."""
        return keep_state_dtypes(OPTIMIZERS[self.name](self, self.schedule()), self.moments_dtype)

    def transformation(self) -> optax.GradientTransformation:
        """The optax transformation: the clip, then ``OPTIMIZERS[name]`` with its state in
        ``moments_dtype`` (and streamed to host memory with ``offload``); its ``update``
        takes ``finite=`` to keep the state of a skipped step. The trainer and
        ``jaxckpt.plan`` build this same one."""
        base = self.base_transformation()
        base = stream_to_host(base) if self.offload else keep_state_if_finite(base)
        return optax.chain(clip_by_global_norm(self.clip_norm), base) if self.clip_norm else base

    def build(self, model: nnx.Module) -> "TrainOptimizer":
        """The ``TrainOptimizer`` over ``model``'s trainable variables (``nn.trainable``: the
        LoRA adapters alone when ``model.config.lora`` is set), with the loss scaler that
        ``loss_scale`` gives ``model.config``. Nothing is placed in host memory here
        (``Trainer`` does it); under ``nnx.eval_shape`` it allocates nothing.

        Example:
            >>> from flax import nnx
            >>> from jaxckpt import nn
            >>> model = nn.Transformer(nn.TransformerConfig.preset("tiny", n_layers=1), rngs=nnx.Rngs(0))
            >>> OptimizerConfig(name="sgd").build(model).loss_scaler.mode
            'none'
        """
        mode = loss_scale_mode(self.loss_scale, model.config)
        scale = self.loss_scale if mode == "static" else self.loss_scale_init if mode == "dynamic" else 1.0
        scaler = LossScaler(mode, scale, self.loss_scale_period, self.skip_nonfinite)
        return TrainOptimizer(model, self.transformation(), wrt=trainable(model.config), loss_scaler=scaler)

    def to_dict(self) -> dict:
        """The fields, JSON-ready (``from_dict`` reads them back)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, fields: dict) -> "OptimizerConfig":
        """The config ``to_dict`` wrote.

        Raises:
            ValueError: naming the fields that are not ``OptimizerConfig``'s.

        Example:
            >>> OptimizerConfig.from_dict(OptimizerConfig(name="adafactor").to_dict()).name
            'adafactor'
        """
        return cls(**known_fields(cls, fields, "OptimizerConfig"))


def _loss_scale_value(value) -> "str | float":
    """``OptimizerConfig.loss_scale`` normalised: one of ``LOSS_SCALES``, or a positive float
    (a number's string, as the command line gives it, too)."""
    if isinstance(value, str) and value in LOSS_SCALES:
        return value
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if isinstance(value, bool) or not (number > 0 and math.isfinite(number)):
        raise ValueError(
            f"OptimizerConfig: loss_scale={value!r} must be one of {', '.join(LOSS_SCALES)} "
            "or a positive number (a static scale)"
        )
    return number


class TrainOptimizer(nnx.Optimizer):
    """``nnx.Optimizer`` with the step's loss scaler (``loss_scaler``: its scale, good-step
    counter and skipped-step count, saved with every checkpoint).

    Example:
        >>> import optax
        >>> from flax import nnx
        >>> from jaxckpt import nn
        >>> from jaxckpt.train._loss_scale import LossScaler
        >>> model = nn.Transformer(nn.TransformerConfig.preset("tiny", n_layers=1), rngs=nnx.Rngs(0))
        >>> opt = TrainOptimizer(model, optax.sgd(0.1), wrt=nnx.Param, loss_scaler=LossScaler("none"))
        >>> int(opt.loss_scaler.skipped[...])
        0
    """

    def __init__(self, model, tx, *, wrt, loss_scaler: LossScaler):
        super().__init__(model, tx, wrt=wrt)
        self.loss_scaler = loss_scaler
