"""Corrupted inputs for every reader: the cases of ``tests/reliability/test_fuzz_readers.py`` and
``benchmarks/reliability/bench_fuzz_readers.py``, which import them from here.

``READERS`` holds one ``fuzz_mutations.Reader`` per reader: safetensors, ``.bin``/``.pt``,
``config.json``, an orbax checkpoint (``fuzz_weights``), ``tokenizer.json``, jsonl and
parquet data (below). ``run_case`` runs one mutation of one reader and sorts the outcome
(``error``, ``valid`` or ``other``; see ``fuzz_mutations``).
"""

import io
import json
import random
from collections.abc import Callable
from pathlib import Path

from fuzz_mutations import (
    Mutation,
    Outcome,
    Reader,
    binary,
    build,
    flip,
    judge,
    replace,
    run_case,
    set_field,
    truncate,
)
from fuzz_weights import BIN, CONFIG, LLAMA_CONFIG, ORBAX, SAFETENSORS, ST, TORCH_BIN, build_hf

__all__ = [  # what the test and the benchmark use, re-exported
    "BIN", "CONFIG", "JSONL", "LLAMA_CONFIG", "ORBAX", "PARQUET", "READERS", "SAFETENSORS", "ST", "TOKENIZER",
    "TORCH_BIN", "Mutation", "Outcome", "Reader", "build", "build_hf", "judge", "run_case",
]  # fmt: skip

SAMPLE_TEXT = "Hello world, hello jaxckpt!"
DATA_TEXTS = ["one document", "a second, longer document", "é ü — unicode", "3", "five", "six six", "7"]


# ---------------------------------------------------------------- tokenizer.json


def _build_tokenizer(d: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = sorted({w for t in [SAMPLE_TEXT.lower(), *DATA_TEXTS] for w in t.replace(",", " ").split()})
    backend = Tokenizer(models.WordLevel({"<unk>": 0, **{w: i + 1 for i, w in enumerate(words)}}, "<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.save(str(d / "tokenizer.json"))


def _tokenizer_summary(vocab_size: int, ids) -> tuple:
    return vocab_size, [int(i) for i in ids]


def _read_tokenizer(d: Path) -> tuple:
    from jaxckpt.data import load_tokenizer

    tok = load_tokenizer(d)
    return _tokenizer_summary(tok.backend.get_vocab_size(), tok.encode(SAMPLE_TEXT))


def _tokenizer_reference(d: Path) -> tuple:
    from tokenizers import Tokenizer

    backend = Tokenizer.from_str((d / "tokenizer.json").read_text(encoding="utf-8"))
    return _tokenizer_summary(backend.get_vocab_size(), backend.encode(SAMPLE_TEXT).ids)


def _tokenizer_types(rng: random.Random, old: bytes) -> bytes:
    """A field of tokenizer.json, or of its model, set to a value of the wrong type."""
    obj = json.loads(old)
    field = rng.choice(["model", "model.vocab", "model.unk_token", "model.type", "pre_tokenizer",
                        "added_tokens", "normalizer", "decoder", "version", "post_processor"])  # fmt: skip
    value = rng.choice([5, "x", [1, 2], {"type": "Nope"}, True, -1])
    return json.dumps(set_field(obj, field, value)).encode()


TOK = "tokenizer.json"
TOKENIZER = Reader(
    "tokenizer.json",
    _build_tokenizer,
    _read_tokenizer,
    _tokenizer_reference,
    {
        "truncate": truncate(TOK, before_last=b"}"),
        "flip": flip(TOK),
        "wrong_type": Mutation(replace(TOK, _tokenizer_types, "").apply, False),
        "binary": replace(TOK, binary, "random bytes"),
    },
)


# ---------------------------------------------------------------- jsonl / parquet data


def _read_data(file: Path) -> list[str]:
    from jaxckpt.data import ByteTokenizer, encode_record, read_records

    tokenizer, texts = ByteTokenizer(), []
    for record, where, _ in read_records(file):
        encode_record(record, tokenizer, where=where)
        texts.append(record["text"])
    return texts


def _texts(records: list) -> list[str]:
    """The reference's rule: every record an object with a string ``text`` (the only shape here)."""
    if not records or not all(isinstance(r, dict) and isinstance(r.get("text"), str) for r in records):
        raise ValueError("not a data set of text records")
    if any({"messages", "prompt", "completion"} & r.keys() for r in records):
        raise ValueError("a record of two shapes")
    return [r["text"] for r in records]


def _build_jsonl(d: Path) -> None:
    lines = [json.dumps({"text": t, "id": i}, ensure_ascii=False) for i, t in enumerate(DATA_TEXTS)]
    (d / "data.jsonl").write_text("\n".join([*lines[:3], "", *lines[3:]]) + "\n", encoding="utf-8")


def _jsonl_reference(d: Path) -> list[str]:
    lines = (d / "data.jsonl").read_bytes().split(b"\n")
    return _texts([json.loads(line) for line in lines if line.strip()])


def _jsonl_line(change: Callable[[random.Random, dict], object], what: str) -> Mutation:
    """One random record of data.jsonl replaced by ``change(rng, record)`` (a JSON value, or bytes)."""

    def apply(rng: random.Random, d: Path) -> tuple[str, tuple[str, ...]]:
        lines = (d / "data.jsonl").read_bytes().split(b"\n")
        at = rng.choice([i for i, line in enumerate(lines) if line.strip()])
        new = change(rng, json.loads(lines[at]))
        lines[at] = new if isinstance(new, bytes) else json.dumps(new).encode()
        (d / "data.jsonl").write_bytes(b"\n".join(lines))
        return f"data.jsonl line {at + 1}: {what} {lines[at][:40]!r}", (f"data.jsonl:{at + 1}",)

    return Mutation(apply, True)


def _wrong_text(rng: random.Random, record: dict) -> dict:
    return record | {"text": rng.choice([5, None, ["a"], {"t": "a"}, True, 2.5])}


def _no_text(rng: random.Random, record: dict) -> dict:
    rest = {k: v for k, v in record.items() if k != "text"}
    return rng.choice([rest, rest | {"txt": record["text"]}, rest | {"prompt": record["text"]}])


def _not_object_line(rng: random.Random, record: dict):
    return rng.choice([[record["text"]], 5, record["text"], None])


def _not_utf8(rng: random.Random, record: dict) -> bytes:
    raw = json.dumps(record).encode()
    at = rng.randrange(raw.index(b'"text"') + 9, len(raw) - 1)
    if rng.random() < 0.2:  # valid JSON, but a lone surrogate has no UTF-8 bytes
        at = raw.index(b'"text"') + 9
        return raw[:at] + b"\\ud800" + raw[at:]
    return raw[:at] + rng.choice([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x80\x80"]) + raw[at:]


JSONL = Reader(
    "jsonl",
    _build_jsonl,
    lambda d: _read_data(d / "data.jsonl"),
    _jsonl_reference,
    {
        "truncate": truncate("data.jsonl", detectable=False),
        "flip": flip("data.jsonl"),
        "wrong_type": _jsonl_line(_wrong_text, "text of the wrong type"),
        "missing_text": _jsonl_line(_no_text, "no text field"),
        "not_object": _jsonl_line(
            lambda rng, r: rng.choice([[r["text"]], 5, r["text"], None]), "not an object"
        ),
        "not_utf8": _jsonl_line(_not_utf8, "not UTF-8"),
    },
)


def _write_parquet(path: Path, columns: dict) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), path, row_group_size=3)


def _parquet_reference(d: Path) -> list[str]:
    import pyarrow.parquet as pq

    return _texts(pq.read_table(io.BytesIO((d / "data.parquet").read_bytes())).to_pylist())


def _parquet_columns(rng: random.Random, d: Path) -> tuple[str, tuple[str, ...]]:
    """data.parquet rewritten with its text column of the wrong type, or without one."""
    n = len(DATA_TEXTS)
    texts = rng.choice([list(range(n)), [[t] for t in DATA_TEXTS], [{"t": t} for t in DATA_TEXTS],
                        [*DATA_TEXTS[:-1], None], [float(i) for i in range(n)]])  # fmt: skip
    name = rng.choice(["text", "txt", "body", "prompt"])
    columns = {name: texts if name == "text" else DATA_TEXTS, "id": list(range(n))}
    _write_parquet(d / "data.parquet", columns)
    return f"data.parquet: column {name!r} = {columns[name][:2]!r}...", ("data.parquet",)


PARQUET = Reader(
    "parquet",
    lambda d: _write_parquet(d / "data.parquet", {"text": DATA_TEXTS, "id": list(range(len(DATA_TEXTS)))}),
    lambda d: _read_data(d / "data.parquet"),
    _parquet_reference,
    {
        "truncate": truncate("data.parquet"),
        "flip": flip("data.parquet"),
        "columns": Mutation(_parquet_columns, True),
    },
)


READERS = {r.name: r for r in (SAFETENSORS, TORCH_BIN, CONFIG, TOKENIZER, JSONL, PARQUET, ORBAX)}
"""Every reader under test, by name."""
