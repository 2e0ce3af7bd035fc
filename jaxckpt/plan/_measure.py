"""``measure``: XLA's own memory figures for a train step, compiled from abstract inputs."""

import dataclasses
import functools
import math
from types import MappingProxyType

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxckpt._checks import require_positive_int
from jaxckpt.nn import Transformer, TransformerConfig
from jaxckpt.plan._sharded import fsdp_mesh_shape, measure_sharded, sharded_bytes
from jaxckpt.remat import RematSpec
from jaxckpt.remat import get as get_remat
from jaxckpt.train import (
    MemoryReport,
    OptimizerConfig,
    jit_train_step,
    make_mesh,
    memory_report,
    state_shardings,
)

OPTIMIZERS = MappingProxyType(
    {
        "adamw": lambda: OptimizerConfig().transformation(),
        "sgd": lambda: optax.sgd(1e-3, momentum=None),
        "adafactor": lambda: optax.adafactor(1e-3),
    }
)
"""Optimizer name -> optax transformation factory (the state size is what matters here)."""

CPU_CAVEAT = (
    "measured with XLA:CPU's buffer assignment, a proxy for GPU/NPU: their compilers fuse, schedule "
    "and pad differently, and the size of that difference has not been measured yet (no GPU/NPU run)"
)


def tree_bytes(tree) -> int:
    """Bytes of every array (or ``ShapeDtypeStruct``) leaf of ``tree``."""
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def abstract_train_state(config: TransformerConfig, optimizer: str = "adamw"):
    """Abstract ``(model, nnx.Optimizer)``: their variables hold ``ShapeDtypeStruct``s.

    Nothing is allocated, so it works for models far larger than this machine's memory.
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; valid: {', '.join(OPTIMIZERS)}")
    tx = OPTIMIZERS[optimizer]()

    def build():
        model = Transformer(config, rngs=nnx.Rngs(0))
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

    return nnx.eval_shape(build)


def measure(
    config: TransformerConfig,
    batch: int,
    seq: int,
    remat: "str | RematSpec",
    *,
    optimizer: str = "adamw",
    micro_batches: int = 1,
    devices: int = 1,
) -> MemoryReport:
    """Compiles the real train step from abstract inputs and reads XLA's memory analysis.

    No parameter is ever allocated, so ``llama2-7b`` can be measured on a laptop's CPU.
    See ``CPU_CAVEAT`` for how far the CPU figures carry to other backends.

    Args:
        config: the model. batch, seq, micro_batches: the step's input ``[M, B, T + 1]``.
        remat: a preset name or ``RematSpec``.
        optimizer: a key of ``OPTIMIZERS``.
        devices: FSDP devices (``jaxckpt train --mesh fsdp=D``): the step is compiled
            over D devices (simulated CPU devices in a subprocess when this process has
            fewer) and the figures are one device's; ``batch`` is split over them.

    Returns:
        A ``MemoryReport`` with ``params``, ``optimizer`` and ``grads`` filled in.

    Raises:
        ValueError: for bad sizes or names, or a batch the devices do not divide.

    Example:
        >>> from jaxckpt import nn, plan
        >>> cfg = nn.TransformerConfig.preset("tiny", n_layers=2)
        >>> report = plan.measure(cfg, batch=2, seq=64, remat="full")
        >>> report.params == report.grads, report.peak > report.params + report.optimizer
        (True, True)
    """
    for name, value in (
        ("batch", batch),
        ("seq", seq),
        ("micro_batches", micro_batches),
        ("devices", devices),
    ):
        require_positive_int(name, value, "measure: ")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; valid: {', '.join(OPTIMIZERS)}")
    if devices > 1:
        return measure_sharded(config, batch, seq, get_remat(remat), optimizer, micro_batches, devices)
    return _measure(config, batch, seq, get_remat(remat), optimizer, micro_batches)


@functools.lru_cache(maxsize=128)
def _measure(
    config: TransformerConfig,
    batch: int,
    seq: int,
    spec: RematSpec,
    optimizer: str,
    micro_batches: int,
    devices: int = 1,
) -> MemoryReport:
    """``measure`` after validation, compiled in this process (which has ``devices``
    devices); the same step is compiled once per process. ``devices > 1``: the FSDP step
    over ``fsdp=devices``, its state given as ``ShapeDtypeStruct``s with their shardings."""
    model, opt = abstract_train_state(config, optimizer)
    graphdef, state = nnx.split((model, opt))
    tokens = jax.ShapeDtypeStruct((micro_batches, batch, seq + 1), jnp.int32)
    if devices == 1:
        step = jit_train_step(graphdef, spec)
    else:
        mesh = make_mesh(fsdp_mesh_shape(devices), devices=jax.devices()[:devices])
        shardings = state_shardings(state, mesh)
        state = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings
        )
        step = jit_train_step(graphdef, spec, shardings, mesh)
    params = sharded_bytes(nnx.state(model, nnx.Param), devices)
    return dataclasses.replace(
        memory_report(step.lower(state, tokens).compile(), device_stats=False),
        params=params,
        optimizer=sharded_bytes(nnx.state(opt), devices),
        grads=params,
    )
