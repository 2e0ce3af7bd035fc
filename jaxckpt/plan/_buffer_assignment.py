"""XLA's own buffer assignment of a compiled program, read from the files ``--xla_dump_to`` writes.

A compile with the option ``xla_dump_to`` (``compile_fn(..., options=dump_options(folder))``)
writes, for its module, after optimisation:

- ``*after_optimizations.txt``: the scheduled HLO, each instruction with its metadata
  (``op_name``, the JAX name stack; ``stack_frame_id``, the Python stack it was traced at,
  whose frames are listed in the module's ``FileNames`` / ``FileLocations`` / ``StackFrames``);
- ``*after_optimizations-buffer-assignment.txt``: every allocation (its size, whether it is a
  parameter's, the output's, a constant, thread-local, or the one ``preallocated-temp`` block
  the temporaries are packed into) and the HLO values assigned to it, with offset and size;
- ``*after_optimizations-live-range.txt``: the flattened schedule (``InstructionSequence``,
  every computation's instructions in order, loop bodies once) and each value's live range
  over it (``BufferLiveRange``, ``name{index}:start-end``).

``read_dump`` parses the three into a ``BufferAssignment``. The compiler's figures come back
from it exactly: ``memory_analysis()``'s peak (``argument + output + temp - alias``) is the sum
of the allocations that are not constants or thread-local, its ``temp`` the size of the
``preallocated-temp`` block (``tests/plan/test_explain.py`` checks both).
"""

import contextlib
import dataclasses
import itertools
import os
import random
import re
from pathlib import Path

import jax

_ALLOCATION = re.compile(r"^allocation (\d+): size (\d+), (.*?):?$")
_VALUE = re.compile(
    r"^ value: <(\d+) (\S+?)(\{[\d,]*\})?(?: \(phi\))? @\d+> \(size=(\d+),offset=(\d+)\): (.*)$"
)
_PARAMETER = re.compile(r"parameter (\d+), shape \|.*\| at ShapeIndex \{([\d,]*)\}")
_LIVE = re.compile(r"^\s+(\S+?)(\{[\d,]*\}):(\d+)-(\d+)$")
_SEQUENCE = re.compile(r"^\s+(\d+):(\S+)$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.*?) (\w[\w-]*)\((.*)$")
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_FRAME_ID = re.compile(r"stack_frame_id=(\d+)")
_SOURCE = re.compile(r'source_file="([^"]*)" source_line=(\d+)')


@dataclasses.dataclass(frozen=True)
class Value:
    """One HLO value in an allocation: ``instruction{index}`` (``index`` "" for a whole
    array), its bytes at ``offset`` of the allocation, its shape, and its live range
    ``[start, end]`` over the flattened schedule (None where XLA gives none)."""

    instruction: str
    index: str
    size: int
    offset: int
    shape: str
    live: tuple[int, int] | None


@dataclasses.dataclass(frozen=True)
class Allocation:
    """One of XLA's allocations: ``kind`` is ``"parameter"`` (``parameter`` its number),
    ``"output"``, ``"temp"`` (the preallocated block), ``"constant"``, ``"thread-local"``
    or ``"other"`` (an output leaf of its own); ``live_out`` when it holds an output."""

    index: int
    size: int
    kind: str
    parameter: int | None
    live_out: bool
    values: tuple[Value, ...]

    @property
    def counted(self) -> bool:
        """Whether ``memory_analysis()``'s peak counts it (constants and thread-local
        scratch are not)."""
        return self.kind not in ("constant", "thread-local")


@dataclasses.dataclass(frozen=True)
class Instruction:
    """An HLO instruction's opcode, operands, ``op_name`` and Python frames (innermost first,
    ``(file, line, function)``)."""

    name: str
    opcode: str
    operands: tuple[str, ...]
    op_name: str
    frames: tuple[tuple[str, int, str], ...]
    called: dict = dataclasses.field(default_factory=dict)
    """Computations it calls: ``body``, ``condition``, ``calls`` (a fusion's), ``to_apply``."""
    tuple_index: int | None = None
    """A ``get-tuple-element``'s index."""
    shape: str = ""
    """Its result's shape (``f32[3,17,30]{2,1,0}``)."""


@dataclasses.dataclass(frozen=True)
class BufferAssignment:
    """A compiled module's allocations, schedule and instructions (``read_dump``)."""

    allocations: tuple[Allocation, ...]
    sequence: tuple[str, ...]
    instructions: dict
    computations: dict
    """Computation name -> its instructions' names in order (the last is its root)."""
    parameter_names: dict
    """Entry parameter number -> its ``op_name`` (JAX writes the argument's path there)."""

    @property
    def peak(self) -> int:
        """``argument + output + temp - alias`` as ``memory_analysis()`` counts it."""
        return sum(a.size for a in self.allocations if a.counted)

    @property
    def temp(self) -> int:
        """The ``preallocated-temp`` block's bytes (``memory_analysis().temp_size_in_bytes``)."""
        return sum(a.size for a in self.allocations if a.kind == "temp")


def dump_options(folder: "str | Path") -> dict:
    """XLA compile options that write a module's buffer assignment into ``folder``.

    JAX's persistent cache leaves the dump options out of its key, so a program compiled (and
    cached) before would come back from the cache without being compiled, and nothing would be
    written. ``xla_debug_buffer_assignment_show_max`` (how many buffers XLA's out-of-memory
    messages list) is a marker that makes the key one of its own each time: a number no other
    compile used (``no_cache_writes`` keeps the entry from being written at all).

    Example:
        >>> sorted(dump_options("dump"))
        ['xla_debug_buffer_assignment_show_max', 'xla_dump_hlo_as_text', 'xla_dump_to']
    """
    marker = 1_000_000 + next(_MARKERS) * 1000 + os.getpid() % 1000 + random.randrange(10**6) * 10**7
    return {
        "xla_dump_to": str(folder),
        "xla_dump_hlo_as_text": True,
        "xla_debug_buffer_assignment_show_max": marker,
    }


_MARKERS = itertools.count()


@contextlib.contextmanager
def no_cache_writes():
    """JAX's persistent compilation cache writes no entry inside (a compile that dumps must
    never be served from it: see ``dump_options``)."""
    before = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1e9)
    try:
        yield
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", before)


def read_dump(folder: "str | Path") -> BufferAssignment:
    """The ``BufferAssignment`` of the one module compiled into ``folder`` (``dump_options``).

    Raises:
        FileNotFoundError: when ``folder`` holds no buffer assignment (the program was not
            compiled with ``dump_options``, or its backend writes none).
    """
    folder = Path(folder)
    found = sorted(folder.glob("*after_optimizations-buffer-assignment.txt"))
    if not found:
        raise FileNotFoundError(
            f"no *after_optimizations-buffer-assignment.txt in {folder}: nothing was dumped"
        )
    assignment = found[-1]  # one module per compile; the last is the one compiled last
    stem = assignment.name.removesuffix("-buffer-assignment.txt")
    sequence, live = _read_live_ranges(folder / f"{stem}-live-range.txt")
    instructions, computations = _read_hlo((folder / f"{stem}.txt").read_text())
    allocations = _read_allocations(assignment.read_text(), live)
    entry = computations.get("__entry__", ())
    parameter_names = {}
    for name in entry:
        inst = instructions[name]
        if inst.opcode == "parameter":
            parameter_names[int(inst.operands[0])] = inst.op_name or name
    return BufferAssignment(tuple(allocations), sequence, instructions, computations, parameter_names)


def _read_allocations(text: str, live: dict) -> list[Allocation]:
    allocations, current = [], None
    for line in text.splitlines():
        if line.startswith("Total bytes used") or line.startswith("Used values"):
            break
        head = _ALLOCATION.match(line)
        if head:
            index, size, rest = int(head[1]), int(head[2]), head[3]
            parameter = _PARAMETER.search(rest)
            if parameter:
                kind = "parameter"
            elif "preallocated-temp" in rest:
                kind = "temp"
            elif rest.startswith("output shape"):
                kind = "output"
            elif rest.startswith("constant"):
                kind = "constant"
            elif rest.startswith("thread-local"):
                kind = "thread-local"
            else:
                kind = "other"
            current = dict(
                index=index,
                size=size,
                kind=kind,
                parameter=int(parameter[1]) if parameter else None,
                live_out="maybe-live-out" in rest,
                values=[],
            )
            allocations.append(current)
            continue
        value = _VALUE.match(line)
        if value and current is not None:
            name, index = value[2], (value[3] or "{}")
            current["values"].append(
                Value(name, index.strip("{}"), int(value[4]), int(value[5]), value[6], live.get(name + index))
            )
    return [Allocation(**{**a, "values": tuple(a["values"])}) for a in allocations]


def _read_live_ranges(path: Path) -> tuple[tuple[str, ...], dict]:
    sequence, live = [], {}
    section = None
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if stripped == "InstructionSequence:":
            section = "sequence"
        elif stripped == "BufferLiveRange:":
            section = "live"
        elif stripped.startswith("Live ranges at") or stripped.startswith("Stack trace"):
            section = None
        elif section == "sequence" and (m := _SEQUENCE.match(line)):
            sequence.append(m[2])
        elif section == "live" and (m := _LIVE.match(line)):
            live[m[1] + m[2]] = (int(m[3]), int(m[4]))
    return tuple(sequence), live


def _read_hlo(text: str) -> tuple[dict, dict]:
    """Instructions (name -> ``Instruction``) and computations (name -> instruction names;
    the entry's also under ``"__entry__"``) of a module's text."""
    files, functions, locations, frames = {}, {}, {}, {}
    tables = {
        "FileNames": files,
        "FunctionNames": functions,
        "FileLocations": locations,
        "StackFrames": frames,
    }
    table = None
    instructions, computations, current = {}, {}, None
    for line in text.splitlines():
        if line in tables:
            table = tables[line]
            continue
        if table is not None:
            if line and line[0].isdigit():
                key, rest = line.split(" ", 1)
                table[int(key)] = rest
                continue
            table = None
        if line.endswith("{") and not line.startswith(" ") and "HloModule" not in line:
            name = line.split(" ", 2)[1 if line.startswith("ENTRY") else 0].lstrip("%")
            current = computations.setdefault(name, [])
            if line.startswith("ENTRY"):
                computations["__entry__"] = current
            continue
        m = _INSTRUCTION.match(line)
        if m is None or current is None:
            continue
        name, opcode, rest = m[1], m[3], m[4]
        operands = tuple(re.findall(r"%([\w.\-]+)", rest.split("),", 1)[0]))
        if opcode == "parameter":
            operands = (rest.split(")", 1)[0],)
        op_name = _OP_NAME.search(rest)
        frame = _FRAME_ID.search(rest)
        source = _SOURCE.search(rest)
        stack = _stack(int(frame[1]), frames, locations, files, functions) if frame else ()
        if not stack and source:
            stack = ((source[1], int(source[2]), ""),)
        current.append(name)
        called = dict(re.findall(r"\b(body|condition|calls|to_apply)=%([\w.\-]+)", rest))
        tuple_index = re.search(r"\bindex=(\d+)", rest)
        instructions[name] = Instruction(
            name,
            opcode,
            operands,
            op_name[1].replace("\\'", "'") if op_name else "",
            stack,
            called,
            int(tuple_index[1]) if tuple_index else None,
            m[2],
        )
    return instructions, computations


def _stack(frame_id: int, frames: dict, locations: dict, files: dict, functions: dict) -> tuple:
    """The frames of ``frame_id``, innermost first, as ``(file, line, function)``."""
    out, seen = [], set()
    while frame_id in frames and frame_id not in seen:
        seen.add(frame_id)
        fields = dict(re.findall(r"(\w+)=(\d+)", frames[frame_id]))
        location = dict(re.findall(r"(\w+)=(\d+)", locations.get(int(fields.get("file_location_id", 0)), "")))
        file = files.get(int(location.get("file_name_id", 0)), '""').strip('"')
        function = functions.get(int(location.get("function_name_id", 0)), '""').strip('"')
        out.append((file, int(location.get("line", 0)), function))
        parent = int(fields.get("parent_frame_id", 0))
        if parent == frame_id:
            break
        frame_id = parent
    return tuple(out)
