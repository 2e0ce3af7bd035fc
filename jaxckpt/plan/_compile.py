"""XLA's memory figures of the real train step, compiled in this process from abstract inputs.

The step is the one ``jaxckpt.train`` runs, over the state ``train.Trainer`` builds (its
optimizer over ``nn.trainable``, with its loss scaler; with ``optimizer_placement="host"``
the optimizer state in ``pinned_host`` memory). Over ``devices > 1`` it is the FSDP step
of ``jaxckpt train --mesh fsdp=D``: the state given as ``ShapeDtypeStruct``s with the
shardings of ``jaxckpt.train.state_shardings``, the batch split over the devices;
XLA's memory analysis of an SPMD program describes one device. Nothing is allocated.

XLA:CPU's memory analysis counts arguments placed in ``pinned_host`` among the device's
(``host_argument_size_in_bytes`` stays 0: on CPU they are the same RAM). A device with
its own memory holds them on the host, so ``compile_report`` moves the host-placed
optimizer state (and host master weights, ``master_placement="host"``) out of the
argument, output and alias figures, and the peak is the device's; on a backend that
reports host arguments apart nothing is moved.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxckpt.plan._state import abstract_train_state, state_bytes, trainable_bytes
from jaxckpt.plan._workload import Workload
from jaxckpt.remat import RematSpec
from jaxckpt.train import (
    MemoryReport,
    jit_train_step,
    make_mesh,
    memory_report,
    offload_shardings,
    state_shardings,
)


@functools.lru_cache(maxsize=128)
def compile_report(workload: Workload, spec: RematSpec) -> MemoryReport:
    """One device's ``MemoryReport`` of the step, compiled here (once per process).

    This process must have ``workload.devices`` devices (``jaxckpt.plan._sharded``
    compiles in a subprocess that has them otherwise).
    """
    model, opt = abstract_train_state(workload.config, workload.optimizer_config)
    graphdef, state = nnx.split((model, opt))
    tokens = jax.ShapeDtypeStruct(workload.input_shape, jnp.int32)
    devices, mesh, shardings = workload.devices, None, None
    if devices > 1:
        mesh = make_mesh(workload.mesh_shape, devices=jax.devices()[:devices])
        shardings = state_shardings(state, mesh)
    host = workload.optimizer_placement == "host"
    masters = workload.master_placement == "host"
    if host or masters:
        shardings = offload_shardings(state, shardings, optimizer=host, masters=masters)
    if shardings is not None:
        state = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings
        )
    step = jit_train_step(
        graphdef, spec, shardings, mesh, masters=workload.optimizer_config if masters else None
    )
    compiled = step.lower(state, tokens).compile()
    report = memory_report(compiled, device_stats=False)
    params, optimizer = state_bytes(workload)
    on_host = (optimizer if host else 0) + (params if masters else 0)
    if on_host and not getattr(compiled.memory_analysis(), "host_argument_size_in_bytes", 0):
        # XLA:CPU counts host-placed arguments with the device's: take them out
        report = dataclasses.replace(
            report,
            argument=report.argument - on_host,
            output=report.output - on_host,
            alias=report.alias - on_host,
        )
    return dataclasses.replace(report, params=params, optimizer=optimizer, grads=trainable_bytes(workload))
