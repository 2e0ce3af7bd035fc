"""TPU compile targets: the real XLA:TPU compiler (libtpu), run on a machine without a TPU.

``jax.experimental.topologies.get_topology_desc(platform="tpu", ...)`` gives compile-only
devices of a TPU slice; a program lowered over them is compiled by XLA:TPU as it would be
on the chips (its tiled layouts, its memory-space assignment, its fusion, and its HBM
check: a program that does not fit fails to compile with ``RESOURCE_EXHAUSTED``). It
needs the ``tpu-aot`` extra (``pip install "jaxckpt[tpu-aot]"``: ``jax[tpu]``, which
pins the ``libtpu`` of the installed jaxlib). This is how MaxText's ``train_compile.py``
compiles for a slice on a CPU host. Nothing compiled here runs on a TPU.

Which figure the planner trusts (measured with libtpu 0.0.42.1, from the buffer
assignment and memory-usage report that ``--xla_dump_to`` writes, and from the compiler's
out-of-memory reports):

* ``temp_size_in_bytes`` is the HBM temporaries' allocation (memory space 0), its
  fragmentation included. XLA:TPU's memory-space assignment moves temporaries that fit
  into the core's VMEM (memory space 1: 128 MiB on v5e and v6e), and those are rightly
  left out: they use no HBM. That is why it "came back 0" for a ``tanh(a @ b) @ b`` of
  4096² float32 on v5e: the dump shows its 96 MiB of temporaries all in VMEM.
* ``peak_memory_in_bytes`` is something else: a live-range peak summed over the memory
  spaces, VMEM included, without the allocation's fragmentation. On that matmul it was
  the HBM's 201,327,104 bytes plus VMEM's 100,663,296 (less a 512-byte tuple table); on
  the QLoRA ``llama3.1-8b`` step at T=8192 under ``full`` remat it was 10.12 GiB where the
  HBM holds 5.77 GiB of arguments and a 6.59 GiB temporary allocation (12.36 GiB).
* The compiler's own HBM check adds the arguments and the "program" (the temporary
  allocation, with its fragmentation, and the overlays) and compares them with the chip's
  HBM less the runtime's reserve: its report for a step 6 MiB over read "Used 15.75G of
  15.75G hbm ... reserved 258.00M, program 9.99G, arguments 5.77G ... HLO temp 9.96G
  (Unpadded 7.85G ... 21.1% fragmentation (2.10G))".

So the planner trusts ``argument + output + temp - alias`` (``MemoryReport.peak``, as on
every backend): the bytes that decide whether the step compiles. ``peak_memory_in_bytes``
is kept as ``MemoryReport.compiler_peak``. The limit is what the out-of-memory error names
as available (15.75 GiB of v5e's 16: ``plan.DEVICES``). Over it, compiling fails with
``RESOURCE_EXHAUSTED`` in one of two forms (``hbm_overflow``), which ``plan.measure``
turns into an answer (``MemoryReport.overflow``), not a crash.
"""

import dataclasses
import functools
import importlib.util
import math
import os
import re

import jax

from jaxckpt._sizes import GiB

MiB = 2**20

TPU_CAVEAT = (
    "compiled for the TPU without one: XLA:TPU's own buffer assignment (libtpu), never run on a chip; "
    "the peak is the HBM it allocates (arguments + outputs + temporaries - aliased), as its own HBM "
    "check counts it"
)
"""How far a deviceless TPU compile's figures carry to the real chip (printed with them)."""


@dataclasses.dataclass(frozen=True)
class TpuTarget:
    """One TPU generation the planner can compile for without having it.

    Attributes:
        name: the key in ``plan.TARGETS`` (also a ``plan.DEVICES`` name), e.g. ``"tpu-v5e"``.
        generation: the short name in ``measured_on`` and in XLA's topology names (``"v5e"``).
        device_kind: what JAX calls the device (``"TPU v5 lite"``).
        torus: the slice's dimensions (2 for v5e and v6e, 3 for v4 and v5p).
        cores_per_chip: devices XLA:TPU's compile-only topology gives per chip (2 on v4,
            whose two TensorCores are separate devices there, each with half the HBM).
        vmem: bytes of VMEM a TensorCore has (JAX's own target description,
            ``jax.experimental.pallas.tpu.get_tpu_info_for_chip(...).vmem_capacity_bytes``:
            128 MiB on v5e and v6e, 64 MiB on v5p, 16 MiB on v4).
        scoped_vmem: bytes of that VMEM XLA:TPU keeps for what each fusion and kernel
            allocates while it runs (its default scoped VMEM limit, libtpu's
            ``--xla_tpu_scoped_vmem_limit_kib=-1``: 16 MiB, 32 MiB on v6e); the rest is the
            memory-space assignment's (``vmem_scratch``).

    Example:
        >>> from jaxckpt import plan
        >>> plan.TARGETS["tpu-v5e"].measured_on, plan.TARGETS["tpu-v5e"].topology_name(8)
        ('xla-tpu:v5e', 'v5e:2x4')
    """

    name: str
    generation: str
    device_kind: str
    torus: int
    vmem: int
    scoped_vmem: int = 16 * MiB
    cores_per_chip: int = 1

    platform = "tpu"
    caveat = TPU_CAVEAT

    @property
    def vmem_scratch(self) -> int:
        """Bytes of VMEM XLA:TPU's memory-space assignment may fill with the program's
        temporaries (memory space 1, ``preallocated-temp``), which then take no HBM: the
        core's VMEM less the scoped VMEM. The buffer assignments of the bf16 ``small`` step
        (B=8, T=1024, ``full``) fill 112 of v5e's 112 MiB, 94.6 of v6e's 96 and 46.8 of
        v5p's 48 (libtpu 0.0.42.1).

        Example:
            >>> from jaxckpt import plan
            >>> [plan.TARGETS[t].vmem_scratch // 2**20 for t in ("tpu-v5e", "tpu-v6e", "tpu-v5p")]
            [112, 96, 48]
        """
        return self.vmem - self.scoped_vmem

    @property
    def measured_on(self) -> str:
        """How a figure compiled for this target is labelled: ``"xla-tpu:<generation>"``."""
        return f"xla-tpu:{self.generation}"

    def slice_shape(self, devices: int) -> tuple[int, ...]:
        """The chips of a slice of ``devices`` devices, as XLA's topology names them.

        On v4 a device is a TensorCore: one device is one core of a chip.

        Raises:
            ValueError: unless ``devices`` is a power of two (a slice's shape).
        """
        if not isinstance(devices, int) or devices < 1 or devices & (devices - 1):
            raise ValueError(f"devices={devices!r}: a {self.name} slice has a power of two of devices")
        chips = max(1, devices // self.cores_per_chip)
        dims = [1] * self.torus
        for i in range(int(math.log2(chips))):  # doubled in turn: 2x4 for 8 chips of v5e, 2x2x2 of v5p
            dims[(i + 1) % 2 if self.torus == 2 else i % self.torus] *= 2
        return tuple(dims)

    def topology_name(self, devices: int) -> str:
        """XLA's name of the slice of ``devices`` devices (``"v5p:2x2x2"`` for 8)."""
        return f"{self.generation}:{'x'.join(map(str, self.slice_shape(devices)))}"


TPU_TARGETS: dict[str, TpuTarget] = {
    "tpu-v5e": TpuTarget("tpu-v5e", "v5e", "TPU v5 lite", torus=2, vmem=128 * MiB),
    "tpu-v5p": TpuTarget("tpu-v5p", "v5p", "TPU v5", torus=3, vmem=64 * MiB),
    "tpu-v6e": TpuTarget("tpu-v6e", "v6e", "TPU v6 lite", torus=2, vmem=128 * MiB, scoped_vmem=32 * MiB),
    "tpu-v4": TpuTarget("tpu-v4", "v4", "TPU v4", torus=3, vmem=16 * MiB, cores_per_chip=2),
}
"""Target name -> ``TpuTarget`` (merged into ``plan.TARGETS``)."""


def tpu_aot_unavailable() -> str | None:
    """None when this process can compile for TPU targets, else why not (and how to fix it).

    Example:
        >>> from jaxckpt import plan
        >>> reason = plan.tpu_aot_unavailable()
        >>> reason is None or "tpu-aot" in reason
        True
    """
    if importlib.util.find_spec("libtpu") is None:
        return (
            "libtpu (the XLA:TPU compiler) is not installed; install the extra: "
            f'pip install "jaxckpt[tpu-aot]" (jax[tpu]=={jax.__version__})'
        )
    try:
        tpu_topology(TPU_TARGETS["tpu-v5e"], 1)
    except RuntimeError as err:
        return str(err)
    return None


@functools.cache
def tpu_topology(target: TpuTarget, devices: int):
    """The compile-only topology of ``devices`` devices of ``target``, on one host.

    libtpu reads the TPU host's environment when it starts; on a machine that is not a TPU
    host it would print warnings for what is missing, so the defaults of a one-host slice
    are set first (``TPU_WORKER_HOSTNAMES=localhost`` and the accelerator type). libtpu also
    takes a lock file that lets one process on the machine have the chips; a compile-only
    topology has none, so where this process runs no TPU backend the lock is skipped
    (``ALLOW_MULTIPLE_LIBTPU_LOAD=1``), else a second process, such as a second test
    worker, could not compile for a TPU at the same time.
    """
    from jax.experimental import topologies

    shape = target.slice_shape(devices)
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-1")  # any valid type; the topology is named
    if jax.default_backend() != "tpu":
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        return topologies.get_topology_desc(
            platform="tpu",
            topology_name=target.topology_name(devices),
            chips_per_host_bounds=(*shape, 1)[:3] if len(shape) == 2 else shape,
        )
    except (jax.errors.JaxRuntimeError, RuntimeError, ValueError) as err:
        raise RuntimeError(f"could not make a {target.name} topology of {devices} devices: {err}") from err


_SIZE = r"([\d.]+)([KMGT]?)"
_TOTAL_OVER = re.compile(rf"HLO temporaries \({_SIZE}\) exceeds available HBM \({_SIZE}\)")
"""Over before buffer assignment: the program's total (arguments included) against the HBM."""
_EXCEEDED = re.compile(rf"Used {_SIZE} of {_SIZE} hbm\. Exceeded hbm capacity by {_SIZE}")
"""Over after memory-space assignment: the HBM used, the HBM there is, and the excess."""
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": GiB, "T": 2**40}


def _bytes(number: str, unit: str) -> int:
    return int(float(number) * _UNITS[unit])


def hbm_overflow(err: BaseException) -> tuple[int, int] | None:
    """``(needed, available)`` bytes when ``err`` is XLA:TPU's out-of-HBM compile error
    (to the message's 2 decimals), else None. Both are the program's bytes (arguments,
    outputs, temporaries), the runtime's reserve left out: comparable with
    ``peak_memory_in_bytes`` and with the usable HBM of ``plan.DEVICES``.

    XLA:TPU says it in one of two ways: before buffer assignment, when the sum is over
    (``the total memory required for HLO temporaries (22.50G) exceeds available HBM
    (15.75G)``), or after memory-space assignment, with its report (``Used 15.75G of 15.75G
    hbm. Exceeded hbm capacity by 6.14M.``, then the reserve, program and arguments, and the
    fragmentation of the temporaries).

    Example:
        >>> err = RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory "
        ...                    "required for HLO temporaries (22.50G) exceeds available HBM (15.75G).")
        >>> [round(b / 2**30, 2) for b in hbm_overflow(err)]
        [22.5, 15.75]
        >>> err = RuntimeError("RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: ... Used 15.75G of "
        ...                    "15.75G hbm. Exceeded hbm capacity by 512.00M.")
        >>> [round(b / 2**30, 2) for b in hbm_overflow(err)]
        [16.25, 15.75]
    """
    text = str(err)
    if "RESOURCE_EXHAUSTED" not in text:
        return None
    if found := _TOTAL_OVER.search(text):
        need, need_unit, have, have_unit = found.groups()
        return _bytes(need, need_unit), _bytes(have, have_unit)
    if found := _EXCEEDED.search(text):
        _, _, have, have_unit, over, over_unit = found.groups()
        return _bytes(have, have_unit) + _bytes(over, over_unit), _bytes(have, have_unit)
    return None
