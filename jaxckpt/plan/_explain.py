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

Every buffer gets a category:

- an argument's by its path (JAX names each entry parameter after it, ``state[1]['opt_state']``):
  ``"optimizer state"`` where a key names an optimizer's (``opt_state``, ``mu``, ``nu``, ...),
  ``"inputs"`` where it names a batch (``batch``, ``tokens``, ``x``, ...), otherwise
  ``"parameters"`` for floating point and ``"arguments"`` for the rest (step counters, keys);
  ``arguments=`` names them yourself, by the step's argument names;
- ``"gradients"``: a backward-pass value (``op_name`` under ``transpose(...)``) of a parameter's
  shape that outlives the backward pass (or is a loop's carry: a scan's gradient accumulator);
- ``"residual: <tag>"``: a forward-pass value still live when the backward pass starts, named
  by its ``checkpoint_name`` tag where one was placed on its source line (the tags' source
  lines come from the traced jaxpr; a scan's stacked residuals from the loop body's value
  that fills them, or, where the body stacks its carry, from the tag its body places on its
  input: ``layer_input``), else ``"residual: <op>"`` (``"residual: scan-stacked"``);
- ``"temporary: <op>"``: the rest, by the JAX primitive that made it (``op_name``'s last part);
- ``"outputs"``: an output of its own (not donated).
"""

import dataclasses
import re
import tempfile
from collections import Counter

import numpy as np

from jaxckpt._sizes import format_bytes
from jaxckpt.plan._buffer_assignment import BufferAssignment, dump_options, no_cache_writes, read_dump
from jaxckpt.plan._compile import compile_fn, compiled_report, train_step_and_args
from jaxckpt.plan._tag_sites import tag_sites
from jaxckpt.plan._targets import Target, compile_target
from jaxckpt.plan._workload import Workload
from jaxckpt.remat import RematSpec

KINDS = (
    "parameters",
    "optimizer state",
    "inputs",
    "arguments",
    "gradients",
    "residuals",
    "temporaries",
    "outputs",
)
"""The categories' kinds, bottom to top of the stacked timeline."""

_OPTIMIZER_KEYS = frozenset(
    {"opt_state", "opt", "optimizer", "mu", "nu", "momentum", "trace", "count", "ema"}
)
_INPUT_KEYS = frozenset(
    {"batch", "inputs", "input", "tokens", "x", "y", "labels", "targets", "images", "data"}
)


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
        return _kind(self.category)


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
    namer = _Namer(ba, sites, argument_kinds)
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
        by_kind[_kind(category)][start : end + 1] += size
    owned = _owned_bytes(temps, buffers, points)  # point -> {buffer: bytes it alone holds there}
    largest_at = []
    for t, shares in enumerate(owned):
        for i, size in shares.items():
            by_kind[_kind(buffers[i][1])][t] += size
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


def _kind(category: str) -> str:
    head = category.split(":", 1)[0]
    return {"residual": "residuals", "temporary": "temporaries"}.get(head, head)


class _Namer:
    """Categories and names of a module's buffers (see the module docstring)."""

    def __init__(self, ba: BufferAssignment, sites: dict, argument_kinds: dict):
        self.ba, self.sites, self.argument_kinds = ba, sites, argument_kinds
        self.instructions = ba.instructions
        self.loop_of = {}  # a loop body -> its while instruction
        for inst in self.instructions.values():
            if inst.opcode == "while" and "body" in inst.called:
                self.loop_of[inst.called["body"]] = inst.name
        self.computation_of = {name: comp for comp, names in ba.computations.items() for name in names}
        backward = [i for i, name in enumerate(ba.sequence) if _backward(self._op_name(name))]
        self.backward_end = backward[-1] if backward else 0
        self.parameter_shapes = set()
        for allocation in ba.allocations:
            if allocation.kind == "parameter" and allocation.values:
                category, _, _ = self.allocation(allocation)
                if category == "parameters":
                    self.parameter_shapes.add(_dims(allocation.values[0].shape))

    def _op_name(self, instruction: str) -> str:
        inst = self.instructions.get(instruction)
        return inst.op_name if inst else ""

    def _source(self, instruction: str) -> str:
        inst = self.instructions.get(instruction)
        if inst is None or not inst.frames:
            return ""
        file, line, _ = inst.frames[0]
        return f"{_short(file)}:{line}"

    def allocation(self, allocation) -> tuple[str, str, str]:
        value = allocation.values[0] if allocation.values else None
        if allocation.kind == "parameter":
            path = self.ba.parameter_names.get(allocation.parameter, f"parameter {allocation.parameter}")
            return self._argument(path, value.shape if value else ""), path, ""
        if value is None:
            return "outputs", f"allocation {allocation.index}", ""
        return (
            "outputs",
            _op(self._op_name(value.instruction)) or value.instruction,
            self._source(value.instruction),
        )

    def _argument(self, path: str, shape: str) -> str:
        head = re.match(r"[A-Za-z_]\w*", path)
        if head and head[0] in self.argument_kinds:
            return self.argument_kinds[head[0]]
        keys = set(re.findall(r"[A-Za-z_]\w*", path))
        if keys & _OPTIMIZER_KEYS:
            return "optimizer state"
        if keys & _INPUT_KEYS:
            return "inputs"
        return "parameters" if shape[:1] in ("f", "b") else "arguments"  # f32, bf16, f16; not s32, u32

    def value(self, value, start: int, end: int) -> tuple[str, str, str]:
        instruction = self._defining(value.instruction)
        op_name = self._op_name(instruction)
        source = self._source(instruction)
        name = _op(op_name) or self._opcode(instruction)
        if _backward(op_name):
            # a parameter's shape, and kept past the backward pass (to the update) or carried by
            # its loop: an activation's gradient of the same shape dies inside the pass
            survives = end >= self.backward_end or self._opcode(instruction) == "while"
            if _dims(value.shape) in self.parameter_shapes and survives:
                return "gradients", name, source
            return f"temporary: {name}", name, source
        last_use = self.ba.sequence[end] if end < len(self.ba.sequence) else ""
        if "jvp(" in op_name and _backward(self._op_name(self._defining(last_use))):
            name = self._tag(instruction, value.index) or (  # kept for the backward pass
                "scan-stacked" if self._opcode(instruction) == "while" else name
            )
            return f"residual: {name}", name, source
        return f"temporary: {name}", name, source

    def _defining(self, instruction: str) -> str:
        """The instruction a value comes from: a loop body's parameter is its loop's carry."""
        inst = self.instructions.get(instruction)
        if inst is not None and inst.opcode == "parameter":
            loop = self.loop_of.get(self.computation_of.get(instruction, ""))
            if loop is not None:
                return loop
        return instruction

    def _opcode(self, instruction: str) -> str:
        inst = self.instructions.get(instruction)
        return inst.opcode if inst else instruction

    def _tag(self, instruction: str, index: str, depth: int = 0) -> str | None:
        """The ``checkpoint_name`` tag of a value: its instruction's source line's, or, for a
        loop's output (a scan's stacked residual), that of the value its body stores there."""
        inst = self.instructions.get(instruction)
        if inst is None or depth > 8:
            return None
        tags = [self.sites[(file, line)] for file, line, _ in inst.frames[:4] if (file, line) in self.sites]
        if tags:  # the outermost: tag(dense(x), "q_proj") is q_proj, not the dense's own tag
            return tags[-1]
        if inst.opcode == "while" and index:
            body = self.ba.computations.get(inst.called.get("body", ""), [])
            root = self.instructions.get(body[-1]) if body else None
            k = int(index.split(",")[0])
            if root is not None and root.opcode == "tuple" and k < len(root.operands):
                stored = self._stored_tag(root.operands[k], depth + 1)
                if stored is None and self._stores_carry(root.operands[k], k):
                    frames = [("scan", file, line) for file, line, _ in inst.frames[:2]]
                    stored = next((self.sites[f] for f in frames if f in self.sites), None)
                return stored
        if inst.opcode == "get-tuple-element" and inst.operands:
            return self._tag(inst.operands[0], str(inst.tuple_index), depth + 1)
        return None

    def _stores_carry(self, instruction: str, k: int) -> bool:
        """Whether a loop body's output ``k`` is a stack its carry is written into: an update of
        element ``k`` whose update is (a copy of) another array element of the body's input."""
        inst = self.instructions.get(instruction)
        if inst is None or inst.opcode not in ("fusion", "dynamic-update-slice"):
            return False
        for name in inst.operands[1:]:
            source = self.instructions.get(name)
            while source is not None and source.opcode in ("copy", "bitcast") and source.operands:
                source = self.instructions.get(source.operands[0])
            if (
                source is not None
                and source.opcode == "get-tuple-element"
                and source.tuple_index != k
                and _dims(source.shape)
                and self._opcode(source.operands[0]) == "parameter"
            ):
                return True
        return False

    def _stored_tag(self, instruction: str, depth: int) -> str | None:
        """The tag of what a loop body stores at one of its outputs (through the
        dynamic-update-slice, fusion, copy and bitcast that put it there)."""
        seen, frontier = set(), [instruction]
        for _ in range(6):
            following = []
            for name in frontier:
                if name in seen:
                    continue
                seen.add(name)
                tag = self._tag(name, "", depth + 1)
                if tag:
                    return tag
                inst = self.instructions.get(name)
                if inst is None:
                    continue
                following.extend(inst.operands)
                fused = inst.called.get("calls")
                if fused:  # the fused computation's instructions carry the metadata
                    following.extend(self.ba.computations.get(fused, []))
            frontier = following
        return None


def _backward(op_name: str) -> bool:
    return "transpose(" in op_name


def _op(op_name: str) -> str:
    """The JAX primitive in an ``op_name`` (its last part: ``dot_general``)."""
    last = op_name.split(";")[0].rsplit("/", 1)[-1]
    return re.sub(r"\[.*$", "", last)


def _dims(shape: str) -> str:
    match = re.search(r"\[([\d,]*)\]", shape)
    return match[1] if match else ""


def _short(file: str) -> str:
    """A source file's path from its package on (``jaxckpt/nn/_block.py``), no machine paths."""
    parts = file.replace("\\", "/").split("/")
    for anchor in ("site-packages", "dist-packages"):
        if anchor in parts:
            return "/".join(parts[parts.index(anchor) + 1 :])
    for i in range(len(parts) - 1, 0, -1):
        if parts[i] in ("jaxckpt", "tests", "torch_bridge", "npu_backend", "notebooks", "benchmarks"):
            return "/".join(parts[i:])
    return "/".join(parts[-2:])
