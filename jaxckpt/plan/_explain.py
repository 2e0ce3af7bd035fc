"""``explain``: where a compiled step's peak comes from, from XLA's own buffer assignment.

The step is compiled as ``measure_fn`` compiles it, with XLA's dump of its buffer assignment
(``_buffer_assignment``). Each program point of the schedule holds:

- the allocations the runtime holds for the whole run: the arguments (donated ones share
  their allocation with the output that replaces them) and the outputs of their own;
- the temporaries live there, each a value of the one ``preallocated-temp`` block, counted
  by its own bytes (values that share bytes, a loop's carried value and the loop body's
  parameter, once).

The timeline is their sum at each point. Its maximum is a little below the compiler's peak
(``memory_analysis()``: the temp block's size, where the heap's packing leaves gaps): on
jaxckpt's own tiny Transformer, 99.0% of it with ``full`` remat and 99.2% with ``minimal``
on XLA:CPU (``tests/plan/test_explain.py`` holds it within 2%).

Every buffer gets a category (``_buffer_categories``): parameters, optimizer state,
inputs, arguments, gradients, residuals by ``checkpoint_name`` tag, temporaries by op, outputs.
"""

import dataclasses
import tempfile
from collections import Counter

import numpy as np

from jaxckpt._sizes import format_bytes
from jaxckpt.plan._buffer_assignment import BufferAssignment, dump_options, no_cache_writes, read_dump
from jaxckpt.plan._buffer_categories import KINDS, BufferNamer, kind_of
from jaxckpt.plan._compile import compile_fn, compiled_report, train_step_and_args
from jaxckpt.plan._tag_sites import tag_sites
from jaxckpt.plan._targets import Target, compile_target
from jaxckpt.plan._workload import Workload
from jaxckpt.remat import RematSpec


@dataclasses.dataclass(frozen=True)
class Buffer:
    """One buffer live at the peak: its ``bytes``, ``category`` (and its ``kind``, ``KINDS``),
    ``name`` (a tag, an op, or an argument's path), the HLO value (``instruction{index}``), its
    shape, its Python ``source`` line (``file:line``) and its live range over the schedule.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jaxckpt import plan
        >>> x = jax.ShapeDtypeStruct((37, 40), jnp.float32)
        >>> largest = plan.explain(lambda x: jnp.tanh(x) @ x.T, x).buffers[0]
        >>> largest.kind, largest.bytes
        ('inputs', 5920)
    """

    bytes: int
    category: str
    name: str
    hlo: str
    shape: str
    source: str
    live: tuple[int, int]

    @property
    def kind(self) -> str:
        return kind_of(self.category)


@dataclasses.dataclass(frozen=True)
class Explanation:
    """Where a compiled step's memory goes (``explain``).

    ``peak_bytes`` is the compiler's peak (``MemoryReport.peak``); ``timeline`` the live
    bytes at each program point of the schedule, in order (``program_points`` names each
    point's instruction); ``peak_index`` the point where the timeline is highest;
    ``at_peak`` category -> bytes live there, largest first; ``buffers`` those bytes
    buffer by buffer, largest first; ``by_kind`` kind -> the timeline's share of it.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jaxckpt import plan
        >>> x = jax.ShapeDtypeStruct((37, 40), jnp.float32)
        >>> why = plan.explain(lambda x: jnp.tanh(x) @ x.T, x)
        >>> why.peak_bytes, why.timeline_peak
        (17316, 17316)
        >>> why.at_peak
        {'inputs': 5920, 'temporary: tanh': 5920, 'outputs': 5476}
    """

    peak_bytes: int
    measured_on: str
    timeline: tuple[int, ...]
    peak_index: int
    at_peak: dict
    buffers: tuple[Buffer, ...]
    by_kind: dict
    program_points: tuple[str, ...]
    largest_at: tuple[str, ...] = ()
    """At each program point, its three largest live buffers other than the arguments."""

    @property
    def fragmentation(self) -> int:
        """``peak_bytes`` less the timeline's maximum: what the compiler's packing of the
        temporaries leaves unused at the peak (gaps between buffers, alignment)."""
        return self.peak_bytes - self.timeline_peak

    @property
    def timeline_peak(self) -> int:
        """The timeline's maximum (within 2% of ``peak_bytes`` on the steps tested)."""
        return self.timeline[self.peak_index]

    @property
    def attributed(self) -> float:
        """The fraction of ``peak_bytes`` that ``at_peak`` names."""
        return sum(self.at_peak.values()) / self.peak_bytes if self.peak_bytes else 1.0

    def to_dict(self, buffers: int = 50) -> dict:
        """JSON-able: every field, the ``buffers`` largest buffers at the peak.

        Example:
            >>> import jax, jax.numpy as jnp, json
            >>> from jaxckpt import plan
            >>> x = jax.ShapeDtypeStruct((37, 40), jnp.float32)
            >>> d = plan.explain(lambda x: jnp.tanh(x) @ x.T, x).to_dict()
            >>> sorted(d)[:4], json.loads(json.dumps(d))["peak_bytes"] == d["peak_bytes"]
            (['at_peak', 'attributed', 'buffers', 'by_kind'], True)
        """
        return {
            "peak_bytes": self.peak_bytes,
            "timeline_peak": self.timeline_peak,
            "attributed": self.attributed,
            "measured_on": self.measured_on,
            "peak_index": self.peak_index,
            "peak_point": self.program_points[self.peak_index] if self.program_points else None,
            "at_peak": dict(self.at_peak),
            "buffers": [{**dataclasses.asdict(b), "kind": b.kind} for b in self.buffers[:buffers]],
            "timeline": list(self.timeline),
            "by_kind": {k: list(v) for k, v in self.by_kind.items()},
            "program_points": list(self.program_points),
            "largest_at": list(self.largest_at),
            "fragmentation": self.fragmentation,
        }

    def top(self, n: int = 10) -> list[dict]:
        """The ``n`` largest categories at the peak: ``category``, ``bytes``, its share of the
        peak, its largest buffer and that buffer's source line (the ``--explain`` table's rows).

        Example:
            >>> import jax, jax.numpy as jnp
            >>> from jaxckpt import plan
            >>> x = jax.ShapeDtypeStruct((37, 40), jnp.float32)
            >>> plan.explain(lambda x: jnp.tanh(x) @ x.T, x).top(1)[0]["category"]
            'inputs'
        """
        rows = []
        for category, size in list(self.at_peak.items())[:n]:
            largest = next(b for b in self.buffers if b.category == category)
            rows.append(
                dict(
                    category=category,
                    bytes=size,
                    share=size / self.peak_bytes if self.peak_bytes else 0.0,
                    buffers=sum(b.category == category for b in self.buffers),
                    largest=f"{largest.name if largest.kind in KINDS[:4] else largest.hlo} {largest.shape}",
                    source=largest.source,
                )
            )
        return rows

    def describe(self) -> str:
        """One line: the peak, the timeline's maximum, and how much of it is named.

        Example:
            >>> import jax, jax.numpy as jnp
            >>> from jaxckpt import plan
            >>> x = jax.ShapeDtypeStruct((37, 40), jnp.float32)
            >>> plan.explain(jnp.sin, x).describe().split(";")[0]
            'peak 11.56 KiB (xla-cpu)'
        """
        return (
            f"peak {format_bytes(self.peak_bytes)} ({self.measured_on}); the timeline's maximum "
            f"{format_bytes(self.timeline_peak)} at point {self.peak_index} of {len(self.timeline)}, "
            f"{self.attributed:.1%} of the peak attributed"
        )


def explain(
    step_fn,
    *abstract_args,
    target: "str | Target | None" = None,
    arguments: "dict[str, str] | None" = None,
) -> Explanation:
    """Where the peak of ``step_fn`` compiled for ``abstract_args`` comes from.

    Compiles as ``measure_fn`` does (a GPU target with its default GEMM emitter) and reads
    XLA's buffer assignment: the live bytes at each program point, and every buffer at the
    highest one by category (see the module: arguments, gradients, residuals by their
    ``checkpoint_name`` tag, temporaries by op).

    Args:
        step_fn: the function (a ``jax.jit``-wrapped one keeps its shardings and donations:
            donate the state to see the step as it runs).
        *abstract_args: its arguments, ``jax.ShapeDtypeStruct`` pytrees (see ``measure_fn``).
        target: None for XLA:CPU, or a GPU ``plan.TARGETS`` name (XLA:TPU's buffer
            assignment is in memory spaces this does not read: a TPU target is refused).
        arguments: the category of each argument, by its name in ``step_fn``'s signature
            (``{"params": "parameters", "opt_state": "optimizer state", "batch": "inputs"}``);
            an argument left out is categorised by its path (see the module).

    Returns:
        An ``Explanation``.

    Raises:
        ValueError: for a TPU target, or a category in ``arguments`` that is not one of
            ``KINDS``' argument kinds.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jaxckpt import plan
        >>> w, x = jax.ShapeDtypeStruct((40, 40), jnp.float32), jax.ShapeDtypeStruct((37, 40), jnp.float32)
        >>> grad = jax.grad(lambda w, x: jnp.sum(jnp.tanh(x @ w) @ w.T))
        >>> why = plan.explain(grad, w, x)
        >>> why.peak_bytes == plan.measure_fn(grad, w, x).peak
        True
        >>> why.attributed > 0.8, len(why.timeline) > 5
        (True, True)
    """
    target = None if target is None else compile_target(target)
    if target is not None and target.platform == "tpu":
        raise ValueError(
            f"explain: target={target.name!r} is a TPU; XLA:TPU's buffer assignment (HBM and VMEM "
            "memory spaces) is not read here: explain with XLA:CPU or a GPU target"
        )
    argument_kinds = dict(arguments or {})
    for name, kind in argument_kinds.items():
        if kind not in KINDS[:4]:
            raise ValueError(f"explain: arguments[{name!r}]={kind!r} is not one of {', '.join(KINDS[:4])}")
    with tempfile.TemporaryDirectory(prefix="jaxckpt-explain-") as folder:
        with no_cache_writes():
            compiled = compile_fn(step_fn, abstract_args, target=target, options=dump_options(folder))
        assignment = read_dump(folder)
    report = compiled_report(compiled, target)
    sites = tag_sites(step_fn, abstract_args, target)
    return _explanation(assignment, report.peak, report.measured_on, sites, argument_kinds)


def explain_workload(
    workload: Workload, remat: "str | RematSpec", *, target: "str | Target | None" = None
) -> Explanation:
    """``explain`` of the train step ``plan.measure(workload, remat, target=target)`` compiles
    (its state donated, as ``jaxckpt train`` runs it).

    Example:
        >>> from jaxckpt import nn, plan
        >>> workload = plan.Workload(nn.TransformerConfig.preset("tiny", n_layers=1), batch=1, seq=16)
        >>> why = plan.explain_workload(workload, "full")
        >>> list(why.at_peak)[:2]
        ['optimizer state', 'parameters']
    """
    step, args = train_step_and_args(workload, remat, target)
    return explain(step, *args, target=target)


def _explanation(ba: BufferAssignment, peak: int, measured_on: str, sites: dict, argument_kinds: dict):
    points = max(len(ba.sequence), 1)
    namer = BufferNamer(ba, sites, argument_kinds)
    buffers = []  # (bytes, category, name, hlo, shape, source, (start, end)), then the temp block's
    temps = []  # (offset, size, index into buffers)
    for allocation in ba.allocations:
        if not allocation.counted:
            continue
        if allocation.kind != "temp":  # held for the whole run
            value = allocation.values[0] if allocation.values else None
            category, name, source = namer.allocation(allocation)
            hlo = f"{value.instruction}{{{value.index}}}" if value else f"allocation {allocation.index}"
            shape = value.shape.split("{")[0] if value else ""
            buffers.append((allocation.size, category, name, hlo, shape, source, (0, points - 1)))
            continue
        align = _alignment(allocation)
        for value in allocation.values:
            if value.live is None or value.shape.startswith("("):  # a tuple's table of pointers: its
                continue  # elements are values of their own
            category, name, source = namer.value(value, *value.live)
            hlo = f"{value.instruction}{{{value.index}}}"
            size = min(-(-value.size // align) * align, allocation.size - value.offset)  # what it takes
            temps.append((value.offset, size, len(buffers)))
            buffers.append((size, category, name, hlo, value.shape.split("{")[0], source, value.live))
    by_kind = {kind: np.zeros(points, dtype=np.int64) for kind in KINDS}
    for size, category, *_, (start, end) in buffers[: len(buffers) - len(temps)]:
        by_kind[kind_of(category)][start : end + 1] += size
    owned = _owned_bytes(temps, buffers, points)  # point -> {buffer: bytes it alone holds there}
    largest_at = []
    for t, shares in enumerate(owned):
        for i, size in shares.items():
            by_kind[kind_of(buffers[i][1])][t] += size
        top = sorted(shares.items(), key=lambda item: -item[1])[:3]
        largest_at.append(
            "; ".join(f"{buffers[i][1]} {buffers[i][4]} {format_bytes(size)}" for i, size in top)
        )
    timeline = sum(by_kind.values())
    peak_index = int(np.argmax(timeline))
    at_peak, live = Counter(), []
    for i, b in enumerate(buffers):
        size = owned[peak_index].get(i, 0) if i >= len(buffers) - len(temps) else b[0]
        if b[6][0] <= peak_index <= b[6][1] and size:
            at_peak[b[1]] += size
            live.append((size, *b[1:]))
    live.sort(key=lambda b: -b[0])
    return Explanation(
        peak_bytes=int(peak),
        measured_on=measured_on,
        timeline=tuple(int(t) for t in timeline),
        peak_index=peak_index,
        at_peak=dict(at_peak.most_common()),
        buffers=tuple(Buffer(*b) for b in live),
        by_kind={k: tuple(int(t) for t in v) for k, v in by_kind.items() if v.any()},
        program_points=ba.sequence,
        largest_at=tuple(largest_at),
    )


def _alignment(allocation) -> int:
    """The alignment of the values in an allocation: the largest power of two (at most 256,
    XLA:GPU's) that divides every offset (64 on XLA:CPU)."""
    offsets = [v.offset for v in allocation.values if v.offset]
    align = 256 if offsets else 1
    while align > 1 and any(o % align for o in offsets):
        align //= 2
    return align


def _owned_bytes(temps: list, buffers: list, points: int) -> list[dict]:
    """At each program point, the bytes of the temp block each live value holds, bytes that two
    live values share (a loop's carry and its body's parameter, an in-place update) counted once,
    for the value that starts lower in the block (then the larger)."""
    starts = sorted(range(len(temps)), key=lambda j: buffers[temps[j][2]][6][0])
    owned, active, k = [], [], 0
    for t in range(points):
        while k < len(starts) and buffers[temps[starts[k]][2]][6][0] <= t:
            active.append(temps[starts[k]])
            k += 1
        active = [v for v in active if buffers[v[2]][6][1] >= t]
        shares, covered = {}, 0
        for offset, size, i in sorted(active, key=lambda v: (v[0], -v[1])):
            end = offset + size
            if end > covered:
                shares[i] = end - max(offset, covered)
                covered = end
        owned.append(shares)
    return owned
