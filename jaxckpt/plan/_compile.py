"""XLA's memory figures of a step compiled in this process from abstract inputs: any function
(``compile_fn``, ``fn_report``: what ``plan.measure_fn`` and ``plan.explain`` compile), and the
real train step of a ``Workload`` (``compile_step``, ``compile_report``: what ``plan.measure``
compiles), which is built here and compiled by the same ``compile_fn``.

The step is the one ``jaxckpt.train`` runs, over the state ``train.Trainer`` builds (its
optimizer over ``nn.trainable``, with its loss scaler; with ``optimizer.offload``
the optimizer state in ``pinned_host`` memory). Over ``devices > 1`` it is the FSDP step
of ``jaxckpt train --mesh fsdp=D``: the state given as ``ShapeDtypeStruct``s with the
shardings of ``jaxckpt.train.state_shardings``, the batch split over the devices;
XLA's memory analysis of an SPMD program describes one device. Nothing is allocated.

With a ``target`` (``plan.TARGETS``) the same step is lowered over that device's abstract
devices (``target_devices``) and compiled by XLA:GPU or XLA:TPU without one, under
``plan.deviceless(target)`` (attention traced for its platform; no persistent-cache
writes); for a GPU with the GEMM emitter ``gemm`` or a real GPU's autotune results.

XLA:TPU checks the program against the chip's HBM while compiling. A step that does not
fit is an answer, not a crash: ``compile_report`` returns the bytes the compiler says it
needs, with its message in ``MemoryReport.overflow``. A TPU report's peak is the HBM the
compiler allocates, ``argument + output + temp - alias``, the sum its own HBM check
compares with the chip; ``peak_memory_in_bytes`` is kept beside it
(``MemoryReport.compiler_peak``), not trusted (``jaxckpt.plan._tpu_targets`` says why).

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

from jaxckpt.attention import collective_bytes
from jaxckpt.plan._state import abstract_train_state, state_bytes, trainable_bytes, tree_bytes
from jaxckpt.plan._targets import (
    CPU,
    Target,
    compile_target,
    compiler_options,
    deviceless,
    kernel_cache_options,
    target_devices,
)
from jaxckpt.plan._tpu_targets import hbm_overflow
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


def _devices(workload: Workload, target: Target | None) -> list:
    if target is not None:
        return target_devices(target, workload.devices)
    if workload.devices > len(jax.devices()):
        raise ValueError(
            f"workload.devices={workload.devices} but this process has {len(jax.devices())} devices; "
            "plan.measure compiles over simulated CPU devices in a subprocess, or start this one with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={workload.devices}"
        )
    return jax.devices()[: workload.devices]


def compile_fn(
    step_fn,
    abstract_args: tuple,
    *,
    target: "str | Target | None" = None,
    gemm: str = "default",
    autotune_results: str | None = None,
    options: dict | None = None,
) -> jax.stages.Compiled:
    """Any function compiled from abstract inputs, for XLA:CPU or a GPU/TPU ``target``.

    Args:
        step_fn: a function of ``abstract_args``; a ``jax.jit``-wrapped one keeps its own
            shardings and donations, anything else is wrapped in a plain ``jax.jit``.
        abstract_args: its positional arguments: pytrees of ``jax.ShapeDtypeStruct`` (or
            arrays), with shardings where they have them. For a ``target``, a leaf without a
            sharding of the target's devices is placed on its first device.
        target: None compiles with this process's backend; a ``plan.TARGETS`` name with
            XLA:GPU or XLA:TPU for that device, without one (under ``deviceless``).
        gemm: a GPU target's matmul emitter (``plan.GEMM_BACKENDS``); ignored otherwise.
        autotune_results: a GPU target's autotune results (``compiler_options``).
        options: more XLA compile options (``DebugOptions`` fields), added to the target's.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jaxckpt.plan._compile import compile_fn
        >>> x = jax.ShapeDtypeStruct((37, 40), jnp.float32)
        >>> compile_fn(lambda x: jnp.tanh(x) @ x.T, (x,)).memory_analysis().output_size_in_bytes
        5476
    """
    target = None if target is None else compile_target(target)
    if target is not None:
        abstract_args = _placed_on(abstract_args, target_devices(target)[0])
    return _compile(step_fn, abstract_args, target, gemm, autotune_results, options)


def _compile(
    step_fn, abstract_args: tuple, target: Target | None, gemm, autotune_results, options
) -> jax.stages.Compiled:
    gpu = target is not None and target.platform == "gpu"
    gpu_options = (
        {**compiler_options(gemm, autotune_results), **kernel_cache_options(target.name)} if gpu else {}
    )
    all_options = {**gpu_options, **(options or {})}
    jitted = step_fn if hasattr(step_fn, "lower") else jax.jit(step_fn)
    if target is None:
        return jitted.lower(*abstract_args).compile(all_options or None)
    with deviceless(target):
        return jitted.lower(*abstract_args).compile(all_options)


def _placed_on(abstract_args: tuple, device) -> tuple:
    """``abstract_args`` with each leaf that has no sharding over the target's devices given
    a ``SingleDeviceSharding`` of ``device`` (as ``ShapeDtypeStruct``s: nothing is allocated)."""
    platform = device.platform

    def place(leaf):
        sharding = getattr(leaf, "sharding", None)
        if sharding is not None and all(d.platform == platform for d in sharding.device_set):
            return leaf
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=SingleDeviceSharding(device))

    return jax.tree.map(place, abstract_args)


def compiled_report(compiled: jax.stages.Compiled, target: Target | None = None) -> MemoryReport:
    """The ``MemoryReport`` of a compiled step (no device counters: it never ran), with the
    compiler's FLOPs, ``measured_on`` and, for XLA:TPU, ``compiler_peak``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jaxckpt.plan._compile import compile_fn, compiled_report
        >>> x = jax.ShapeDtypeStruct((37, 40), jnp.float32)
        >>> compiled_report(compile_fn(jnp.sin, (x,))).peak  # argument and output
        11840
    """
    report = dataclasses.replace(memory_report(compiled, device_stats=False), **_cost(compiled))
    if target is not None and target.platform == "tpu":
        peak = int(compiled.memory_analysis().peak_memory_in_bytes)  # not trusted: see _tpu_targets
        report = dataclasses.replace(report, compiler_peak=peak)
    return dataclasses.replace(report, measured_on=_measured_on(target))


def _measured_on(target: Target | None) -> str:
    return CPU if target is None else target.measured_on


def overflow_report(err: BaseException, state: int, **labels) -> MemoryReport | None:
    """XLA:TPU's out-of-HBM compile error as an answer: the bytes it says the step needs, over
    ``state`` (what its total counts first: the arguments), with ``overflow`` set; None for any
    other error."""
    needed = hbm_overflow(err)
    if needed is None:
        return None
    overflow = str(err).splitlines()[0]
    return MemoryReport(state, 0, max(0, needed[0] - state), 0, 0, overflow=overflow, **labels)


def fn_report(
    step_fn,
    abstract_args: tuple,
    target: Target | None = None,
    gemm: str = "default",
    autotune_results: str | None = None,
) -> MemoryReport:
    """The ``MemoryReport`` of ``compile_fn(step_fn, abstract_args, ...)``; a step over a TPU's
    HBM comes back with ``overflow`` set (see the module)."""
    try:
        compiled = compile_fn(
            step_fn, abstract_args, target=target, gemm=gemm, autotune_results=autotune_results
        )
    except jax.errors.JaxRuntimeError as err:
        report = overflow_report(err, tree_bytes(abstract_args), measured_on=_measured_on(target))
        if report is None:
            raise
        return report
    return compiled_report(compiled, target)


def train_step_and_args(
    workload: Workload, remat: "str | RematSpec", target: "str | Target | None" = None
) -> tuple:
    """``(step, (state, tokens))``: the jitted train step ``jaxckpt train`` runs for
    ``workload`` and its abstract arguments (over ``target``'s abstract devices, or this
    process's), as ``compile_fn`` takes them.

    Example:
        >>> from jaxckpt import nn, plan
        >>> from jaxckpt.plan._compile import train_step_and_args
        >>> workload = plan.Workload(nn.TransformerConfig.preset("tiny", n_layers=1), batch=1, seq=16)
        >>> step, (state, tokens) = train_step_and_args(workload, "full")
        >>> tokens.shape
        (1, 1, 17)
    """
    target = None if target is None else compile_target(target)
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
    masters = workload.optimizer if masters else None
    step = jit_train_step(
        graphdef, spec, shardings, mesh, masters=masters, context_parallel=workload.context_parallel
    )
    return step, (state, tokens)


@functools.lru_cache(maxsize=32)
def compile_step(
    workload: Workload,
    remat: "str | RematSpec",
    *,
    target: "str | Target | None" = None,
    gemm: str = "default",
    autotune_results: str | None = None,
) -> jax.stages.Compiled:
    """The train step ``jaxckpt train`` runs for ``workload``, compiled from abstract inputs
    (``train_step_and_args`` compiled by ``compile_fn``, once per process).

    Args:
        workload: the step (``plan.Workload``).
        remat: a preset name or ``RematSpec``.
        target: None compiles with this process's backend (XLA:CPU here); a target
            name (``plan.TARGETS``) compiles with XLA:GPU (the ``gpu-aot`` extra) or
            XLA:TPU (``tpu-*``, the ``tpu-aot`` extra) for that device, without one,
            over ``workload.devices`` of them (a TPU slice of that many).
        gemm: a GPU target's matmul emitter, ``"default"`` or ``"cublas"``
            (``plan.GEMM_BACKENDS``); ignored for XLA:CPU and XLA:TPU.
        autotune_results: a file of autotune results dumped on a real GPU of the target's
            kind (``--xla_gpu_dump_autotune_results_to``), loaded by XLA:GPU.

    Returns:
        The ``jax.stages.Compiled`` step: ``memory_analysis()``, ``as_text()``, ``cost_analysis()``.
        Nothing is allocated, and a GPU target's step cannot run here.

    Raises:
        ValueError: for an unknown target, or more ``workload.devices`` than this
            process has (``target=None``).
        RuntimeError: when a target is asked for without its extra.
        jax.errors.JaxRuntimeError: ``RESOURCE_EXHAUSTED`` when XLA:TPU finds the step
            does not fit the chip's HBM (``compile_report`` makes it an answer).

    Example:
        >>> from jaxckpt import nn, plan
        >>> workload = plan.Workload(nn.TransformerConfig.preset("tiny", n_layers=1), batch=1, seq=16)
        >>> compiled = plan.compile_step(workload, "full")
        >>> compiled.memory_analysis().temp_size_in_bytes > 0
        True
    """
    target = None if target is None else compile_target(target)
    step, args = train_step_and_args(workload, remat, target)  # placed on the target's devices
    return _compile(step, args, target, gemm, autotune_results, None)


@functools.lru_cache(maxsize=128)
def compile_report(
    workload: Workload,
    spec: RematSpec,
    target: Target | None = None,
    gemm: str = "default",
    autotune_results: str | None = None,
) -> MemoryReport:
    """One device's ``MemoryReport`` of ``compile_step(workload, spec, target=target, ...)``
    (once per process), labelled with the compiler (``measured_on``) and the state's sizes.

    With ``target=None`` this process must have ``workload.devices`` devices
    (``jaxckpt.plan._sharded`` compiles in a subprocess that has them otherwise). A TPU
    step over the chip's HBM comes back with ``overflow`` set (see the module).
    """
    params, optimizer = state_bytes(workload)
    labels = dict(params=params, optimizer=optimizer, grads=trainable_bytes(workload))
    try:
        compiled = compile_step(workload, spec, target=target, gemm=gemm, autotune_results=autotune_results)
    except jax.errors.JaxRuntimeError as err:
        # what the compiler's total counts first: the state and the batch
        state = params + optimizer + workload.input_bytes
        report = overflow_report(err, state, measured_on=_measured_on(target), **labels)
        if report is None:
            raise
        return report
    report = compiled_report(compiled, target)
    if workload.devices > 1:  # the step's communication, one device's share
        report = dataclasses.replace(report, collective_bytes=collective_bytes(compiled).total)
    host = workload.optimizer.offload
    masters = workload.optimizer.offload_master
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
    return dataclasses.replace(report, **labels)


def _cost(compiled: jax.stages.Compiled) -> dict:
    """The compiler's FLOPs and bytes accessed of the whole program (``cost_analysis()``),
    None where it has none (a deviceless XLA:GPU compile returns none)."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) and cost else cost  # one dict per program in older jax
    if not cost:
        return {"flops": None, "bytes_accessed": None}
    return {"flops": float(cost.get("flops", 0.0)), "bytes_accessed": float(cost.get("bytes accessed", 0.0))}
