"""Memory figures of a compiled computation, and the device's own counters."""

import dataclasses

import jax


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """XLA's buffer assignment of one compiled computation, in bytes.

    ``peak = argument + output + temp - alias`` (on CPU ``peak_memory_in_bytes``
    leaves temp buffers out, so it is recomputed here). ``device`` holds
    ``Device.memory_stats()`` where the backend has them (GPU, TPU), else None.

    For a train step, ``params``, ``optimizer`` and ``grads`` split the figures by
    tree size (the first two are arguments, the gradients live in ``temp``);
    ``jaxckpt.plan.measure`` fills them, otherwise they are None.

    ``host_argument`` and ``host_temp`` are bytes in host memory (``pinned_host``): state
    placed there, and offloaded activations; they are not in ``peak``. ``measured_on``
    names the compiler the figures come from (``"xla-cpu"``, ``"xla-gpu:h100-80g"``),
    where ``jaxckpt.plan`` knows it; ``peak_range`` the smallest and largest peak of the
    compiles these figures are the largest of (GPU targets: one per GEMM emitter).
    ``flops`` and ``bytes_accessed`` are the compiler's ``cost_analysis()`` of the program
    (where ``jaxckpt.plan`` compiled it; None otherwise): what a roofline estimate of its
    time reads (``jaxckpt.plan.roofline_seconds``). ``collective_bytes`` is what one device
    receives through collectives in one run of a multi-device program (read from its HLO by
    ``jaxckpt.attention.collective_bytes``, loops by their trip counts; None for one device).
    ``compiler_peak`` is ``peak_memory_in_bytes`` where it differs in meaning from ``peak``
    (XLA:TPU: a live-range peak over every memory space, VMEM included, without the
    fragmentation of the temporaries' allocation; see ``jaxckpt.plan._tpu_targets``).
    ``overflow`` is the compiler's out-of-memory error where the program did not compile
    (XLA:TPU checks HBM while compiling): the figures are then the memory it said it
    needs, to its message's precision, not a buffer assignment.

    Example:
        >>> report = MemoryReport(argument=40, output=8, temp=24, alias=8, host_temp=0)
        >>> report.peak, report.activations  # no train-step split: activations unknown
        (64, None)
    """

    argument: int
    output: int
    temp: int
    alias: int
    host_temp: int
    device: dict | None = None
    params: int | None = None
    optimizer: int | None = None
    grads: int | None = None
    host_argument: int = 0
    measured_on: str | None = None
    peak_range: tuple[int, int] | None = None
    overflow: str | None = None
    compiler_peak: int | None = None
    flops: float | None = None
    bytes_accessed: float | None = None
    collective_bytes: int | None = None

    @property
    def activations(self) -> int | None:
        """Temporaries other than the gradients (activations, recompute, workspace)."""
        return None if self.grads is None else max(self.temp - self.grads, 0)

    @property
    def peak(self) -> int:
        """Arguments + outputs + temporaries - aliased (donated) bytes."""
        return self.argument + self.output + self.temp - self.alias

    def to_dict(self) -> dict:
        """Plain dict, with ``peak``."""
        return {**dataclasses.asdict(self), "peak": self.peak, "activations": self.activations}


def memory_report(compiled: jax.stages.Compiled, *, device_stats: bool = True) -> MemoryReport:
    """Reads ``compiled.memory_analysis()`` and the first device's ``memory_stats()``.

    ``device_stats=False`` leaves the live device counters out (for a step that was
    only compiled, never run, they say nothing about it).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> compiled = jax.jit(lambda x: jnp.sin(x) @ x).lower(jnp.ones((64, 64))).compile()
        >>> memory_report(compiled).argument
        16384
    """
    ma = compiled.memory_analysis()
    return MemoryReport(
        argument=int(ma.argument_size_in_bytes),
        output=int(ma.output_size_in_bytes),
        temp=int(ma.temp_size_in_bytes),
        alias=int(ma.alias_size_in_bytes),
        host_temp=int(getattr(ma, "host_temp_size_in_bytes", 0)),
        host_argument=int(getattr(ma, "host_argument_size_in_bytes", 0)),
        device=device_memory_stats() if device_stats else None,
    )


def device_memory_stats(device: jax.Device | None = None) -> dict | None:
    """``device.memory_stats()`` (bytes in use, peak, limit), or None where unsupported (CPU)."""
    device = device or jax.devices()[0]
    try:
        return device.memory_stats()
    except (NotImplementedError, AttributeError, jax.errors.JaxRuntimeError):
        return None
