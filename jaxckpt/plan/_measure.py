"""``measure_fn``: XLA's own memory figures for any step, compiled from abstract inputs;
``measure``: the same for the train step of a ``Workload`` (built by ``_compile``, then
measured by the same compile and the same GEMM bracketing)."""

import dataclasses
import os
from collections.abc import Callable

import jax

from jaxckpt.plan._compile import compile_report, fn_report
from jaxckpt.plan._sharded import compile_in_subprocess
from jaxckpt.plan._targets import GEMM_BACKENDS, Target, compile_target
from jaxckpt.plan._workload import Workload, require_workload
from jaxckpt.remat import RematSpec
from jaxckpt.remat import get as get_remat
from jaxckpt.train import MemoryReport

CPU_CAVEAT = (
    "measured with XLA:CPU's buffer assignment, a proxy for GPU/NPU: it computes in float32 and keeps "
    "float32 copies of 16-bit buffers, so in bf16 it needs up to twice what XLA:GPU does (measure with "
    "target= for a GPU); an NPU's compiler has not been measured"
)
"""How far XLA:CPU's figures carry to other backends (printed with every measured figure)."""


def measure(
    workload: Workload,
    remat: "str | RematSpec",
    *,
    target: "str | Target | None" = None,
    autotune_results: "str | os.PathLike | None" = None,
) -> MemoryReport:
    """Compiles the real train step from abstract inputs and reads XLA's memory analysis.

    No parameter is ever allocated, so ``llama2-7b`` can be measured on a laptop's CPU.
    See ``CPU_CAVEAT`` for how far the CPU figures carry to other backends.

    Args:
        workload: the step: its input is ``[M, B, T + 1]``. Over ``workload.devices``
            (FSDP, ``jaxckpt train --mesh fsdp=D``) the step is compiled over D devices
            (simulated CPU devices in a subprocess when this process has fewer) and the
            figures are one device's. With ``optimizer.offload`` the optimizer
            state (with ``optimizer.offload_master`` the float32 master weights) is
            compiled in ``pinned_host`` memory and left out of the device's figures
            (``jaxckpt.plan._compile``).
        remat: a preset name or ``RematSpec``.
        target: None measures with XLA:CPU; a GPU target (``plan.TARGETS``, e.g.
            ``"h100-80g"``) with XLA:GPU for that GPU, compiled here without one over
            ``workload.devices`` of them (the ``gpu-aot`` extra; see ``AUTOTUNE_CAVEAT``).
            Without autotuning the GEMM emitter is a guess, so the step is compiled with
            each of ``GEMM_BACKENDS`` and the larger peak is returned, with both in
            ``peak_range``. A TPU target (``"tpu-v5p"``) compiles once with XLA:TPU over a
            slice of ``workload.devices`` chips (the ``tpu-aot`` extra; ``TPU_CAVEAT``); a
            step over the chip's HBM returns what the compiler says it needs, with
            ``overflow`` set, instead of raising.
        autotune_results: a GPU target's autotune results, dumped on a real GPU of its
            kind: compiled once, with them, instead of bracketing the GEMM emitters.

    Returns:
        A ``MemoryReport`` with ``params``, ``optimizer``, ``grads`` and ``measured_on``
        (``"xla-cpu"``, ``"xla-gpu:<target>"`` or ``"xla-tpu:<generation>"``) filled in.

    Raises:
        TypeError: when ``workload`` is not a ``Workload``.
        ValueError: for an unknown remat preset or target, a sequence over ``config.max_len``,
            or ``autotune_results`` without a target.
        RuntimeError: for a target without its extra (``gpu-aot``, ``tpu-aot``).

    Example:
        >>> from jaxckpt import nn, plan
        >>> cfg = nn.TransformerConfig.preset("tiny", n_layers=2)
        >>> report = plan.measure(plan.Workload(cfg, batch=2, seq=64), remat="full")
        >>> report.params == report.grads, report.peak > report.params + report.optimizer
        (True, True)
    """
    require_workload(workload, "measure")
    spec = get_remat(remat)
    if target is None and autotune_results is None and workload.devices > len(jax.devices()):
        return compile_in_subprocess(workload, spec)
    return _bracketed(
        lambda target, gemm, autotune: _compile_report(workload, spec, target, gemm, autotune),
        target,
        autotune_results,
    )


def _compile_report(workload, spec, target, gemm, autotune_results) -> MemoryReport:
    """``compile_report`` called with the arguments the other callers give it, so that its
    ``lru_cache`` shares one compile between them."""
    if autotune_results is not None:
        return compile_report(workload, spec, target, "default", autotune_results)
    if target is None:
        return compile_report(workload, spec)
    if target.platform == "tpu":
        return compile_report(workload, spec, target)
    return compile_report(workload, spec, target, gemm)


def measure_fn(
    step_fn,
    *abstract_args,
    target: "str | Target | None" = None,
    autotune_results: "str | os.PathLike | None" = None,
) -> MemoryReport:
    """Compiles any function from abstract inputs and reads XLA's memory analysis.

    The machinery of ``measure`` for a step of your own: a train step over your model's
    parameters and optimizer state, an inference step, any function. Nothing is allocated.

    Args:
        step_fn: the function; a ``jax.jit``-wrapped one keeps its shardings and donations
            (donate the state to measure the step as it runs), anything else is compiled
            under a plain ``jax.jit``.
        *abstract_args: its arguments: pytrees of ``jax.ShapeDtypeStruct`` (arrays also do),
            with shardings where they have them (``jax.eval_shape`` gives them from real
            initialisers). For a ``target``, a leaf without a sharding over its devices is
            placed on its first device.
        target: None measures with XLA:CPU; a ``plan.TARGETS`` name with XLA:GPU for that
            GPU (both GEMM emitters, the larger peak returned, both in ``peak_range``; see
            ``measure``) or XLA:TPU (a step over the chip's HBM comes back with ``overflow``
            set instead of raising).
        autotune_results: a GPU target's autotune results (see ``measure``).

    Returns:
        A ``MemoryReport`` with ``measured_on`` and the compiler's ``flops`` where it has
        them; ``params``, ``optimizer`` and ``grads`` stay None (this step's state is yours).

    Raises:
        ValueError: for an unknown target, or ``autotune_results`` without a GPU target.
        RuntimeError: for a target without its extra (``gpu-aot``, ``tpu-aot``).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jaxckpt import plan
        >>> w, x = jax.ShapeDtypeStruct((40, 40), jnp.float32), jax.ShapeDtypeStruct((37, 40), jnp.float32)
        >>> report = plan.measure_fn(jax.grad(lambda w, x: jnp.sum(jnp.tanh(x @ w))), w, x)
        >>> report.argument, report.output, report.measured_on
        (12320, 6400, 'xla-cpu')
    """
    if not callable(step_fn):
        raise TypeError(f"measure_fn: step_fn must be a function; got {type(step_fn).__name__}")
    return _bracketed(
        lambda target, gemm, autotune: fn_report(step_fn, abstract_args, target, gemm, autotune),
        target,
        autotune_results,
    )


def _bracketed(
    report_of: "Callable[[Target | None, str, str | None], MemoryReport]",
    target: "str | Target | None",
    autotune_results: "str | os.PathLike | None",
) -> MemoryReport:
    """The report ``report_of(target, gemm, autotune_results)`` gives, for the compiler of
    ``target``: XLA:CPU and XLA:TPU compile once; a GPU target with its autotune results once,
    without them once per ``GEMM_BACKENDS`` emitter, the larger peak kept (``peak_range``)."""
    if autotune_results is not None and target is None:
        raise ValueError("autotune_results are XLA:GPU's: give the GPU target they were dumped for (target=)")
    if target is None:
        return report_of(None, "default", None)
    target = compile_target(target)
    if target.platform == "tpu":
        if autotune_results is not None:
            raise ValueError(f"autotune_results are XLA:GPU's; target={target.name!r} is a TPU")
        return report_of(target, "default", None)
    if autotune_results is not None:
        return report_of(target, "default", os.fspath(autotune_results))
    reports = [report_of(target, gemm, None) for gemm in GEMM_BACKENDS]
    peaks = sorted(r.peak for r in reports)
    return dataclasses.replace(max(reports, key=lambda r: r.peak), peak_range=(peaks[0], peaks[-1]))
