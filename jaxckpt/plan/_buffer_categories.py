"""How ``explain`` names a compiled step's buffers: each gets a category and a name.

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

import re

from jaxckpt.plan._buffer_assignment import BufferAssignment

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


def kind_of(category: str) -> str:
    """A category's kind (``KINDS``): ``"residual: attn_out"`` -> ``"residuals"``."""
    head = category.split(":", 1)[0]
    return {"residual": "residuals", "temporary": "temporaries"}.get(head, head)


class BufferNamer:
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
