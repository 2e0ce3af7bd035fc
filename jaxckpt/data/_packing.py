"""Documents -> packed rows: greedy, in order, with segment ids and positions per piece.

A document of ``n`` tokens gives ``n - 1`` next-token slots: inputs ``ids[:-1]``, targets
``ids[1:]``, weights ``loss_mask[1:]``. A document longer than ``seq + 1`` tokens is cut
into pieces of at most ``seq + 1`` tokens that overlap by one token, so every target is
predicted exactly once; each piece is its own segment, with positions from 0 (a
continuation does not see the context of the pieces before it). Documents of fewer than
two tokens have no slot and make no piece (``PackedBatches`` counts them).

A row takes pieces in order while they fit in its ``seq`` slots, is then padded, and the
next piece starts the next row. A target is always the next token of its own piece, so
no slot predicts across a document (or piece) boundary.
"""

from collections.abc import Iterable, Iterator
from typing import NamedTuple

import numpy as np

from jaxckpt.data._example import Example


class PackedBatch(NamedTuple):
    """One step's packed rows, each field ``[M, B, T]`` (M micro-batches of B rows of T = seq).

    Attributes:
        inputs: ``int32``: the tokens the model reads (0 on padding).
        targets: ``int32``: the next token of each input (0 on padding).
        weights: ``float32``: 1 on a target that counts in the loss, 0 on padding and on
            masked targets (e.g. a prompt's tokens).
        segment_ids: ``int32``: 1, 2, 3, ... for the pieces of a row, 0 on padding
            (attention stays inside a segment).
        positions: ``int32``: 0, 1, ... inside each piece, 0 on padding.

    Example:
        >>> docs = [Example(np.arange(1, 5, dtype=np.int32), np.ones(4, bool))]
        >>> b = next(pack_documents(docs, batch=1, seq=5))
        >>> b.inputs[0, 0].tolist(), b.targets[0, 0].tolist(), b.segment_ids[0, 0].tolist()
        ([1, 2, 3, 0, 0], [2, 3, 4, 0, 0], [1, 1, 1, 0, 0])
    """

    inputs: np.ndarray
    targets: np.ndarray
    weights: np.ndarray
    segment_ids: np.ndarray
    positions: np.ndarray


def _as_example(example, where: str) -> Example:
    if not isinstance(example, tuple) or len(example) != 2:
        raise TypeError(f"{where}: expected an Example (ids, loss_mask), got {type(example).__name__}")
    ids, mask = np.asarray(example[0]), np.asarray(example[1])
    if ids.ndim != 1 or mask.shape != ids.shape:
        raise ValueError(
            f"{where}: ids and loss_mask must be 1-D of one length, got {ids.shape} and {mask.shape}"
        )
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
        raise TypeError(f"{where}: ids must be integers, got dtype {ids.dtype}")
    return Example(ids.astype(np.int32, copy=False), mask.astype(bool, copy=False))


def split_document(example: Example, seq: int, *, where: str = "document") -> list[Example]:
    """The pieces of one document: at most ``seq + 1`` tokens each, overlapping by one.

    Args:
        example: the tokenized document.
        seq: the slots of a row; a piece of ``k`` tokens takes ``k - 1`` of them.
        where: names the document in errors.

    Returns:
        ``ceil((n - 1) / seq)`` pieces for a document of ``n >= 2`` tokens (piece ``p`` holds
        tokens ``[p * seq, p * seq + seq + 1)``); an empty list for ``n < 2``.

    Raises:
        ValueError: if ``ids`` and ``loss_mask`` differ in shape or are not 1-D.
        TypeError: if ``example`` is not an ``(ids, loss_mask)`` pair or ``ids`` are not integers.

    Example:
        >>> ex = Example(np.arange(8, dtype=np.int32), np.ones(8, bool))
        >>> [p.ids.tolist() for p in split_document(ex, 3)]
        [[0, 1, 2, 3], [3, 4, 5, 6], [6, 7]]
    """
    ids, mask = _as_example(example, where)
    if ids.size < 2:
        return []
    return [Example(ids[s : s + seq + 1], mask[s : s + seq + 1]) for s in range(0, ids.size - 1, seq)]


class _Rows:
    """The ``rows`` rows of one batch being filled, piece by piece."""

    def __init__(self, rows: int, seq: int):
        self.seq, self.rows = seq, rows
        self.ints = np.zeros((4, rows, seq), np.int32)  # inputs, targets, segment_ids, positions
        self.weights = np.zeros((rows, seq), np.float32)
        self.row = self.col = self.segment = self.filled = 0

    @property
    def full(self) -> bool:
        return self.row == self.rows

    def fits(self, piece: Example) -> bool:
        return self.col + piece.ids.size - 1 <= self.seq

    def next_row(self) -> None:
        self.row, self.col, self.segment = self.row + 1, 0, 0

    def put(self, piece: Example) -> None:
        """Writes ``piece`` after the row's last one (the caller checked that it ``fits``)."""
        n, r, c = piece.ids.size - 1, self.row, self.col
        self.segment += 1
        self.ints[0, r, c : c + n] = piece.ids[:-1]
        self.ints[1, r, c : c + n] = piece.ids[1:]
        self.ints[2, r, c : c + n] = self.segment
        self.ints[3, r, c : c + n] = np.arange(n, dtype=np.int32)
        self.weights[r, c : c + n] = piece.loss_mask[1:]
        self.col += n
        self.filled += n

    def batch(self, micro_batches: int) -> PackedBatch:
        shape = (micro_batches, self.rows // micro_batches, self.seq)
        inputs, targets, segment_ids, positions = (a.reshape(shape) for a in self.ints)
        return PackedBatch(inputs, targets, self.weights.reshape(shape), segment_ids, positions)


def check_size(owner: str, name: str, value, minimum: int) -> int:
    """``value`` as an int ``>= minimum``, or a TypeError / ValueError naming ``name``.

    Example:
        >>> check_size("f", "seq", 5, 1)
        5
    """
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{owner}: {name}={value!r} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(
            f"{owner}: {name}={value!r} must be {'positive' if minimum == 1 else f'>= {minimum}'}"
        )
    return int(value)


def pack_pieces(items: Iterable[tuple[Example, object]], *, batch: int, seq: int, micro_batches: int = 1):
    """Greedy packing of ready pieces (each at most ``seq + 1`` tokens), tagged, into batches.

    Args:
        items: ``(piece, tag)`` pairs; a tag is anything (``PackedBatches`` gives a resume point).
        batch: rows per micro-batch (B).
        seq: slots per row (T).
        micro_batches: micro-batches per batch (M).

    Returns:
        An iterator of ``(PackedBatch, filled, tag)``: ``filled`` the non-padding slots of the
        batch, ``tag`` the tag of the first piece not in it (None after the last batch,
        which is padded with rows of weight 0). A batch is given out once the piece after
        it is known (the rows close when a piece does not fit).

    Example:
        >>> piece = Example(np.arange(3, dtype=np.int32), np.ones(3, bool))
        >>> out = pack_pieces([(piece, "a"), (piece, "b"), (piece, "c")], batch=1, seq=5)
        >>> [(b.segment_ids[0, 0].tolist(), n, tag) for b, n, tag in out]
        [([1, 1, 2, 2, 0], 4, 'c'), ([1, 1, 0, 0, 0], 2, None)]
    """
    rows = _Rows(batch * micro_batches, seq)
    for piece, tag in items:
        if not rows.fits(piece):
            rows.next_row()
            if rows.full:
                yield rows.batch(micro_batches), rows.filled, tag
                rows = _Rows(batch * micro_batches, seq)
        rows.put(piece)
    if rows.filled:
        yield rows.batch(micro_batches), rows.filled, None


def pack_documents(
    examples: Iterable[Example], *, batch: int, seq: int, micro_batches: int = 1
) -> Iterator[PackedBatch]:
    """Packs a finite sequence of documents into batches, in order; the last batch is padded.

    Documents of fewer than two tokens are left out (they have no target).

    Args:
        examples: the tokenized documents.
        batch: rows per micro-batch (B).
        seq: slots per row (T).
        micro_batches: micro-batches per batch (M).

    Returns:
        An iterator of ``PackedBatch`` of ``[M, B, T]`` arrays.

    Raises:
        TypeError / ValueError: if a size is not a positive int (naming it).

    Example:
        >>> docs = [Example(np.arange(n, dtype=np.int32), np.ones(n, bool)) for n in (4, 9, 1)]
        >>> [b.segment_ids[0, 0].tolist() for b in pack_documents(docs, batch=1, seq=5)]
        [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    """
    for size, value in (("batch", batch), ("seq", seq), ("micro_batches", micro_batches)):
        check_size("pack_documents", size, value, 1)
    pieces = (
        (p, None) for i, ex in enumerate(examples) for p in split_document(ex, seq, where=f"document {i}")
    )
    return (packed for packed, _, _ in pack_pieces(pieces, batch=batch, seq=seq, micro_batches=micro_batches))
