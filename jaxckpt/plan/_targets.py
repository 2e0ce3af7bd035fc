"""Compile targets: the real XLA:GPU and XLA:TPU compilers, run on a machine without the device.

``TARGETS`` holds both kinds; ``compile_target`` looks one up, ``target_devices`` gives its
compile-only devices and ``deviceless`` is the context a compile for it runs in. The TPU
targets are ``jaxckpt.plan._tpu_targets``'s; the rest of this module is the GPU's.

A target is an XLA GPU target config (``targets/<name>.txtpb``, package data: where each
file comes from is in its header) that the JAX CUDA plugin compiles against without a
device ("deviceless" ahead-of-time compilation). ``compiled.memory_analysis()`` then
gives the GPU compiler's own buffer assignment: what ``plan.measure(..., target=...)``
reports. It needs the ``gpu-aot`` extra (``pip install "jaxckpt[gpu-aot]"``): the
plugin and PJRT wheels of the installed jaxlib's version, ``ptxas`` and cuDNN.

A deviceless compile does not autotune: GEMM tilings (and so their workspaces) are
XLA's defaults, which a real GPU may tune to others (``AUTOTUNE_CAVEAT``).
"""

import atexit
import contextlib
import dataclasses
import functools
import importlib.resources
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from types import MappingProxyType

import jax

from jaxckpt.attention import compiling_for
from jaxckpt.plan._tpu_targets import TPU_TARGETS, TpuTarget, tpu_aot_unavailable, tpu_topology

AUTOTUNE_CAVEAT = (
    "compiled for the GPU without one: XLA:GPU's own buffer assignment, but not autotuned (GEMM "
    "tilings and workspaces are XLA's defaults; a real GPU may pick others)"
)
"""How far a deviceless compile's figures carry to the real GPU (printed with them)."""

CPU = "xla-cpu"
"""``measured_on`` of a figure from XLA:CPU."""

GEMM_BACKENDS: MappingProxyType[str, MappingProxyType] = MappingProxyType(
    {
        "default": MappingProxyType({}),
        "cublas": MappingProxyType({"xla_gpu_enable_triton_gemm": False}),
    }
)
"""How XLA:GPU emits matmuls in a compile (its ``compiler_options``): ``default`` (Triton
GEMMs where XLA's heuristics pick them, untuned tiles, sometimes split-K with float32
temporaries) or ``cublas`` everywhere (with its workspace). Without autotuning neither is
what a real GPU picks for sure, so ``plan.measure`` compiles both and reports the larger."""


def compiler_options(gemm: str = "default", autotune_results: "str | os.PathLike | None" = None) -> dict:
    """XLA:GPU's compile options for ``gemm`` (a ``GEMM_BACKENDS`` key), loading the autotune
    results a real GPU dumped (``--xla_gpu_dump_autotune_results_to``) when given.

    Raises:
        ValueError: for an unknown ``gemm``; FileNotFoundError for a missing results file.

    Example:
        >>> from jaxckpt.plan._targets import compiler_options
        >>> compiler_options("cublas")
        {'xla_gpu_enable_triton_gemm': False}
    """
    if gemm not in GEMM_BACKENDS:
        raise ValueError(f"gemm={gemm!r} is unknown; valid: {', '.join(GEMM_BACKENDS)}")
    options = dict(GEMM_BACKENDS[gemm])
    if autotune_results is not None:
        path = Path(autotune_results)
        if not path.is_file():
            raise FileNotFoundError(f"autotune_results={str(path)!r}: no such file")
        options["xla_gpu_load_autotune_results_from"] = str(path.resolve())
    return options


@functools.cache
def _kernel_cache_dir() -> str:
    """A folder of this process's own, removed when it exits (``kernel_cache_options``)."""
    path = tempfile.mkdtemp(prefix="jaxckpt-gpu-kernels-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def kernel_cache_options(target: str = "any") -> dict:
    """XLA:GPU's kernel cache for the deviceless compiles of this process: a compile reuses the
    kernels (PTX compiled by ``ptxas``) of the earlier ones whose fused computations are the
    same, as the solver's candidates of one model mostly are. The buffer assignment, and so
    every memory figure, is the same with or without it; about a third of a deviceless
    compile's time is ``ptxas``, and the cache spared 30% of the CPU time of the planner's
    GPU tests.

    The file is one process's and one ``target``'s: XLA rewrites it whole after each compile
    (a process that read it while another wrote it would fail to parse it), and its kernels
    are compiled for one GPU architecture. A cache file the user names in ``XLA_FLAGS``
    (``--xla_gpu_kernel_cache_file``) is left alone.

    Example:
        >>> from jaxckpt.plan._targets import kernel_cache_options
        >>> options = kernel_cache_options("h100-80g")
        >>> options == {} or options["xla_gpu_kernel_cache_file"].endswith("h100-80g.bin")
        True
    """
    if "xla_gpu_kernel_cache_file" in os.environ.get("XLA_FLAGS", ""):
        return {}
    return {"xla_gpu_kernel_cache_file": str(Path(_kernel_cache_dir()) / f"{target}.bin")}


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    """One GPU the planner can compile for without having it.

    Attributes:
        name: the key in ``TARGETS`` (also a ``plan.DEVICES`` name).
        sm: the compute capability XLA compiles for.
        description: the GPU as its target config names it.

    Example:
        >>> from jaxckpt import plan
        >>> plan.TARGETS["h200-141g"].sm
        'sm_90a'
    """

    name: str
    sm: str
    description: str

    platform = "gpu"
    caveat = AUTOTUNE_CAVEAT

    @property
    def measured_on(self) -> str:
        """How a figure compiled for this target is labelled: ``"xla-gpu:<name>"``."""
        return f"xla-gpu:{self.name}"

    def config_text(self) -> str:
        """The target config (text-format ``GpuTargetConfigProto``) shipped for this GPU."""
        return importlib.resources.files("jaxckpt.plan").joinpath("targets", f"{self.name}.txtpb").read_text()


Target = GpuTarget | TpuTarget
"""A compile target of either kind."""

GPU_TARGETS: MappingProxyType[str, GpuTarget] = MappingProxyType(
    {
        "h100-80g": GpuTarget("h100-80g", "sm_90a", "NVIDIA H100 80GB HBM3"),
        "h200-141g": GpuTarget("h200-141g", "sm_90a", "NVIDIA H200 141GB HBM3e"),
        "a100-80g": GpuTarget("a100-80g", "sm_80", "NVIDIA A100-SXM4-80GB"),
        "a100-40g": GpuTarget("a100-40g", "sm_80", "NVIDIA A100-SXM4-40GB"),
    }
)
"""Target name -> ``GpuTarget``: the GPUs ``plan.measure(..., target=)`` compiles for."""

TARGETS: MappingProxyType[str, Target] = MappingProxyType({**GPU_TARGETS, **TPU_TARGETS})
"""Target name -> ``GpuTarget`` or ``TpuTarget``: every device ``plan.measure(..., target=)``
compiles for (``tpu-*`` with XLA:TPU, the others with XLA:GPU)."""


def compile_target(name: "str | Target") -> Target:
    """The target called ``name`` (a target passes through); the error lists them.

    Example:
        >>> from jaxckpt import plan
        >>> plan.compile_target("tpu-v5p").measured_on, plan.compile_target("a100-40g").platform
        ('xla-tpu:v5p', 'gpu')
    """
    if isinstance(name, GpuTarget | TpuTarget):
        return name
    if name not in TARGETS:
        raise ValueError(f"target={name!r} is not a compile target; valid targets: {', '.join(TARGETS)}")
    return TARGETS[name]


def gpu_target(name: "str | GpuTarget") -> GpuTarget:
    """The GPU target called ``name`` (a ``GpuTarget`` passes through); the error lists them.

    Example:
        >>> from jaxckpt import plan
        >>> plan.gpu_target("a100-40g").description
        'NVIDIA A100-SXM4-40GB'
    """
    if isinstance(name, GpuTarget):
        return name
    if name not in GPU_TARGETS:
        valid = ", ".join(GPU_TARGETS)
        raise ValueError(f"target={name!r} is not a GPU compile target; valid targets: {valid}")
    return GPU_TARGETS[name]


def aot_unavailable(target: "str | Target") -> str | None:
    """None when this process can compile for ``target``, else why not: the extra it needs
    (``gpu-aot`` or ``tpu-aot``) is missing, or the compiler did not start.

    Example:
        >>> from jaxckpt import plan
        >>> plan.aot_unavailable("tpu-v6e") == plan.tpu_aot_unavailable()
        True
    """
    target = compile_target(target)
    return gpu_aot_unavailable() if target.platform == "gpu" else tpu_aot_unavailable()


def _ptxas() -> str | None:
    """The ``ptxas`` of the ``nvidia-cuda-nvcc-cu12`` wheel (or one on PATH)."""
    spec = importlib.util.find_spec("nvidia.cuda_nvcc")
    for root in spec.submodule_search_locations if spec and spec.submodule_search_locations else ():
        found = Path(root) / "bin" / "ptxas"
        if found.is_file():
            return str(found)
    return shutil.which("ptxas")


def gpu_aot_unavailable() -> str | None:
    """None when this process can compile for GPU targets, else why not (and how to fix it).

    Example:
        >>> from jaxckpt import plan
        >>> reason = plan.gpu_aot_unavailable()
        >>> reason is None or "gpu-aot" in reason
        True
    """
    fix = f'install the extra: pip install "jaxckpt[gpu-aot]" (the CUDA plugin for jaxlib {jax.__version__})'
    if importlib.util.find_spec("jax_plugins.xla_cuda12") is None:
        return f"the JAX CUDA plugin (jax-cuda12-plugin) is not installed; {fix}"
    if _ptxas() is None:
        return f"ptxas (nvidia-cuda-nvcc-cu12) is not installed; {fix}"
    try:
        _topology(TARGETS["h100-80g"], 1)
    except RuntimeError as err:
        return str(err)
    return None


@functools.cache
def _topology(target: GpuTarget, devices: int):
    from jax.experimental import topologies

    try:
        return topologies.get_topology_desc(
            platform="cuda", topology_name="", target_config=target.config_text(), topology=f"1x1x{devices}"
        )
    except (NotImplementedError, jax.errors.JaxRuntimeError, RuntimeError) as err:
        hint = ""
        if "not implemented" in str(err):
            hint = (
                " The CUDA plugin did not start in this process (no GPU driver here): run with "
                "JAX_PLATFORMS=cpu, or JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1."
            )
        raise RuntimeError(
            f"could not make a {target.name} topology of {devices} devices: {err}.{hint}"
        ) from err


def target_devices(target: "str | Target", devices: int = 1) -> list:
    """``devices`` abstract devices of ``target`` (one host), to compile over: GPUs, or
    the devices of a TPU slice of that many (``TpuTarget.topology_name``).

    Arrays are given as ``jax.ShapeDtypeStruct(..., sharding=NamedSharding(Mesh(...)))``
    over them; nothing can be allocated on them.

    Raises:
        RuntimeError: when the ``gpu-aot`` (``tpu-aot``) extra is missing or the compiler
            cannot start.
        ValueError: ``devices`` is not a positive int (for a TPU: not a slice's size).

    Example:
        >>> from jaxckpt import plan
        >>> if plan.gpu_aot_unavailable() is None:
        ...     assert plan.target_devices("h100-80g", 2)[1].device_kind == "NVIDIA H100 80GB HBM3"
        >>> if plan.tpu_aot_unavailable() is None:
        ...     assert plan.target_devices("tpu-v5p", 8)[7].device_kind == "TPU v5"
    """
    target = compile_target(target)
    if not isinstance(devices, int) or devices < 1:
        raise ValueError(f"devices must be a positive int; got {devices!r}")
    if target.platform == "tpu":
        target.slice_shape(devices)  # a bad size is the caller's error, named before libtpu starts
        if importlib.util.find_spec("libtpu") is None:
            raise RuntimeError(tpu_aot_unavailable())
        return list(tpu_topology(target, devices).devices)[:devices]
    if importlib.util.find_spec("jax_plugins.xla_cuda12") is None:
        raise RuntimeError(gpu_aot_unavailable())
    return list(_topology(target, devices).devices)


def _has_nvidia_driver() -> bool:
    if Path("/proc/driver/nvidia").exists():
        return True
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def _has_tpu_chips() -> bool:
    """A TPU host's chips: ``/dev/accel*`` (v4, v5p) or VFIO groups (v5e, v6e)."""
    return any(Path("/dev").glob("accel*")) or any(Path("/dev/vfio").glob("[0-9]*"))


def quiet_plugins_without_devices() -> bool:
    """Leaves out of ``JAX_PLATFORMS`` the accelerator plugins installed here without their
    device, when no platform was chosen: the CUDA plugin without an NVIDIA driver, libtpu
    (the ``tpu-aot`` extra) without TPU chips. The CPU and any present accelerator stay.

    JAX would try each installed plugin in every process: the CUDA plugin prints its failed
    start-up (a traceback), and libtpu looks for chips for about 8 s before JAX falls back.
    A deviceless compile does not need either backend (``target_devices`` starts the
    compilers on their own). ``import jaxckpt`` calls it (so it must come before anything
    starts a JAX backend to take effect); it sets ``JAX_PLATFORMS`` for subprocesses too.

    Returns:
        Whether it chose the platforms.

    Example:
        >>> from jaxckpt import plan
        >>> plan.quiet_plugins_without_devices()  # import jaxckpt did it already
        False
    """
    if os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms:
        return False
    installed = {
        "cuda": importlib.util.find_spec("jax_plugins.xla_cuda12") is not None,
        "tpu": importlib.util.find_spec("libtpu") is not None,
    }
    present = {"cuda": _has_nvidia_driver, "tpu": _has_tpu_chips}
    kept = [name for name, there in installed.items() if there and present[name]()]
    if kept == [name for name, there in installed.items() if there]:
        return False  # every installed plugin has its device (or none is installed)
    platforms = ",".join([*kept, "cpu"])
    os.environ["JAX_PLATFORMS"] = platforms
    jax.config.update("jax_platforms", platforms)
    return True


@contextlib.contextmanager
def deviceless(target: "str | Target" = "h100-80g"):
    """The context of a compile for ``target``: attention traced for its platform
    (``attention.compiling_for``: ``implementation=None`` may pick cuDNN on a GPU, picks
    the Splash kernel on a TPU), and
    JAX's persistent compilation cache kept from writing, since a deviceless executable
    cannot be read back (that needs a client of its platform): caching it only writes an
    entry that warns when the next compile of the same program tries to load it.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        >>> from jaxckpt import plan
        >>> if plan.gpu_aot_unavailable() is None:
        ...     s = NamedSharding(Mesh(plan.target_devices("h100-80g"), ("x",)), P())
        ...     with plan.deviceless():
        ...         c = jax.jit(jnp.sin).lower(jax.ShapeDtypeStruct((8,), jnp.float32, sharding=s)).compile()
    """
    # JAX decides once per process whether it uses the cache, so turning it off may come too
    # late; an entry is only written for a compile slower than the minimum, so none is
    before = {name: getattr(jax.config, name) for name in _NO_CACHE_WRITES}
    try:
        for name, value in _NO_CACHE_WRITES.items():
            jax.config.update(name, value)
        with compiling_for(compile_target(target).platform):
            yield
    finally:
        for name, value in before.items():
            jax.config.update(name, value)


_NO_CACHE_WRITES = {"jax_enable_compilation_cache": False, "jax_persistent_cache_min_compile_time_secs": 1e9}
