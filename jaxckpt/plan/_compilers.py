"""What each compiler does to a step's memory beyond the model's own bytes: XLA:GPU's cuBLAS
workspace, XLA:TPU's VMEM scratch (per chip) and the fragmentation of its HBM temporaries.

The analytic model (``_working_set``, ``_analytic``) adds these to what the model holds; the
solver (``_milp``) turns a budget back into live bytes with ``live_temp``. The figures and
how they were measured are in each constant's docstring.
"""

from jaxckpt.plan._targets import Target, compile_target

GEMM_WORKSPACE = 4 * 2**20
"""Bytes of the workspace XLA:GPU gives each cuBLAS matmul (``s8[4194304]`` in the custom
call's result on the sm_80 and sm_90 targets); the calls run one at a time, so a step
holds one. ``measure`` reports the larger peak of Triton's and cuBLAS's GEMMs, and on a
small step that is cuBLAS's, by this workspace."""


def vmem_scratch(target: "str | Target | None") -> int:
    """Bytes of VMEM XLA:TPU's memory-space assignment fills with temporaries on ``target``'s
    chip (``TpuTarget.vmem_scratch``: the core's VMEM less the scoped VMEM; memory space 1,
    ``allocation: size 117440512, color 1, preallocated-temp`` in v5e's buffer assignments);
    temporaries there take no HBM. 0 for other compilers.

    Example:
        >>> vmem_scratch("tpu-v5e") // 2**20, vmem_scratch("tpu-v5p") // 2**20, vmem_scratch("h100-80g")
        (112, 48, 0)
    """
    return compile_target(target).vmem_scratch if on_tpu(target) else 0


TPU_FRAGMENTATION = (1.09, 1.54)
"""XLA:TPU's temporaries' allocation (``temp_size_in_bytes``) over the bytes live at its peak,
without remat and with it: the median of ``temp / (compiler_peak - argument)`` (the
compiler's own live-range peak, without fragmentation) over the v5e rows of
``bench_plan_tpu.py`` (libtpu 0.0.42.1). Without remat: ``tiny`` 1.06, ``small`` 1.11,
``gpt2`` 1.09 (B=8, T=1024). With remat (``full``, ``save_attn``): ``small`` 1.51, 1.56,
``gpt2`` 1.58, 1.55, ``llama3.2-1b`` (B=4, T=2048) ``full`` 1.54, QLoRA ``llama3.1-8b``
(B=1, T=8192) ``full`` 1.51, ``save_attn`` 1.35. The compiler's out-of-memory report names
it: "HLO temp 9.96G (Unpadded 7.85G, 21.1% fragmentation (2.10G))". The buffer assignment
it dumps does not show it: its temp allocation (``llama3.2-1b`` ``full``: 4,397,957,632
bytes) is below ``temp_size_in_bytes`` (6,290,617,344), and so is ``small``'s (``full``,
B=8, T=1024, v5e: a ``preallocated-temp`` of 286,441,984 bytes in HBM and 117,440,512 in
VMEM, for 408,222,720). What fills the difference is not known, only that a remat'd step
(a backward loop that allocates and frees a layer's recomputed buffers) has more of it, and
that it differs by chip for the same program (``temp / (compiler_peak - argument)`` of
``small`` under ``full``: 1.51 on v5e, 1.57 on v6e, 1.38 on v5p)."""


def hbm_temp(live: int, target: "str | Target | None", remat: bool = True) -> int:
    """XLA:TPU's temporaries' allocation in HBM (``temp_size_in_bytes``) for ``live`` bytes of
    temporaries the model holds at the peak (activations and gradients), with or without
    ``remat``: ``live x TPU_FRAGMENTATION``; ``live`` itself for other compilers.

    Example:
        >>> hbm_temp(100, "tpu-v5e"), hbm_temp(100, "tpu-v5e", remat=False), hbm_temp(100, None)
        (154, 109, 100)
    """
    if not on_tpu(target):
        return live
    return round(live * TPU_FRAGMENTATION[bool(remat)])


def live_temp(allocation: int, target: "str | Target | None", remat: bool = True) -> int:
    """The inverse of ``hbm_temp``: the live bytes an allocation of ``allocation`` holds (the
    solver's budget rows).

    Example:
        >>> live_temp(154, "tpu-v5e"), live_temp(154, None)
        (100, 154)
    """
    if not on_tpu(target):
        return allocation
    return int(allocation / TPU_FRAGMENTATION[bool(remat)])


def compiled_by(target: "str | Target | None") -> Target | None:
    """The ``Target`` a figure is predicted for (None: XLA:CPU).

    Example:
        >>> compiled_by("h100-80g").platform, compiled_by(None)
        ('gpu', None)
    """
    return None if target is None else compile_target(target)


def on_tpu(target: "str | Target | None") -> bool:
    """Whether ``target`` is a TPU (``plan.TARGETS``' ``tpu-*``: XLA:TPU's mechanisms).

    Example:
        >>> on_tpu("tpu-v5e"), on_tpu("h100-80g"), on_tpu(None)
        (True, False, False)
    """
    return target is not None and compile_target(target).platform == "tpu"
