"""Test configuration: strict JAX numerics, hardware auto-skips, a hypothesis profile.

Markers are declared in ``pyproject.toml``. Tests marked ``gpu``, ``gpu_compile``
(the ``gpu-aot`` extra's deviceless XLA:GPU compiler), ``npu`` or ``torch`` skip
themselves, with the reason, when that hardware or package is absent; nothing is ever
removed with ``--ignore``.
"""

import os
import sys
from pathlib import Path

# The shared helpers of the suite (cases, tolerances, harnesses) live in tests/_support/.
sys.path.insert(0, str(Path(__file__).parent / "_support"))

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
# XLA's persistent compilation cache, shared by the xdist workers and the subprocesses the
# tests start: many tests compile the same train step, and XLA:CPU takes seconds for each.
# Its key is the program, the compile options and the jaxlib version, so a changed program
# is compiled afresh. `make clean` removes it. Every program is kept, however quick its compile:
# the suite compiles about 6500, most of them small (eager ops, model init), and a warm
# `make test-fast` read them back in a third of the time it took to compile them
# (JAXCKPT_COMPILE_PROFILE: tests/nn and tests/train, 41 s -> 13 s of compile).
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR", str(Path(__file__).parent.parent / ".pytest_cache" / "jax")
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# Three XLA:CPU compile options cut the time of every compile, which is most of the suite's time:
# - the backend (LLVM) optimisation level 0: about 40% less time per compile of a train step;
# - the legacy fusion code generator (xla_cpu_use_fusion_emitters=false): about half of what is
#   left (a one-layer train step: 3.6 s -> 1.3 s);
# - one LLVM module per program (xla_cpu_parallel_codegen_split_count=1) instead of pieces
#   compiled on threads, which only contend with the other xdist worker on 2 cores: 15% less
#   CPU per compile (8 train steps, tiny and small under 4 presets: 12.0 -> 10.3 CPU-s), the
#   same peaks to the byte.
# The HLO passes are the same. The buffer assignment is the same but for one small buffer: each
# program's temp is 192 bytes more (checked on 24 train steps, every preset and optimizer).
# Results differ by float rounding (FMA contraction, fusion), and comparisons run under the same
# flags, with one exception: the legacy generator fuses a recomputed value differently from a
# saved one, so remat is bit-exact only under XLA's defaults. The test of that claim
# (test_families.py) runs in a child process with the default generator. Benchmarks and users
# keep XLA's defaults.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()
if "xla_cpu_use_fusion_emitters" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ['XLA_FLAGS']} --xla_cpu_use_fusion_emitters=false"
if "xla_cpu_parallel_codegen_split_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ['XLA_FLAGS']} --xla_cpu_parallel_codegen_split_count=1"

import gc
import importlib.util

import jax
import pytest
from gc_tuning import tune_gc
from hypothesis import HealthCheck, Phase, settings

# import jaxckpt chooses the CPU platform with the gpu-aot extra on a machine without a GPU
# driver (no CUDA plugin start-up traceback in every test process and the subprocesses).
from jaxckpt.plan import gpu_aot_unavailable, tpu_aot_unavailable

jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update(
    "jax_persistent_cache_min_compile_time_secs",
    float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]),
)

tune_gc()  # gc_tuning.py: about a fifth of each trace was the garbage collector's

# House style: an implicit rank promotion is a bug (it hides axis mix-ups).
jax.config.update("jax_numpy_rank_promotion", "raise")
# Eight CPU devices in every test process, so that sharded tests (FSDP, shard_map) run
# here instead of in a subprocess; unsharded code runs on the first one.
jax.config.update("jax_num_cpu_devices", 8)
# Deliberately NOT set: jax_enable_checks (too slow) and
# jax_default_matmul_precision="highest" (kernels must pass at default precision).

# Default (CI): 25 examples and no shrinking. Every example compiles a kernel (~3 s), so
# shrinking a failure could run for the 5 minutes hypothesis allows; the failing
# Case prints in full anyway. HYPOTHESIS_PROFILE=thorough runs 300 examples and shrinks.
settings.register_profile(
    "jaxckpt",
    deadline=None,  # the first example of each shape pays for XLA compilation
    max_examples=25,
    phases=(Phase.explicit, Phase.reuse, Phase.generate),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.register_profile(
    "thorough",
    parent=settings.get_profile("jaxckpt"),
    max_examples=300,
    phases=tuple(Phase),
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "jaxckpt"))


@pytest.fixture(autouse=True)
def strict_dtype_promotion():
    """An implicit dtype promotion (bf16 + f32 silently computing in f32) is a bug too: every
    test in tests/ runs under strict promotion. The library runs the third-party code that
    needs standard promotion (optax's update, jax.nn's attention) under
    ``jax.numpy_dtype_promotion("standard")``. Doctests, which are user examples, run with
    JAX's defaults."""
    with jax.numpy_dtype_promotion("strict"):
        yield


@pytest.fixture(autouse=True, scope="module")
def release_compiled_programs():
    """Each xdist worker runs for the whole suite: without this, every compiled program and
    traced function of every module stays cached in it, and a worker grew to about 7 GB by
    the end (two of them, beside the training subprocesses some tests start, on a 24 GB
    machine). When a module ends with the worker over 5 GiB resident
    (``JAXCKPT_TEST_CLEAR_ABOVE_GIB``), the programs are dropped; the next module that needs
    one reads it from the persistent compilation cache. Below that they stay, so the next
    module does not trace and look up again the model inits and eager ops they share: a warm
    ``make test-fast`` took 184 s of pytest at 2.5 GiB and 174 s at 5."""
    yield
    if _resident_gib() > float(os.environ.get("JAXCKPT_TEST_CLEAR_ABOVE_GIB", "5")):
        jax.clear_caches()
        gc.collect()


def _resident_gib() -> float:
    """This process's resident memory in GiB (Linux; 0 where /proc is absent)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except OSError:
        return 0.0
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**30


def pytest_addoption(parser):
    parser.addoption(
        "--grid",
        action="store_true",
        help="also run the full cross products of the grids (the tests marked grid; "
        "JAXCKPT_FULL_GRID=1 does the same)",
    )


def _full_grid(config) -> bool:
    return config.getoption("--grid", default=False) or os.environ.get("JAXCKPT_FULL_GRID") == "1"


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "grid: a case of a grid's full cross product beyond its covering design; run only with "
        "--grid or JAXCKPT_FULL_GRID=1 (docs/contributing.md)",
    )
    # JAXCKPT_COMPILE_PROFILE=<dir>: trace, lowering and compile time per test (compile_profile.py).
    if os.environ.get("JAXCKPT_COMPILE_PROFILE"):
        from compile_profile import CompileProfile

        config.pluginmanager.register(
            CompileProfile(os.environ["JAXCKPT_COMPILE_PROFILE"]), "compile_profile"
        )


def _torch_missing() -> str | None:
    try:
        import torch  # noqa: F401
    except Exception as e:  # ImportError, or a broken install raising anything else
        return f"PyTorch is not importable ({type(e).__name__}: {e})"
    return None


def _gpu_missing() -> str | None:
    backend = jax.default_backend()
    return None if backend in ("gpu", "cuda", "rocm") else f"needs a GPU backend; JAX runs on {backend!r}"


# The two deviceless compilers are probed by whether they are installed, without starting them:
# a started CUDA plugin holds about 250 MiB in the process and libtpu about 100 MiB more, which
# every worker would carry from collection on, nearer the line where it drops its compiled
# programs. A worker starts them at its first test that compiles for such a target.
def _gpu_compiler_missing() -> str | None:
    installed = all(importlib.util.find_spec(name) for name in ("jax_plugins.xla_cuda12", "nvidia.cuda_nvcc"))
    return None if installed else gpu_aot_unavailable()


def _tpu_compiler_missing() -> str | None:
    return None if importlib.util.find_spec("libtpu") else tpu_aot_unavailable()


def _npu_missing() -> str | None:
    return None if importlib.util.find_spec("torch_npu") else "needs torch_npu (an Ascend NPU)"


_PROBES = {
    "gpu": _gpu_missing,
    "gpu_compile": _gpu_compiler_missing,
    "tpu_compile": _tpu_compiler_missing,
    "npu": _npu_missing,
    "torch": _torch_missing,
}


def pytest_collection_modifyitems(config, items):
    # The grids' cases beyond their covering designs run with --grid only (deselected, not
    # skipped: the run lists none of them).
    if not _full_grid(config):
        beyond = [item for item in items if item.get_closest_marker("grid")]
        if beyond:
            config.hook.pytest_deselected(items=beyond)
            items[:] = [item for item in items if not item.get_closest_marker("grid")]
    reasons: dict[str, str | None] = {}  # probe each marker once, only if a test uses it
    for item in items:
        for marker, probe in _PROBES.items():
            if item.get_closest_marker(marker) is None:
                continue
            if marker not in reasons:
                reasons[marker] = probe()
            if reasons[marker] is not None:
                item.add_marker(pytest.mark.skip(reason=reasons[marker]))
    # xdist hands tests out in this order. The files with `slow` tests go first, so that the
    # longest tests start early and the run ends on many short tests shared by both workers, not
    # on one long test while the other worker idles. A file's tests stay in their order and
    # together (the sort is stable), so its module fixtures are still built once per worker.
    files_with_slow_tests = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in files_with_slow_tests)
