"""The communication of a compiled program, read from its HLO: bytes per collective kind.

After SPMD partitioning (``jax.jit`` over a mesh, ``jax.shard_map``) the compiled HLO is
one device's program, so each collective's result shape is what that device ends up
with (an all-gather's gathered array, own share included; a collective-permute's incoming
block; a reduce-scatter's shard; an all-reduce's reduced array). That is the figure
counted: the bytes on the wire depend on the algorithm (a ring reduce-scatter over ``n``
devices moves about ``n - 1`` times its result, a ring all-reduce about twice its result).
A collective inside a loop runs once per iteration: each is counted times the trip
counts of the ``while`` loops around it (XLA writes ``known_trip_count`` on the loops it
has analysed; a loop without one is counted once, and reported in
``unknown_trip_counts``). Both branches of a conditional are counted (an upper bound).
"""

import dataclasses
import re

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "collective-permute", "all-to-all")
"""The HLO collective ops counted (their async ``-start``/``-done`` pairs count as one)."""

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2}
_BYTES |= {"s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_OP = re.compile(r"=\s*(\([^=]*?\)|\S+)\s+([\w\-]+)\(")
_CALLEE = re.compile(r"\b(?:body|to_apply|calls|condition|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_COMMENT = re.compile(r"/\*.*?\*/")
_BODY = re.compile(r"\bbody=%?([\w.\-]+)")


@dataclasses.dataclass(frozen=True)
class CollectiveBytes:
    """Bytes one device receives through each kind of collective in one run of a program.

    Attributes:
        bytes: ``{kind: bytes}`` over :data:`COLLECTIVES` (kinds absent: 0), loop trip
            counts applied.
        ops: ``{kind: executions}``, loop trip counts applied.
        unknown_trip_counts: how many loops around collectives had no trip count in the
            HLO (their bodies are counted once each: the bytes are then a lower bound).

    Example:
        >>> counted = CollectiveBytes({"all-gather": 64, "collective-permute": 96}, {"all-gather": 1})
        >>> counted.total
        160
    """

    bytes: dict
    ops: dict
    unknown_trip_counts: int = 0

    @property
    def total(self) -> int:
        """All kinds together."""
        return sum(self.bytes.values())


def _shape_bytes(text: str) -> int:
    """Bytes of an HLO result type: ``f32[2,3]{1,0}`` or a tuple of them."""
    total = 0
    for dtype, dims in _ARRAY.findall(text):
        if dtype not in _BYTES and not dtype.startswith("f8"):
            continue
        size = 1
        for d in filter(None, dims.split(",")):
            size *= int(d)
        total += size * _BYTES.get(dtype, 1)
    return total


def _computations(hlo: str) -> tuple[dict[str, list[str]], str]:
    """``{name: instruction lines}`` of every computation, and the entry's name."""
    comps, entry, current = {}, "", None
    for line in hlo.splitlines():
        header = _HEADER.match(line.strip()) if not line.startswith(" ") else None
        if header:
            current = header.group(1)
            comps[current] = []
            entry = current if line.startswith("ENTRY") else entry
        elif line.startswith("}"):
            current = None
        elif current is not None:
            comps[current].append(line)
    return comps, entry


def _callees(line: str) -> list[tuple[str, int | None]]:
    """The computations an instruction calls, each with the times it runs them (a loop's
    body: its trip count, None when unknown; anything else: 1)."""
    names = _CALLEE.findall(line)
    for branches in _BRANCHES.findall(line):
        names += [b.strip().lstrip("%") for b in branches.split(",")]
    body = _BODY.search(line) if " while(" in line else None
    trip = _TRIP.search(line)
    loop_times = int(trip.group(1)) if trip else None
    return [(name, loop_times if body and name == body.group(1) else 1) for name in names]


def _count(comps: dict[str, list[str]], name: str, memo: dict) -> tuple[dict, dict, int]:
    """Bytes and executions per kind in one run of computation ``name`` (its callees
    included), and the loops without a trip count met."""
    if name in memo:
        return memo[name]
    found, ops, unknown = dict.fromkeys(COLLECTIVES, 0), dict.fromkeys(COLLECTIVES, 0), 0
    for line in comps.get(name, ()):
        line = _COMMENT.sub("", line)  # a long tuple's /*index=5*/ marks
        op = _OP.search(line)
        if op is not None:
            result, opcode = op.groups()
            kind = opcode.removesuffix("-done")
            if kind in found and not opcode.endswith("-start"):
                found[kind] += _shape_bytes(result)
                ops[kind] += 1
        for callee, times in _callees(line):
            if callee not in comps:
                continue
            sub_found, sub_ops, sub_unknown = _count(comps, callee, memo)
            unknown += times is None and any(sub_ops.values())  # a loop around collectives
            for kind in COLLECTIVES:
                found[kind] += sub_found[kind] * (times or 1)
                ops[kind] += sub_ops[kind] * (times or 1)
            unknown += sub_unknown
    memo[name] = (found, ops, unknown)
    return memo[name]


def collective_bytes(compiled) -> CollectiveBytes:
    r"""The bytes one device receives through collectives in one run of ``compiled``.

    Args:
        compiled: a ``jax.stages.Compiled`` (``jax.jit(f).lower(...).compile()``) or its
            HLO text (``compiled.as_text()``).

    Returns:
        :class:`CollectiveBytes`: per kind, the bytes of the collectives' results on one
        device (its share of the step's communication), and how many ran.

    Example:
        >>> hlo = "\n".join([
        ...     "%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {",
        ...     "  %x = f32[8]{0} collective-permute(f32[8]{0} %y), source_target_pairs={{0,1},{1,0}}",
        ...     "}",
        ...     "ENTRY %main (a: f32[8]) -> f32[16] {",
        ...     "  %w = (s32[], f32[8]) while((s32[], f32[8]) %t), condition=%c, body=%body,"
        ...     ' backend_config={"known_trip_count":{"n":"3"}}',
        ...     "  %r = (f32[2], /*index=1*/f32[3]) all-reduce(f32[2] %b, f32[3] %c), to_apply=%add",
        ...     "  ROOT %g = f32[16]{0} all-gather(f32[8]{0} %a), dimensions={0}",
        ...     "}",
        ... ])
        >>> counted = collective_bytes(hlo)  # 3 permutes of 8 fp32 in the loop, 5 reduced, 16 gathered
        >>> counted.bytes["collective-permute"], counted.bytes["all-reduce"], counted.bytes["all-gather"]
        (96, 20, 64)
    """
    hlo = compiled if isinstance(compiled, str) else compiled.as_text()
    comps, entry = _computations(hlo)
    found, ops, unknown = _count(comps, entry, {})
    return CollectiveBytes(found, ops, unknown)
