"""Streamed record readers: every format, where each record is, exact resume positions, errors."""

import json
import subprocess
import sys
import tracemalloc

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jaxckpt.data import SUPPORTED_SUFFIXES, DataError, read_records

RECORDS = [{"text": f"doc {i}", "n": i} for i in range(11)]


def _jsonl(path, records, blank_every=3):
    lines = []
    for i, record in enumerate(records):
        lines.append(json.dumps(record))
        if i % blank_every == 1:
            lines.append("")  # blank lines are skipped but counted
    path.write_text("\n".join(lines) + "\n")
    return path


def _parquet(path, records, row_group_size=3):
    pq.write_table(pa.Table.from_pylist(records), path, row_group_size=row_group_size)
    return path


def _resumes_exactly(path, **kw):
    """Every position resumes at the record after it; the last one yields nothing."""
    items = list(read_records(path, **kw))
    for k, (_, _, position) in enumerate(items):
        json.dumps(position)  # JSON-able
        rest = list(read_records(path, start=json.loads(json.dumps(position)), **kw))
        assert rest == items[k + 1 :]
    return items


def test_jsonl_records_where_and_positions(tmp_path):
    f = _jsonl(tmp_path / "d.jsonl", RECORDS)
    items = _resumes_exactly(f)
    assert [r for r, _, _ in items] == RECORDS
    text = f.read_text().split("\n")
    for record, where, position in items:
        line = int(where.rsplit(":", 1)[1])
        assert where == f"{f}:{line}" and json.loads(text[line - 1]) == record
        assert position["line"] == line and position["file"] == 0
        assert position["offset"] == len("\n".join(text[:line]).encode()) + 1  # after the line's newline


def test_jsonl_resume_reads_nothing_before_its_position(tmp_path):
    f = _jsonl(tmp_path / "d.jsonl", RECORDS)
    items = list(read_records(f))
    position = items[6][2]
    raw = f.read_bytes()
    f.write_bytes(b"#" * position["offset"] + raw[position["offset"] :])  # garbage before: never read
    assert [r for r, _, _ in read_records(f, start=position)] == RECORDS[7:]
    with pytest.raises(DataError, match=r"d\.jsonl:1: not JSON"):
        list(read_records(f))


def test_jsonl_without_final_newline_and_crlf(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_bytes(b'{"a": 1}\r\n\r\n{"a": 2}')
    assert [(r, w) for r, w, _ in read_records(f)] == [({"a": 1}, f"{f}:1"), ({"a": 2}, f"{f}:3")]


def test_json_array_and_object_with_one_list_field(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(RECORDS[:5]))
    b.write_text(json.dumps({"version": 3, "data": RECORDS[:5]}))
    for f in (a, b):
        items = _resumes_exactly(f)
        assert [r for r, _, _ in items] == RECORDS[:5]
        assert [w for _, w, _ in items] == [f"{f}:record {i}" for i in range(5)]
        assert items[2][2] == {"file": 0, "record": 3}


def test_parquet_streams_by_row_group_and_resumes(tmp_path, monkeypatch):
    records = [{"text": f"t{i}", "turns": [{"role": "user", "content": str(i)}]} for i in range(11)]
    f = _parquet(tmp_path / "d.parquet", records, row_group_size=3)
    items = _resumes_exactly(f)
    assert [r for r, _, _ in items] == records
    assert [w for _, w, _ in items][:2] == [f"{f}:row 0", f"{f}:row 1"]
    assert items[7][2] == {"file": 0, "row": 8}
    asked = []
    original = pq.ParquetFile.read_row_group

    def spy(self, group, *args, **kw):
        asked.append(group)
        return original(self, group, *args, **kw)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", spy)
    assert [r["text"] for r, _, _ in read_records(f, start=items[7][2])] == ["t8", "t9", "t10"]
    assert asked == [2, 3]  # row 8 is in group 2 (rows 6..8): groups 0 and 1 are never read


def test_txt_one_document_per_file_or_per_line(tmp_path):
    f = tmp_path / "d.txt"
    f.write_text("first line\n\n  \nsecond\r\nthird")
    [(record, where, position)] = read_records(f)
    assert record == {"text": "first line\n\n  \nsecond\r\nthird"} and where == str(f)
    assert list(read_records(f, start=position)) == []
    items = _resumes_exactly(f, text_per_line=True)
    assert [(r["text"], w) for r, w, _ in items] == [
        ("first line", f"{f}:1"),
        ("second", f"{f}:4"),
        ("third", f"{f}:5"),
    ]


def test_directory_is_its_files_sorted_and_resumes_by_file(tmp_path):
    for name, text in [("b.txt", "bee"), ("a.txt", "ay"), ("c.txt", ""), ("README.md", "no")]:
        (tmp_path / name).write_text(text)
    items = _resumes_exactly(tmp_path)
    assert [(r["text"], w) for r, w, _ in items] == [
        ("ay", str(tmp_path / "a.txt")),
        ("bee", str(tmp_path / "b.txt")),
    ]
    assert items[0][2] == {"file": 0, "offset": 2}  # an empty file has no document
    parts = tmp_path / "parts"
    parts.mkdir()
    _jsonl(parts / "p1.jsonl", RECORDS[5:])
    _jsonl(parts / "p0.jsonl", RECORDS[:5])
    items = _resumes_exactly(parts)
    assert [r for r, _, _ in items] == RECORDS and items[5][2]["file"] == 1


def test_errors_name_the_file_and_line(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"a": 1}\n\n{"a": 2,\n')
    with pytest.raises(DataError, match=r"^.*bad\.jsonl:3: not JSON \(Expecting property name"):
        list(read_records(f))
    f.write_text('{"a": 1}\n[1, 2]\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2: a record must be a JSON object, got list$"):
        list(read_records(f))
    f.write_bytes(b'{"a": "\xff"}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:1: not UTF-8"):
        list(read_records(f))
    t = tmp_path / "bad.txt"
    t.write_bytes(b"ok\nnot \xc3(\n")
    with pytest.raises(DataError, match=r"bad\.txt:2: not UTF-8 text"):
        list(read_records(t, text_per_line=True))
    j = tmp_path / "lines.json"
    j.write_text('{"a": 1}\n{"a": 2}\n')
    with pytest.raises(
        DataError, match=r"lines\.json: not JSON \(Extra data at line 2 column 1\); .*\.jsonl"
    ):
        list(read_records(j))
    j.write_text('{"a": [1], "b": [2]}')
    with pytest.raises(DataError, match=r"lines\.json: expected a JSON array .* list fields \['a', 'b'\]"):
        list(read_records(j))
    j.write_text("[1]")
    with pytest.raises(DataError, match=r"lines\.json:record 0: a record must be a JSON object, got int"):
        list(read_records(j))


def test_path_and_format_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"^data='.*x\.jsonl' does not exist"):
        read_records(tmp_path / "x.jsonl")
    with pytest.raises(FileNotFoundError, match=r"^eval_data='"):
        read_records(tmp_path / "x.jsonl", name="eval_data")
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(
        DataError, match=r"d\.csv'.*unsupported suffix '\.csv'; supported: \.json, \.jsonl, \.parquet, \.txt"
    ):
        read_records(tmp_path / "d.csv")
    assert SUPPORTED_SUFFIXES == (".json", ".jsonl", ".parquet", ".txt")
    with pytest.raises(DataError, match=r"is a directory with no \.json, \.jsonl, \.parquet, \.txt file"):
        read_records(tmp_path)
    (tmp_path / "a.txt").write_text("x")
    (tmp_path / "b.jsonl").write_text("{}\n")
    with pytest.raises(DataError, match=r"mixes formats \(\.jsonl, \.txt\); put one format per directory"):
        read_records(tmp_path)
    with pytest.raises(TypeError, match=r"data must be a str or an os\.PathLike"):
        read_records(3)


def test_corrupt_parquet_and_empty_data(tmp_path):
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"PAR1 this is not really parquet")
    with pytest.raises(DataError, match=r"bad\.parquet: not a readable parquet file \("):
        list(read_records(bad))
    good = _parquet(tmp_path / "cut.parquet", RECORDS)
    good.write_bytes(good.read_bytes()[:-30])  # footer damaged
    with pytest.raises(DataError, match=r"cut\.parquet: not a readable parquet file"):
        list(read_records(good))
    for name, content in [("e.jsonl", "\n\n"), ("e.json", "[]"), ("e.txt", "")]:
        (tmp_path / name).write_text(content)
        with pytest.raises(DataError, match=rf"^data='.*{name}': no records"):
            list(read_records(tmp_path / name))
    empty = _parquet(tmp_path / "e.parquet", [])
    with pytest.raises(DataError, match=r"e\.parquet': no records"):
        list(read_records(empty))


def test_bad_start_is_a_value_error(tmp_path):
    f = _jsonl(tmp_path / "d.jsonl", RECORDS)
    for start in [
        {"file": 0, "row": 3},
        {"file": 1, "offset": 0, "line": 0},
        {"file": 0, "offset": -1, "line": 0},
        5,
    ]:
        with pytest.raises(
            ValueError, match=r"start=.* is not a position of this data.*\['file', 'line', 'offset'\]"
        ):
            read_records(f, start=start)


def test_a_large_jsonl_is_streamed(tmp_path):
    f = tmp_path / "big.jsonl"
    line = json.dumps({"text": "x" * 1000}) + "\n"
    f.write_text(line * 12_000)  # 12 MB
    tracemalloc.start()
    try:
        reader = read_records(f)
        first = [next(reader) for _ in range(5)]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert first[-1][2] == {"file": 0, "offset": 5 * len(line), "line": 5}
    assert peak < 300_000, peak  # a whole-file read would be 12 MB


_EVERY_FLIP = """
import sys
from pathlib import Path
from jaxckpt.data import DataError, read_records

pristine = Path(sys.argv[1]).read_bytes()
bad = Path(sys.argv[2])
errors = 0
for at in range(len(pristine)):
    for mask in (0x01, 0x2B, 0x80):
        data = bytearray(pristine)
        data[at] ^= mask
        bad.write_bytes(bytes(data))
        try:
            list(read_records(bad))
        except DataError:
            errors += 1
print(errors)
"""


@pytest.mark.slow
def test_no_single_byte_flip_of_a_parquet_file_aborts_the_process(tmp_path):
    """pyarrow 26 aborts the process (an uncaught C++ exception) when Python reads the metadata
    of a column chunk whose level histogram has the wrong size: one flipped byte makes one.
    Each flip of each byte, three ways, read in a child process: one that aborts fails here
    instead of taking the test worker down. (A flip may leave a file pyarrow reads.)"""
    records = [{"text": f"document {i}", "id": i} for i in range(7)]
    f = _parquet(tmp_path / "d.parquet", records, row_group_size=3)
    child = subprocess.run(
        [sys.executable, "-c", _EVERY_FLIP, str(f), str(tmp_path / "bad.parquet")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert child.returncode == 0, child.stderr[-2000:]
    assert int(child.stdout.split()[-1]) > f.stat().st_size  # most flips are caught
