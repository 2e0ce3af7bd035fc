"""The batch stream: windowed shuffle, epochs, exact resume, lazy tokenizing, eval split, stats."""

import itertools
import json
import tracemalloc

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jaxckpt.data import DataError, Example, PackedBatches
from jaxckpt.data._holdout import held_out

STRIDE = 10_000  # record i holds the tokens i * STRIDE + 0, 1, 2, ...
LENGTHS = [5, 1, 9, 3, 17, 2, 0, 8, 30, 4, 6, 11, 3, 1, 7, 13, 2, 5, 9, 21, 3, 6, 4]  # 23 records


def tokenize(record, where):
    """The stand-in tokenizer: record "i n p" -> n tokens i*STRIDE + k, targets from position p."""
    i, n, p = map(int, record["text"].split())
    return Example(np.arange(i * STRIDE, i * STRIDE + n, dtype=np.int32), np.arange(n) >= p)


def _texts(lengths):
    """Record i: a prompt of i % 3 tokens (at most n - 1, so each record of 2 tokens or more
    has a target; ``test_pieces_without_a_target_are_left_out_and_counted`` has the rest)."""
    return [f"{i} {n} {min(i % 3, max(n - 1, 0))}" for i, n in enumerate(lengths)]


def _write(tmp_path, lengths=LENGTHS, fmt="jsonl"):
    texts = _texts(lengths)
    path = tmp_path / f"d.{fmt}"
    if fmt == "jsonl":
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    elif fmt == "json":
        path.write_text(json.dumps({"rows": [{"text": t} for t in texts]}))
    elif fmt == "parquet":
        pq.write_table(pa.table({"text": texts}), path, row_group_size=4)
    else:
        path.write_text("\n".join(texts) + "\n")
    return path


def _stream(path, n, **kw):
    kw = {"batch": 2, "seq": 7, "seed": 3, "shuffle_buffer": 5} | kw
    return list(itertools.islice(PackedBatches(path, tokenize, **kw).iterate(), n))


def _same(a, b):
    return all(np.array_equal(x, y) and x.dtype == y.dtype for x, y in zip(a, b, strict=True))


def _pieces(batches):
    """(record, offset of the first token) of every segment, in stream order."""
    out = []
    for b in batches:
        seq = b.inputs.shape[-1]
        for inputs, seg in zip(b.inputs.reshape(-1, seq), b.segment_ids.reshape(-1, seq), strict=True):
            out += [divmod(int(inputs[np.argmax(seg == s)]), STRIDE) for s in range(1, int(seg.max()) + 1)]
    return out


@pytest.mark.parametrize("fmt, micro", [("jsonl", 1), ("parquet", 3), ("json", 1), ("txt", 2)])
def test_resume_is_exact_across_windows_and_epochs(tmp_path, fmt, micro):
    path = _write(tmp_path, fmt=fmt)
    kw = {"micro_batches": micro, "text_per_line": fmt == "txt"}
    run = _stream(path, 70 // micro, **kw)
    states = [s for _, s in run]
    assert states[-1]["stats"]["epochs"] >= 2
    assert any(s["piece"] > 0 for s in states) and any(s["window"] > 0 for s in states)
    data = PackedBatches(path, tokenize, batch=2, seq=7, seed=3, shuffle_buffer=5, **kw)
    for k in range(len(run) - 3):
        resumed = list(itertools.islice(data.iterate(json.loads(json.dumps(states[k]))), 3))
        for (b, s), (b2, s2) in zip(resumed, run[k + 1 : k + 4], strict=True):
            assert _same(b, b2) and s == s2
        assert len(json.dumps(states[k])) < 700  # positions and counts, no tokens


def test_resume_reads_nothing_before_its_window(tmp_path):
    path = _write(tmp_path, LENGTHS * 2)
    run = _stream(path, 40)
    k = next(i for i, (_, s) in enumerate(run) if s["window"] >= 3 and s["epoch"] == 0)
    offset = run[k][1]["start"]["offset"]
    raw = path.read_bytes()
    path.write_bytes(b"#" * offset + raw[offset:])  # unreadable before the window
    rest = sum(s["epoch"] == 0 for _, s in run[k + 1 :])
    data = PackedBatches(path, tokenize, batch=2, seq=7, seed=3, shuffle_buffer=5)
    resumed = list(itertools.islice(data.iterate(run[k][1]), rest))
    assert rest > 3 and all(_same(b, b2) for (b, _), (b2, _) in zip(resumed, run[k + 1 :], strict=False))


def test_resume_with_another_batch_size_continues_the_rows(tmp_path):
    path = _write(tmp_path)
    run = _stream(path, 30)
    rows = np.concatenate([b.inputs.reshape(-1, 7) for b, _ in run])
    data = PackedBatches(path, tokenize, batch=3, seq=7, seed=3, shuffle_buffer=5)
    more = np.concatenate([b.inputs.reshape(-1, 7) for b, _ in itertools.islice(data.iterate(run[4][1]), 5)])
    np.testing.assert_array_equal(more, rows[10:25])


def test_tokenizes_lazily(tmp_path):
    path = _write(tmp_path, [5] * 301)
    calls = []
    counting = lambda record, where: calls.append(where) or tokenize(record, where)
    data = PackedBatches(path, counting, batch=1, seq=7, shuffle_buffer=101)
    stream = data.iterate()
    next(stream)
    _, state = next(stream)
    assert len(calls) == 3  # a row (4 of 7 slots) per batch, and the piece in hand
    calls.clear()
    next(data.iterate(state))
    assert len(calls) == 2


def test_shuffle_follows_the_seed_windows_keep_file_order(tmp_path):
    usable = [i for i, n in enumerate(LENGTHS) if n >= 2]
    per_epoch = sum(-(-(LENGTHS[i] - 1) // 7) for i in usable)
    path = _write(tmp_path)
    run = [b for b, _ in _stream(path, 60)]
    pieces = _pieces(run)
    assert len(pieces) > 2 * per_epoch
    epochs = [pieces[:per_epoch], pieces[per_epoch : 2 * per_epoch]]
    for epoch in epochs:
        assert sorted(epoch) == sorted((i, p * 7) for i in usable for p in range(-(-(LENGTHS[i] - 1) // 7)))
        records = list(dict.fromkeys(i for i, _ in epoch))  # in order of first appearance
        windows = [[i for i in usable if i // 5 == w] for w in range(5)]
        chunks = list(itertools.accumulate(len(w) for w in windows))
        assert [set(records[a:b]) for a, b in zip([0, *chunks], chunks, strict=False)] == [
            set(w) for w in windows
        ]
    assert epochs[0] != epochs[1] and records != usable  # shuffled, anew each epoch
    assert all(_same(a, b) for a, b in zip(run, [b for b, _ in _stream(path, 60)], strict=True))
    assert not all(_same(a, b) for a, b in zip(run, [b for b, _ in _stream(path, 60, seed=4)], strict=True))
    in_order = _pieces([b for b, _ in _stream(path, 20, shuffle_buffer=1)])
    assert [i for i, _ in in_order[:per_epoch]] == sorted(i for i, _ in in_order[:per_epoch])


def test_stats_count_what_was_delivered(tmp_path):
    path = _write(tmp_path)
    data = PackedBatches(path, tokenize, batch=2, seq=7, seed=3, shuffle_buffer=1, micro_batches=3)
    run = list(itertools.islice(data.iterate(), 17))
    stats, state = data.stats, run[-1][1]
    batches = [b for b, _ in run]
    pieces = _pieces(batches)
    slots = sum(b.segment_ids.size for b in batches)
    filled = sum(int((b.segment_ids > 0).sum()) for b in batches)
    short = [i for i, n in enumerate(LENGTHS) if n < 2]
    passed_short = len(short) * stats["epochs"] + sum(i < state["window"] for i in short)
    firsts = [i for i, offset in pieces if offset == 0]
    assert stats == {
        **state["stats"],
        "packing_efficiency": filled / slots,
        "padded_efficiency": filled / (len(pieces) * 7),
        "epoch": state["epoch"],
    }
    assert stats["epochs"] >= 1 and stats["batches"] == 17 and stats["rows"] == 17 * 6
    assert stats["tokens"] == sum(float(b.weights.sum()) for b in batches)
    assert stats["filled"] == filled and stats["padding"] == slots - filled and stats["pieces"] == len(pieces)
    assert stats["skipped_short"] == passed_short and stats["documents"] == len(firsts) + passed_short
    assert stats["split_documents"] == sum(LENGTHS[i] - 1 > 7 for i in firsts)
    assert stats["extra_pieces"] == len(pieces) - len(firsts) and stats["heldout_records"] == 0
    assert stats["packing_efficiency"] > stats["padded_efficiency"]


def test_eval_split_is_disjoint_deterministic_and_padded(tmp_path):
    lengths = LENGTHS * 2
    path = _write(tmp_path, lengths)
    usable = {i for i, n in enumerate(lengths) if n >= 2}
    data = PackedBatches(path, tokenize, batch=3, seq=7, seed=5, shuffle_buffer=5, eval_fraction=0.3)
    held = [b for b in data.eval_batches()]
    eval_records = [i for i, offset in _pieces(held) if offset == 0]
    assert eval_records == sorted(eval_records)  # one pass in file order
    assert (
        all(b.inputs.shape == (1, 3, 7) for b in held)
        and not held[-1].weights[held[-1].segment_ids == 0].any()
    )
    state = next(s for _, s in data.iterate() if s["epoch"] > 0)  # epoch 0 passed
    train = {i for i, _ in _pieces([b for b, s in _stream(path, 60, seed=5, eval_fraction=0.3, batch=3)])}
    assert train.isdisjoint(eval_records) and train | set(eval_records) == usable
    want = {i for i in range(len(lengths)) if held_out(5, i, 1, 0.3)[0]}
    assert set(eval_records) == want & usable and 0.15 < len(want) / len(lengths) < 0.45
    assert len(want) <= state["stats"]["heldout_records"] <= len(want) + 5  # + epoch 1's first window
    again = PackedBatches(path, tokenize, batch=3, seq=7, seed=5, shuffle_buffer=17, eval_fraction=0.3)
    assert all(_same(a, b) for a, b in zip(held, again.eval_batches(), strict=True))
    other = PackedBatches(path, tokenize, batch=3, seq=7, seed=6, eval_fraction=0.3)
    assert {i for i, o in _pieces(other.eval_batches()) if o == 0} != set(eval_records)


def test_eval_of_a_separate_file_is_every_record_once(tmp_path):
    path = _write(tmp_path, LENGTHS[:9])
    data = PackedBatches(path, tokenize, batch=2, seq=5, seed=1)
    batches = list(data.eval_batches())
    assert [i for i, o in _pieces(batches) if o == 0] == [i for i, n in enumerate(LENGTHS[:9]) if n >= 2]
    assert (batches[-1].segment_ids[0, -1] == 0).all() and not batches[-1].weights[0, -1].any()  # padding row
    targets = sum(n - max(min(i % 3, n - 1), 1) for i, n in enumerate(LENGTHS[:9]) if n >= 2)  # k >= prompt
    assert sum(float(b.weights.sum()) for b in batches) == targets
    stats = data.eval_stats
    assert stats["tokens"] == targets and stats["documents"] == 9 and stats["skipped_short"] == 2
    assert stats["rows"] == 2 * len(batches) and stats["pieces"] == len(_pieces(batches))
    assert stats["padding"] == sum(int((b.segment_ids == 0).sum()) for b in batches)
    assert data.stats["batches"] == 0  # training counts apart


def test_argument_and_data_errors(tmp_path):
    path = _write(tmp_path)
    make = lambda **kw: PackedBatches(path, tokenize, **{"batch": 2, "seq": 7} | kw)
    for kw, match in [
        ({"seq": 0}, r"seq=0 must be positive"),
        ({"batch": 0}, r"batch=0 must be positive"),
        ({"micro_batches": 0}, r"micro_batches=0 must be positive"),
        ({"seed": -1}, r"seed=-1 must be >= 0"),
        ({"shuffle_buffer": 0}, r"shuffle_buffer=0 must be positive"),
        ({"eval_fraction": 0.0}, r"eval_fraction=0.0 must lie strictly between 0 and 1"),
        ({"eval_fraction": 1}, r"eval_fraction=1 must lie strictly between 0 and 1"),
    ]:
        with pytest.raises(ValueError, match=rf"^PackedBatches: {match}"):
            make(**kw)
    for kw, match in [
        ({"seed": 1.5}, r"seed=1\.5 must be an int"),
        ({"eval_fraction": "0.1"}, "eval_fraction='0.1'"),
    ]:
        with pytest.raises(TypeError, match=match):
            make(**kw)
    with pytest.raises(
        TypeError, match=r"d\.jsonl:\d+: expected an Example \(ids, loss_mask\), got NoneType"
    ):
        next(PackedBatches(path, lambda record, where: None, batch=1, seq=3).iterate())
    with pytest.raises(TypeError, match="tokenize must be callable"):
        PackedBatches(path, None, batch=1, seq=3)
    with pytest.raises(FileNotFoundError, match=r"^data='.*nope\.jsonl' does not exist"):
        PackedBatches(tmp_path / "nope.jsonl", tokenize, batch=1, seq=3)
    _, state = next(make().iterate())
    with pytest.raises(ValueError, match=r"state was saved with .*'seq': 7.* this stream has .*'seq': 5"):
        make(seq=5).iterate(state)
    with pytest.raises(ValueError, match=r"state must be a state iterate yielded"):
        make().iterate({"epoch": 0})


def test_no_usable_record_is_a_data_error(tmp_path):
    short = _write(tmp_path, [1, 0, 1])
    with pytest.raises(
        DataError, match=r"d\.jsonl': no record the stream trains on: every record is held out"
    ):
        next(PackedBatches(short, tokenize, batch=1, seq=3).iterate())
    one = _write(tmp_path, [5])
    seed_in = next(s for s in range(100) if held_out(s, 0, 1, 0.5)[0])
    seed_out = next(s for s in range(100) if not held_out(s, 0, 1, 0.5)[0])
    with pytest.raises(DataError, match=r"no record the stream trains on with eval_fraction=0\.5"):
        next(PackedBatches(one, tokenize, batch=1, seq=3, seed=seed_in, eval_fraction=0.5).iterate())
    with pytest.raises(DataError, match=r"no record the stream evaluates on with eval_fraction=0\.5"):
        list(PackedBatches(one, tokenize, batch=1, seq=3, seed=seed_out, eval_fraction=0.5).eval_batches())
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "0 3 0"}\nnot json\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2: not JSON"):
        next(PackedBatches(bad, tokenize, batch=1, seq=3).iterate())


def test_first_batch_of_a_large_file_reads_only_its_window(tmp_path):
    path = tmp_path / "big.jsonl"
    path.write_text(
        "".join(json.dumps({"text": f"{i} 300 0", "pad": "x" * 1000}) + "\n" for i in range(12_000))
    )
    data = PackedBatches(path, tokenize, batch=2, seq=7, shuffle_buffer=64)
    tracemalloc.start()
    try:
        batch, state = next(data.iterate())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert state["window"] == 0 and batch.inputs.shape == (1, 2, 7)
    assert peak < 1_000_000, peak  # the file is 12 MB; a window of 64 records ~ 70 kB


def test_pieces_without_a_target_are_left_out_and_counted(tmp_path):
    """A piece with no weighted target (the head of a long prompt, a record that is all
    prompt) adds nothing to the loss: it is not packed, and the stats count it."""
    path = tmp_path / "d.jsonl"
    texts = ["0 20 17", "1 4 4", "2 6 1"]  # 3 pieces, the first two without target; none; one
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    data = PackedBatches(path, tokenize, batch=1, seq=7, shuffle_buffer=1)
    stream = data.iterate()
    first = next(stream)[0]  # record 0's last piece; records 1 and 2 read to close the row
    stats = data.stats
    assert stats["skipped_pieces"] == 3 and stats["skipped_no_target"] == 1
    batches = [first, next(stream)[0]]
    assert _pieces(batches) == [(0, 14), (2, 0)]
    assert all(float(b.weights.sum()) > 0 for b in batches)
