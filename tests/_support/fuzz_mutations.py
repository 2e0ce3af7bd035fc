"""The machinery of the fuzzed-reader cases (``fuzz_cases`` holds the readers).

A ``Reader`` has a pristine input (``build`` writes it into a directory), our reading of it
(``read``: what jaxckpt or torch_bridge does with the directory, as a comparable summary),
the format's own library (``reference``: the same summary, read by safetensors, torch,
tokenizers, json or pyarrow; it raises where that library rejects the input) and its
``mutations``. A mutation takes a ``random.Random`` (hypothesis's ``st.randoms()`` in the
tests, a seeded one in the benchmark), corrupts files of a copy of the pristine directory,
and says which names the error must give. ``run_case`` sorts what happened into one of:

- ``error``: a ``ValueError`` or ``OSError`` (the CLI's exit status 2), one line, naming the file;
- ``valid``: the mutation left an input that the format's own library reads (a flipped byte in
  tensor data, a JSON Lines file cut at a line break), and ours read exactly what it reads;
- ``other``: anything else: another exception type, a message on several lines or not naming the
  file, a corrupted input accepted, or a read that differs from the reference's.

A ``detectable`` mutation makes only inputs that no reader may accept (a truncated zip, a
header length past the end): ``valid`` does not count for it. ``other`` never counts.
"""

import dataclasses
import json
import random
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np


@dataclasses.dataclass(frozen=True)
class Mutation:
    """``apply(rng, directory) -> (what was done, the names the error must give)``; ``detectable``:
    every input it makes is corrupt."""

    apply: Callable[[random.Random, Path], tuple[str, tuple[str, ...]]]
    detectable: bool


PRISTINE = "pristine"
"""A ``Reader.reference``: a read that succeeds must give what the pristine input gives (no
mutation of the reader changes data: a zstd-compressed array cannot be changed undetected)."""


@dataclasses.dataclass(frozen=True)
class Reader:
    """A reader under test (see the module docstring)."""

    name: str
    build: Callable[[Path], None]
    read: Callable[[Path], object]
    reference: "Callable[[Path], object] | str | None"
    mutations: dict[str, Mutation]


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What one case did: ``kind`` is ``error``, ``valid`` or ``other``; ``detail`` the message or why."""

    reader: str
    mutation: str
    what: str
    kind: str
    detail: str


# ---------------------------------------------------------------- byte-level mutations


def truncate(name: str, *, before_last: bytes | None = None, detectable: bool = True) -> Mutation:
    """Cut ``name`` at a random byte (before the last ``before_last``: JSON that cannot parse)."""

    def apply(rng: random.Random, d: Path) -> tuple[str, tuple[str, ...]]:
        data = (d / name).read_bytes()
        cut = rng.randrange(data.rindex(before_last) if before_last else len(data))
        (d / name).write_bytes(data[:cut])
        return f"{name} cut to {cut} of {len(data)} bytes", (Path(name).name,)

    return Mutation(apply, detectable)


def flip(name: str, *, start: Callable[[bytes], int] = lambda data: 0, detectable: bool = False) -> Mutation:
    """XOR one random byte of ``name`` (from ``start(data)`` on) with a random non-zero byte."""

    def apply(rng: random.Random, d: Path) -> tuple[str, tuple[str, ...]]:
        data = bytearray((d / name).read_bytes())
        at, mask = rng.randrange(start(bytes(data)), len(data)), rng.randrange(1, 256)
        data[at] ^= mask
        (d / name).write_bytes(bytes(data))
        return f"{name} byte {at} ^= {mask:#04x}", (Path(name).name,)

    return Mutation(apply, detectable)


def replace(name: str, contents: Callable[[random.Random, bytes], bytes], what: str) -> Mutation:
    """``name``'s bytes replaced by ``contents(rng, old)``: always corrupt."""

    def apply(rng: random.Random, d: Path) -> tuple[str, tuple[str, ...]]:
        new = contents(rng, (d / name).read_bytes())
        (d / name).write_bytes(new)
        return f"{name}: {what} {new[:40]!r}", (Path(name).name,)

    return Mutation(apply, True)


def binary(rng: random.Random, _old: bytes) -> bytes:
    """1 to 95 random bytes (for ``replace``)."""
    return rng.randbytes(rng.randrange(1, 96))


def not_object(rng: random.Random, old: bytes) -> bytes:
    """JSON that is not an object (for ``replace`` of a JSON object file)."""
    return json.dumps(rng.choice([[1, 2], list(json.loads(old)), 5, "config", None, True, []])).encode()


def tensors(arrays) -> dict:
    """``{name: (shape, dtype, bytes)}`` of ``(name, array)`` pairs: a summary to compare reads by."""
    return {k: (tuple(a.shape), str(a.dtype), np.ascontiguousarray(a).tobytes()) for k, a in arrays}


def set_field(config: dict, field: str, value) -> dict:
    """A copy of the JSON object ``config`` with ``field`` (dotted: nested) set to ``value``."""
    config = json.loads(json.dumps(config))
    *parents, last = field.split(".")
    node = config
    for parent in parents:
        node = node[parent]
    node[last] = value
    if field == "rope_theta":
        config.pop("rope_parameters")  # else rope_parameters' rope_theta wins
    return config


# ---------------------------------------------------------------- running one case


def judge(read: Callable[[], object], reference: Callable[[], object] | None, names, detectable: bool):
    """``(kind, detail)`` of one read of a corrupted input (see the module docstring)."""
    try:
        got = read()
    except (ValueError, OSError) as err:
        message = str(err).strip()
        if "\n" in message:
            return "other", f"{type(err).__name__} on {len(message.splitlines())} lines: {message!r}"
        missing = [name for name in names if name not in message]
        if missing:
            return "other", f"{type(err).__name__} not naming {', '.join(missing)}: {message}"
        return "error", message
    except BaseException as err:  # a tokenizers (pyo3) panic is a BaseException
        if isinstance(err, KeyboardInterrupt):
            raise
        return "other", f"{type(err).__module__}.{type(err).__name__}: {' '.join(str(err).split())[:300]}"
    if detectable or reference is None:
        return "other", "a corrupted input was read without an error"
    try:
        expected = reference()
    except Exception as err:
        return "other", f"read an input the format's own library rejects ({type(err).__name__}: {err})"
    if got != expected:
        return "other", "read something other than what the format's own library reads"
    return "valid", "the format's own library reads the same (an undetectable change)"


_PRISTINE_READS: dict[Path, object] = {}


def _reference(reader: Reader, case: Path, pristine: Path) -> Callable[[], object] | None:
    if reader.reference is None:
        return None
    if reader.reference != PRISTINE:
        return lambda: reader.reference(case)
    if pristine not in _PRISTINE_READS:
        _PRISTINE_READS[pristine] = reader.read(pristine)
    return lambda: _PRISTINE_READS[pristine]


def run_case(reader: Reader, mutation: str, rng: random.Random, pristine: Path, work: Path) -> Outcome:
    """Copies ``pristine`` (``reader.build``'s directory) into ``work``, applies one mutation and reads."""
    # A new path each time: tensorstore (orbax) caches what it read by path.
    case = work / f"{reader.name.replace('/', '_').replace('.', '_')}-{uuid.uuid4().hex[:8]}"
    shutil.copytree(pristine, case)
    try:
        change = reader.mutations[mutation]
        what, names = change.apply(rng, case)
        reference = _reference(reader, case, pristine)
        kind, detail = judge(lambda: reader.read(case), reference, names, change.detectable)
    finally:
        shutil.rmtree(case, ignore_errors=True)
    return Outcome(reader.name, mutation, what, kind, detail)


def build(reader: Reader, directory: Path) -> Path:
    """The pristine input of ``reader`` in ``directory`` (created), read once as a check."""
    directory.mkdir(parents=True, exist_ok=True)
    reader.build(directory)
    reader.read(directory)
    return directory
