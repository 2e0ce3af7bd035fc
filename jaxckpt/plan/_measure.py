"""``measure``: XLA's own memory figures for a train step, compiled from abstract inputs."""

import dataclasses
import os

import jax

from jaxckpt.plan._compile import compile_report
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
    if autotune_results is not None and target is None:
        raise ValueError("autotune_results are XLA:GPU's: give the GPU target they were dumped for (target=)")
    if target is not None:
        target = compile_target(target)
        if target.platform == "tpu":
            if autotune_results is not None:
                raise ValueError(f"autotune_results are XLA:GPU's; target={target.name!r} is a TPU")
            return compile_report(workload, spec, target)
        if autotune_results is not None:
            return compile_report(workload, spec, target, "default", os.fspath(autotune_results))
        reports = [compile_report(workload, spec, target, gemm) for gemm in GEMM_BACKENDS]
        peaks = sorted(r.peak for r in reports)
        return dataclasses.replace(max(reports, key=lambda r: r.peak), peak_range=(peaks[0], peaks[-1]))
    if workload.devices > len(jax.devices()):
        return compile_in_subprocess(workload, spec)
    return compile_report(workload, spec)
