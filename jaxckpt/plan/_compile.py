"""XLA's memory figures of the real train step, compiled in this process from abstract inputs.

The step is the one ``jaxckpt.train`` runs, over the state ``train.Trainer`` builds (its
optimizer over ``nn.trainable``, with its loss scaler; with ``optimizer.offload``
the optimizer state in ``pinned_host`` memory). Over ``devices > 1`` it is the FSDP step
of ``jaxckpt train --mesh fsdp=D``: the state given as ``ShapeDtypeStruct``s with the
shardings of ``jaxckpt.train.state_shardings``, the batch split over the devices;
XLA's memory analysis of an SPMD program describes one device. Nothing is allocated.

With a GPU ``target`` (``plan.TARGETS``) the same step is lowered over that GPU's abstract
devices (``target_devices``) and compiled by XLA:GPU without one, under
``plan.deviceless()`` (attention traced for a GPU; no persistent-cache writes), with the
GEMM emitter ``gemm`` or a real GPU's autotune results.

XLA:CPU's memory analysis counts arguments placed in ``pinned_host`` among the device's
(``host_argument_size_in_bytes`` stays 0: on CPU they are the same RAM; a deviceless
XLA:GPU compile does the same, though it reports offloaded activations as host temp). A device with
its own memory holds them on the host, so ``compile_report`` moves the host-placed
optimizer state (and host master weights, ``optimizer.offload_master``) out of the
argument, output and alias figures, and the peak is the device's; on a backend that
reports host arguments apart nothing is moved.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import SingleDeviceSharding

from jaxckpt.plan._state import abstract_train_state, state_bytes, trainable_bytes
from jaxckpt.plan._targets import CPU, GpuTarget, compiler_options, deviceless, gpu_target, target_devices
from jaxckpt.plan._workload import Workload
from jaxckpt.remat import RematSpec
from jaxckpt.remat import get as get_remat
from jaxckpt.train import (
    MemoryReport,
    jit_train_step,
    make_mesh,
    memory_report,
    offload_shardings,
    state_shardings,
)


def _devices(workload: Workload, target: GpuTarget | None) -> list:
    if target is not None:
        return target_devices(target, workload.devices)
    if workload.devices > len(jax.devices()):
        raise ValueError(
            f"workload.devices={workload.devices} but this process has {len(jax.devices())} devices; "
            "plan.measure compiles over simulated CPU devices in a subprocess, or start this one with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={workload.devices}"
        )
    return jax.devices()[: workload.devices]


@functools.lru_cache(maxsize=32)
def compile_step(
    workload: Workload,
    remat: "str | RematSpec",
    *,
    target: "str | GpuTarget | None" = None,
    gemm: str = "default",
    autotune_results: str | None = None,
) -> jax.stages.Compiled:
    """The train step ``jaxckpt train`` runs for ``workload``, compiled from abstract inputs.

    Args:
        workload: the step (``plan.Workload``).
        remat: a preset name or ``RematSpec``.
        target: None compiles with this process's backend (XLA:CPU here); a GPU target
            name (``plan.TARGETS``) compiles with XLA:GPU for that GPU, without one
            (the ``gpu-aot`` extra), over ``workload.devices`` of them.
        gemm: a GPU target's matmul emitter, ``"default"`` or ``"cublas"``
            (``plan.GEMM_BACKENDS``); ignored for XLA:CPU.
        autotune_results: a file of autotune results dumped on a real GPU of the target's
            kind (``--xla_gpu_dump_autotune_results_to``), loaded by XLA:GPU.

    Returns:
        The ``jax.stages.Compiled`` step: ``memory_analysis()``, ``as_text()``, ``cost_analysis()``.
        Nothing is allocated, and a GPU target's step cannot run here.

    Raises:
        ValueError: for an unknown target, or more ``workload.devices`` than this
            process has (``target=None``).
        RuntimeError: when a GPU target is asked for without the ``gpu-aot`` extra.

    Example:
        >>> from jaxckpt import nn, plan
        >>> workload = plan.Workload(nn.TransformerConfig.preset("tiny", n_layers=1), batch=1, seq=16)
        >>> compiled = plan.compile_step(workload, "full")
        >>> compiled.memory_analysis().temp_size_in_bytes > 0
        True
    """
    target = None if target is None else gpu_target(target)
    options = {} if target is None else compiler_options(gemm, autotune_results)
    spec = get_remat(remat)
    model, opt = abstract_train_state(workload.config, workload.optimizer)
    model.set_attention(workload.attention)
    graphdef, state = nnx.split((model, opt))
    devices = _devices(workload, target)
    mesh, shardings = None, None
    if workload.devices > 1:
        mesh = make_mesh(workload.mesh_shape, devices=devices)
        shardings = state_shardings(state, mesh)
    elif target is not None:
        shardings = jax.tree.map(lambda _: SingleDeviceSharding(devices[0]), state)
    host = workload.optimizer.offload
    masters = workload.optimizer.offload_master
    if host or masters:
        shardings = offload_shardings(state, shardings, optimizer=host, masters=masters)
    if shardings is not None:
        state = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings
        )
    tokens = jax.ShapeDtypeStruct(
        workload.input_shape,
        jnp.int32,
        sharding=None if mesh or target is None else SingleDeviceSharding(devices[0]),
    )
    step = jit_train_step(graphdef, spec, shardings, mesh, masters=workload.optimizer if masters else None)
    if target is None:
        return step.lower(state, tokens).compile()
    with deviceless():
        return step.lower(state, tokens).compile(options)


@functools.lru_cache(maxsize=128)
def compile_report(
    workload: Workload,
    spec: RematSpec,
    target: GpuTarget | None = None,
    gemm: str = "default",
    autotune_results: str | None = None,
) -> MemoryReport:
    """One device's ``MemoryReport`` of ``compile_step(workload, spec, target=target, ...)``
    (once per process), labelled with the compiler (``measured_on``).

    With ``target=None`` this process must have ``workload.devices`` devices
    (``jaxckpt.plan._sharded`` compiles in a subprocess that has them otherwise).
    """
    compiled = compile_step(workload, spec, target=target, gemm=gemm, autotune_results=autotune_results)
    report = memory_report(compiled, device_stats=False)
    host = workload.optimizer.offload
    masters = workload.optimizer.offload_master
    params, optimizer = state_bytes(workload)
    on_host = (optimizer if host else 0) + (params if masters else 0)
    if on_host and not getattr(compiled.memory_analysis(), "host_argument_size_in_bytes", 0):
        # XLA:CPU (and a deviceless XLA:GPU compile) count host-placed arguments with the device's
        report = dataclasses.replace(
            report,
            argument=report.argument - on_host,
            output=report.output - on_host,
            alias=report.alias - on_host,
            host_argument=report.host_argument + on_host,
        )
    return dataclasses.replace(
        report,
        params=params,
        optimizer=optimizer,
        grads=trainable_bytes(workload),
        measured_on=CPU if target is None else target.measured_on,
    )
