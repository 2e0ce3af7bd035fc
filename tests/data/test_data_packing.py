"""Packing: pieces overlap by one token, every target appears once with its mask, segment ids
and positions per piece, padding weighs nothing, no target crosses a document."""

import itertools

import numpy as np
import pytest

from jaxckpt.data import Example, PackedBatch, pack_documents, split_document

STRIDE = 10_000  # document d holds the tokens d * STRIDE + 0, 1, 2, ...


def _docs(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [
        Example(np.arange(d * STRIDE, d * STRIDE + n, dtype=np.int32), rng.random(n) < 0.7)
        for d, n in enumerate(lengths)
    ]


def _stack(batches):
    """The batches' rows as one PackedBatch of ``[rows, T]`` arrays."""
    return PackedBatch(
        *(np.concatenate([f.reshape(-1, f.shape[-1]) for f in field]) for field in zip(*batches, strict=True))
    )


@pytest.mark.parametrize(
    "n, seq, pieces", [(2, 5, 1), (6, 5, 1), (7, 5, 2), (12, 5, 3), (16, 5, 3), (9, 1, 8)]
)
def test_split_document_overlaps_by_one(n, seq, pieces):
    [doc] = _docs([n])
    parts = split_document(doc, seq)
    assert len(parts) == pieces == -(-(n - 1) // seq)
    assert all(2 <= p.ids.size <= seq + 1 for p in parts)
    for a, b in itertools.pairwise(parts):
        assert a.ids[-1] == b.ids[0] and a.ids.size == seq + 1
    np.testing.assert_array_equal(np.concatenate([p.ids[1:] for p in parts]), doc.ids[1:])
    np.testing.assert_array_equal(np.concatenate([p.loss_mask[1:] for p in parts]), doc.loss_mask[1:])


def test_short_documents_have_no_piece():
    assert split_document(Example(np.array([4], np.int32), np.ones(1, bool)), 3) == []
    assert split_document(Example(np.zeros(0, np.int32), np.zeros(0, bool)), 3) == []


def _check_invariants(docs, batches, seq):
    rows = _stack(batches)
    pad = rows.segment_ids == 0
    for field in (rows.inputs, rows.targets, rows.weights, rows.positions):
        assert not field[pad].any()  # padding: 0 everywhere, weight 0
    # slots hold consecutive tokens of one document: no target from another document
    used = ~pad
    assert (rows.targets[used] == rows.inputs[used] + 1).all()
    assert (rows.targets[used] // STRIDE == rows.inputs[used] // STRIDE).all()
    # every target of every document exactly once, with its mask as weight
    got = sorted(zip(rows.targets[used].tolist(), rows.weights[used].tolist(), strict=True))
    want = sorted((int(t), float(m)) for d in docs for t, m in zip(d.ids[1:], d.loss_mask[1:], strict=True))
    assert got == want
    for r in range(rows.inputs.shape[0]):
        _check_row(rows, r, seq)


def _check_row(rows, r, seq):
    seg, pos, inp = rows.segment_ids[r], rows.positions[r], rows.inputs[r]
    n_used = int((seg > 0).sum())
    assert (seg[n_used:] == 0).all()  # padding only at the end
    if n_used == 0:
        return  # a padding row (the last batch only)
    ids = seg[:n_used]
    assert ids[0] == 1 and set(np.diff(ids).tolist()) <= {0, 1}  # 1, 2, 3, ... in order
    for s in range(1, int(ids.max()) + 1):
        where = np.flatnonzero(seg == s)
        np.testing.assert_array_equal(pos[where], np.arange(where.size))  # positions restart at 0
        assert (np.diff(inp[where]) == 1).all()  # one piece: consecutive tokens


@pytest.mark.parametrize("batch, seq, micro", [(3, 7, 1), (1, 5, 3), (2, 11, 2)])
def test_packing_invariants(batch, seq, micro):
    rng = np.random.default_rng(seq)
    docs = _docs(rng.integers(0, 3 * seq, size=29).tolist(), seed=seq)
    batches = list(pack_documents(docs, batch=batch, seq=seq, micro_batches=micro))
    for b in batches:
        assert all(f.shape == (micro, batch, seq) for f in b)
        assert [f.dtype for f in b] == [np.int32, np.int32, np.float32, np.int32, np.int32]
    assert all((b.segment_ids[..., 0] > 0).all() for b in batches[:-1])  # padding rows: last batch only
    _check_invariants([d for d in docs if d.ids.size >= 2], batches, seq)


def _greedy_rows(docs, seq):
    """The reference: each row's pieces (document, piece index), filled greedily in order."""
    rows, row, used = [], [], 0
    for d, doc in enumerate(docs):
        for p, piece in enumerate(split_document(doc, seq)):
            if used + piece.ids.size - 1 > seq:
                rows, row, used = [*rows, row], [], 0
            row, used = [*row, (d, p)], used + piece.ids.size - 1
    return [*rows, row] if row else rows


def test_packing_is_greedy_in_order():
    seq = 7
    docs = _docs([3, 4, 5, 20, 2, 1, 8, 9, 3, 3, 3, 3])
    rows = _stack(pack_documents(docs, batch=5, seq=seq))
    expected = _greedy_rows(docs, seq)
    first_tokens = []
    for r in range(rows.inputs.shape[0]):
        seg = rows.segment_ids[r]
        starts = [
            int(rows.inputs[r][np.flatnonzero(seg == s)[0]]) for s in range(1, int(seg.max(initial=0)) + 1)
        ]
        first_tokens.append(starts)
    want = [[d * STRIDE + p * seq for d, p in row] for row in expected]
    assert first_tokens[: len(want)] == want
    assert all(t == [] for t in first_tokens[len(want) :])  # the last batch's padding rows
    order = [t for row in first_tokens for t in row]
    assert order == sorted(order)  # no reordering


def test_a_long_document_fills_whole_rows_and_continues_in_the_next():
    seq = 5
    [doc] = _docs([13])  # 12 slots: pieces of 5, 5, 2
    b = next(pack_documents([doc], batch=3, seq=seq))
    np.testing.assert_array_equal(b.inputs[0, :, 0], [0, 5, 10])
    np.testing.assert_array_equal(b.segment_ids[0], [[1] * 5, [1] * 5, [1, 1, 0, 0, 0]])
    np.testing.assert_array_equal(b.positions[0, 2], [0, 1, 0, 0, 0])


def test_prompt_tokens_weigh_zero():
    ids = np.arange(1, 8, dtype=np.int32)
    mask = np.array([False, False, False, True, True, True, True])  # prompt 1 2 3, completion 4..7
    b = next(pack_documents([Example(ids, mask)], batch=1, seq=9))
    np.testing.assert_array_equal(b.targets[0, 0], [2, 3, 4, 5, 6, 7, 0, 0, 0])
    np.testing.assert_array_equal(b.weights[0, 0], [0, 0, 1, 1, 1, 1, 0, 0, 0])


def test_packing_errors():
    good = _docs([3])
    for name, kw in [("batch", {"batch": 0}), ("seq", {"seq": 0}), ("micro_batches", {"micro_batches": -1})]:
        with pytest.raises(ValueError, match=rf"pack_documents: {name}=-?\d+ must be positive"):
            pack_documents(good, **{"batch": 1, "seq": 3} | kw)
    with pytest.raises(TypeError, match=r"seq=2\.0 must be an int"):
        pack_documents(good, batch=1, seq=2.0)
    with pytest.raises(ValueError, match=r"document 1: ids and loss_mask must be 1-D of one length"):
        list(pack_documents([good[0], Example(np.arange(3), np.ones(2, bool))], batch=1, seq=3))
    with pytest.raises(TypeError, match=r"document 0: ids must be integers, got dtype float64"):
        list(pack_documents([Example(np.ones(3), np.ones(3, bool))], batch=1, seq=3))
