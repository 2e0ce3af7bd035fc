"""Streamed record readers: ``.jsonl``, ``.json``, ``.parquet`` and ``.txt`` files (or a
directory of one of them), one ``(record, where, position)`` at a time.

Library choice: pyarrow for parquet (streamed by row group) and the stdlib ``json``
module line by line for JSON Lines. Reading lines ourselves gives exact ``file:line``
errors and the byte offset of every record, so ``start=position`` resumes with one
``seek``; a parquet file resumes by skipping whole row groups through their metadata.

A ``position`` is a small JSON-able dict: ``{"file": i, ...}`` with ``i`` the index of the
file in the sorted directory (0 for a single file) and the format's own keys:

=================  ==========================  =========================================
format             position keys               ``where``
=================  ==========================  =========================================
``.jsonl``         ``offset`` (bytes), ``line`` ``"f.jsonl:7"`` (1-based line)
``.txt`` by line   ``offset`` (bytes), ``line`` ``"f.txt:5"`` (1-based line)
``.txt`` by file   ``offset`` (bytes)          ``"f.txt"``
``.json``          ``record`` (index)          ``"f.json:record 3"`` (0-based index)
``.parquet``       ``row`` (index)             ``"f.parquet:row 12"`` (0-based index)
=================  ==========================  =========================================

The position yielded with a record is the position *after* it: ``read_records(path,
start=position)`` yields the records that follow it, and reads nothing before them.
"""

import codecs
import json
import os
from collections.abc import Iterator
from pathlib import Path

from jaxckpt.data._example import DataError

_PARQUET_BATCH_ROWS = 1024
"""Rows turned into Python records at a time (pyarrow reads one row group at a time)."""


def _check_object(record, where: str) -> dict:
    if not isinstance(record, dict):
        raise DataError(f"{where}: a record must be a JSON object, got {type(record).__name__}")
    return record


def _lines(file: Path, start: dict, *, bom: bool = False) -> Iterator[tuple[bytes, str, dict]]:
    """The non-blank lines of ``file`` from ``start``'s byte offset: ``(raw line, "file:line",
    position after it)``; ``bom``: a UTF-8 byte-order mark before the first line is dropped."""
    offset, line = start.get("offset", 0), start.get("line", 0)
    with open(file, "rb") as f:
        f.seek(offset)
        for raw in f:
            offset += len(raw)
            line += 1
            if bom and line == 1 and raw.startswith(codecs.BOM_UTF8):
                raw = raw[len(codecs.BOM_UTF8) :]
            if raw.strip():
                yield raw, f"{file}:{line}", {"offset": offset, "line": line}


def _read_jsonl(file: Path, start: dict, _per_line: bool) -> Iterator[tuple[dict, str, dict]]:
    for raw, where, position in _lines(file, start):
        try:  # decoded first: json.loads(bytes) would let UTF-8-encoded surrogates through
            record = json.loads(raw.decode("utf-8"))
        except json.JSONDecodeError as err:
            raise DataError(f"{where}: not JSON ({err.msg}, column {err.colno})") from None
        except UnicodeDecodeError as err:
            raise DataError(f"{where}: not UTF-8 ({err.reason} at byte {err.start} of the line)") from None
        except (ValueError, RecursionError) as err:  # an int of over 4300 digits; nesting too deep
            raise DataError(f"{where}: not JSON ({type(err).__name__}: {err})") from None
        yield _check_object(record, where), where, position


def _decode(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"{where}: not UTF-8 text ({err.reason} at byte {err.start})") from None


def _read_text_lines(file: Path, start: dict) -> Iterator[tuple[dict, str, dict]]:
    for raw, where, position in _lines(file, start, bom=True):
        yield {"text": _decode(raw, where).rstrip("\r\n")}, where, position


def _read_txt(file: Path, start: dict, per_line: bool) -> Iterator[tuple[dict, str, dict]]:
    if per_line:
        yield from _read_text_lines(file, start)
        return
    if start.get("offset", 0) > 0:
        return
    raw = file.read_bytes()
    if raw:
        yield {"text": _decode(raw.removeprefix(codecs.BOM_UTF8), str(file))}, str(file), {"offset": len(raw)}


def _json_records(data, file: Path) -> list:
    if isinstance(data, list):
        return data
    lists = [key for key, value in data.items() if isinstance(value, list)] if isinstance(data, dict) else []
    if len(lists) != 1:
        got = f"an object with list fields {lists}" if isinstance(data, dict) else type(data).__name__
        raise DataError(
            f"{file}: expected a JSON array of records or an object with one list field, got {got}"
        )
    return data[lists[0]]


def _read_json(file: Path, start: dict, _per_line: bool) -> Iterator[tuple[dict, str, dict]]:
    try:
        with open(file, "rb") as f:
            data = json.load(f)
    except json.JSONDecodeError as err:
        hint = "; for one record per line, name the file .jsonl" if err.msg == "Extra data" else ""
        raise DataError(
            f"{file}: not JSON ({err.msg} at line {err.lineno} column {err.colno}){hint}"
        ) from None
    except UnicodeDecodeError as err:
        raise DataError(f"{file}: not UTF-8 ({err.reason})") from None
    records = _json_records(data, file)
    for index in range(start.get("record", 0), len(records)):
        where = f"{file}:record {index}"
        yield _check_object(records[index], where), where, {"record": index + 1}


def _first_row_group(metadata, row: int) -> tuple[int, int]:
    """The row group holding ``row``, and the index of its first row."""
    group, first = 0, 0
    while group < metadata.num_row_groups and first + metadata.row_group(group).num_rows <= row:
        first += metadata.row_group(group).num_rows
        group += 1
    return group, first


def _parquet_batches(file: Path, row: int):
    """Record batches from ``row`` on, one row group read at a time.

    ``read_row_group`` checks each column chunk as ``pq.read_table`` does (a chunk's stored type
    or value count against the schema's); ``iter_batches`` does not. Nothing here reads a
    column chunk's metadata from Python: in pyarrow 26 a corrupt one (a level histogram of the
    wrong size) throws through a binding that does not catch it, and the process aborts.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(file)
        start, first = _first_row_group(parquet.metadata, row)
        skip = row - first
        for group in range(start, parquet.metadata.num_row_groups):
            table = parquet.read_row_group(group)
            yield from _skip_rows(table.to_batches(max_chunksize=_PARQUET_BATCH_ROWS), skip)
            skip = 0  # row is inside the first group read
    except DataError:
        raise
    except (pa.ArrowException, OSError, UnicodeDecodeError) as err:  # (bad UTF-8 in its metadata)
        raise DataError(f"{file}: not a readable parquet file ({_first_line(err)})") from None


def _first_line(err: Exception) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def _skip_rows(batches, skip: int):
    for batch in batches:
        if skip >= batch.num_rows:
            skip -= batch.num_rows
            continue
        yield batch.slice(skip)
        skip = 0


def _records_of(batch, file: Path, row: int) -> list[dict]:
    import pyarrow as pa

    try:
        return batch.to_pylist()
    except UnicodeDecodeError as err:  # a string column's bytes are checked only here
        raise DataError(f"{file}:row {row}+: not UTF-8 text ({err.reason})") from None
    except (pa.ArrowException, ValueError) as err:
        raise DataError(f"{file}:row {row}+: not a readable parquet file ({_first_line(err)})") from None


def _read_parquet(file: Path, start: dict, _per_line: bool) -> Iterator[tuple[dict, str, dict]]:
    row = start.get("row", 0)
    for batch in _parquet_batches(file, row):
        for record in _records_of(batch, file, row):
            where = f"{file}:row {row}"
            row += 1
            yield record, where, {"row": row}


_FORMATS = {".json": _read_json, ".jsonl": _read_jsonl, ".parquet": _read_parquet, ".txt": _read_txt}
"""File suffix -> reader of one file: ``(file, start, text_per_line) -> (record, where, position)``."""

_POSITION_KEYS = {".json": ("record",), ".jsonl": ("offset", "line"), ".parquet": ("row",)}
"""Suffix -> the keys of a position inside one file (``.txt``: ``_txt_keys``)."""

SUPPORTED_SUFFIXES = tuple(sorted(_FORMATS))
"""The file suffixes ``read_records`` reads."""


def _txt_keys(per_line: bool) -> tuple[str, ...]:
    return ("offset", "line") if per_line else ("offset",)


def _files(path, name: str) -> tuple[list[Path], str]:
    """The files of ``path`` (itself, or a directory's supported files, sorted) and their suffix."""
    if isinstance(path, bool) or not isinstance(path, str | os.PathLike):
        raise TypeError(f"read_records: {name} must be a str or an os.PathLike, got {type(path).__name__}")
    path = Path(path)
    supported = ", ".join(SUPPORTED_SUFFIXES)
    if not path.exists():
        raise FileNotFoundError(
            f"{name}={str(path)!r} does not exist; give a {supported} file or a directory"
        )
    if not path.is_dir():
        suffix = path.suffix.lower()
        if suffix not in _FORMATS:
            raise DataError(
                f"{name}={str(path)!r}: unsupported suffix {suffix or '(none)'!r}; supported: {supported}"
            )
        return [path], suffix
    files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in _FORMATS)
    files = [p for p in files if not p.name.startswith(".")]
    suffixes = sorted({p.suffix.lower() for p in files})
    if not files:
        raise DataError(f"{name}={str(path)!r} is a directory with no {supported} file")
    if len(suffixes) > 1:
        raise DataError(
            f"{name}={str(path)!r} mixes formats ({', '.join(suffixes)}); put one format per directory"
        )
    return files, suffixes[0]


def _check_start(start, keys: tuple[str, ...], n_files: int) -> tuple[int, dict]:
    """``start`` -> (index of its file, the position inside that file)."""
    if start is None:
        return 0, {}
    expected = {"file", *keys}
    ok = isinstance(start, dict) and set(start) == expected
    ok = ok and all(isinstance(start[k], int) and not isinstance(start[k], bool) for k in expected)
    if not ok or not 0 <= start["file"] < n_files or min(start.values()) < 0:
        raise ValueError(
            f"read_records: start={start!r} is not a position of this data: expected a dict of "
            f"non-negative ints with keys {sorted(expected)}, 'file' < {n_files}, as read_records yields"
        )
    return start["file"], {k: start[k] for k in keys}


def read_records(
    path, *, text_per_line: bool = False, start: dict | None = None, name: str = "data"
) -> Iterator[tuple[dict, str, dict]]:
    """Streams the records of a data file or directory as ``(record, where, position)``.

    ``.jsonl`` is read line by line (blank lines skipped), ``.parquet`` row group by row
    group; a ``.json`` file (a JSON array of records, or an object with one list field such
    as ``{"data": [...]}``) is loaded whole. A ``.txt`` file is one document,
    ``{"text": <the file>}`` (read whole; an empty file gives none), or with ``text_per_line``
    one document per non-empty line (streamed, without its line break). A directory is read
    as its files with one supported suffix, sorted by name (files whose name starts with
    ``.`` and other suffixes are left out).

    Args:
        path: a file or a directory of files of one format.
        text_per_line: ``.txt`` only: one document per non-empty line instead of per file.
        start: a position this function yielded: continue with the record after it,
            without reading what came before. None: from the beginning.
        name: the argument name errors give ``path`` under.

    Returns:
        An iterator of ``(record, where, position)``: the record (a dict), where it is
        (``"f.jsonl:7"``, ``"f.parquet:row 12"``, ``"f.json:record 3"``, ``"f.txt"``), and
        the position after it (see the module docstring for its keys).

    Raises:
        FileNotFoundError: if ``path`` does not exist (``data='x.jsonl' does not exist``).
        TypeError: if ``path`` is not a str or an ``os.PathLike``.
        ValueError: if ``start`` is not a position of this data.
        DataError: at once for an unsupported suffix or a directory mixing formats; while
            reading for a line that is not JSON or UTF-8, a record that is not a JSON object,
            a parquet file pyarrow cannot read, or (without ``start``) data with no record.

    Example:
        >>> import tempfile
        >>> f = Path(tempfile.mkdtemp()) / "d.jsonl"
        >>> _ = f.write_text('{"text": "a"}\\n\\n{"text": "b"}\\n{"text": "c"}\\n')
        >>> rows = list(read_records(f))
        >>> [(r["text"], w.split(":")[-1], p) for r, w, p in rows[:2]]
        [('a', '1', {'file': 0, 'offset': 14, 'line': 1}), ('b', '3', {'file': 0, 'offset': 29, 'line': 3})]
        >>> [r["text"] for r, _, _ in read_records(f, start=rows[0][2])]
        ['b', 'c']
    """
    files, suffix = _files(path, name)
    keys = _txt_keys(text_per_line) if suffix == ".txt" else _POSITION_KEYS[suffix]
    first, inside = _check_start(start, keys, len(files))
    return _stream(
        files, _FORMATS[suffix], first, inside, text_per_line, empty_error=start is None, what=(name, path)
    )


def _stream(files, read, first, inside, per_line, *, empty_error, what):
    found = False
    for index in range(first, len(files)):
        for record, where, position in read(files[index], inside if index == first else {}, per_line):
            found = True
            yield record, where, {"file": index, **position}
    if empty_error and not found:
        name, path = what
        raise DataError(f"{name}={str(path)!r}: no records (the data set is empty)")
