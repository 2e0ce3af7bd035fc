"""XLA's memory figures of the real train step, compiled in this process from abstract inputs.

The step is the one ``jaxckpt.train`` runs. Over ``devices > 1`` it is the FSDP step
of ``jaxckpt train --mesh fsdp=D``: the state given as ``ShapeDtypeStruct``s with the
shardings of ``jaxckpt.train.state_shardings``, the batch split over the devices;
XLA's memory analysis of an SPMD program describes one device. Nothing is allocated.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxckpt.plan._state import abstract_train_state, state_bytes
from jaxckpt.plan._workload import Workload
from jaxckpt.remat import RematSpec
from jaxckpt.train import MemoryReport, jit_train_step, make_mesh, memory_report, state_shardings


@functools.lru_cache(maxsize=128)
def compile_report(workload: Workload, spec: RematSpec) -> MemoryReport:
    """One device's ``MemoryReport`` of the step, compiled here (once per process).

    This process must have ``workload.devices`` devices (``jaxckpt.plan._sharded``
    compiles in a subprocess that has them otherwise).
    """
    model, opt = abstract_train_state(workload.config, workload.optimizer)
    graphdef, state = nnx.split((model, opt))
    tokens = jax.ShapeDtypeStruct(workload.input_shape, jnp.int32)
    devices = workload.devices
    if devices == 1:
        step = jit_train_step(graphdef, spec)
    else:
        mesh = make_mesh(workload.mesh_shape, devices=jax.devices()[:devices])
        shardings = state_shardings(state, mesh)
        state = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings
        )
        step = jit_train_step(graphdef, spec, shardings, mesh)
    params, optimizer = state_bytes(workload)
    return dataclasses.replace(
        memory_report(step.lower(state, tokens).compile(), device_stats=False),
        params=params,
        optimizer=optimizer,
        grads=params,
    )
