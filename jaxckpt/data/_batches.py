"""The training batch stream: streamed records, a windowed shuffle, epochs, packing, an exact
resume state, running statistics, and a held-out evaluation split.

Shuffle: records are read in file order in windows of ``shuffle_buffer`` consecutive records
(default 4096); each window is permuted by ``np.random.default_rng([seed, epoch, window])``
and tokenized lazily, one record at a time. This is a local shuffle: windows keep their
file order, so data sorted by topic or length should be shuffled once beforehand. When the
data runs out a new epoch starts, with new permutations: the stream never ends.

Resume: every batch comes with the state right after it, a small JSON-able dict::

    {"epoch": 0, "window": 3, "start": <read_records position where window 3 starts, or None>,
     "record": 17, "piece": 1, "config": {...}, "stats": {...}}

the next piece to pack is piece ``piece`` of the record at index ``record`` of the
window's permutation. ``iterate(state)`` re-reads that window from ``start`` (one seek),
re-tokenizes only the records it needs, and continues with exactly the batches the
uninterrupted stream would have given. ``config`` holds what the state's meaning depends
on (seq, seed, shuffle_buffer, eval_fraction, text_per_line) and is checked on resume; the
batch size may change (rows do not depend on it).
"""

import itertools
from collections.abc import Callable, Iterator

import numpy as np

from jaxckpt.data._example import DataError, Example
from jaxckpt.data._holdout import check_fraction, held_out
from jaxckpt.data._packing import PackedBatch, check_size, pack_pieces, split_document
from jaxckpt.data._readers import read_records

DEFAULT_SHUFFLE_BUFFER = 4096
"""Records per shuffle window of ``PackedBatches``: the records tokenized and held at a time."""

_COUNTS = (
    "documents",
    "skipped_short",
    "skipped_no_target",
    "skipped_pieces",
    "split_documents",
    "extra_pieces",
    "heldout_records",
    "pieces",
    "tokens",
    "filled",
    "padding",
    "rows",
    "batches",
    "epochs",
)
"""The running counts of a stream (``PackedBatches.stats``)."""

_CURSOR = ("epoch", "window", "start", "record", "piece")


def summarize(counts: dict, seq: int) -> dict:
    """The counts of a stream with its efficiencies: ``packing_efficiency`` (non-padding
    slots / slots) and ``padded_efficiency`` (the same if every piece had a row of its own).

    Example:
        >>> c = dict.fromkeys(_COUNTS, 0) | {"pieces": 3, "filled": 12, "rows": 2}
        >>> s = summarize(c, 8)
        >>> s["packing_efficiency"], s["padded_efficiency"]
        (0.75, 0.5)
    """
    slots = counts["rows"] * seq
    packing = counts["filled"] / slots if slots else 0.0
    padded = counts["filled"] / (counts["pieces"] * seq) if counts["pieces"] else 0.0
    return {**counts, "packing_efficiency": packing, "padded_efficiency": padded}


def _count_piece(counts: dict, piece: Example, index: int, n_pieces: int) -> None:
    counts["pieces"] += 1
    counts["filled"] += piece.ids.size - 1
    counts["tokens"] += int(np.count_nonzero(piece.loss_mask[1:]))
    if index == 0:
        counts["documents"] += 1
        counts["split_documents"] += n_pieces > 1
    else:
        counts["extra_pieces"] += 1


class PackedBatches:
    """Packed training batches of a data file, shuffled, endless and exactly resumable.

    Args:
        path: a ``.jsonl``, ``.json``, ``.parquet`` or ``.txt`` file, or a directory of them
            (``read_records``).
        tokenize: ``(record, where) -> Example``: a record's tokens and loss mask.
        batch: rows per micro-batch (B).
        seq: slots per row (T); longer documents are split (``split_document``).
        micro_batches: micro-batches per batch (M).
        seed: a non-negative int; fixes the shuffle and the held-out records.
        shuffle_buffer: records per shuffle window (1: file order).
        eval_fraction: None, or the fraction in (0, 1) of records held out: the training
            stream skips them and ``eval_batches`` gives them. Each record is held out or
            not by a hash of ``(seed, its index in file order)``.
        text_per_line: ``.txt`` only: a document per non-empty line.
        name: the argument name errors give ``path`` under.

    Raises:
        TypeError / ValueError: for a bad size, seed or fraction (naming it).
        FileNotFoundError / DataError: for a missing path or unsupported suffix (at once),
            and bad records or data with no usable record (while iterating).

    Example:
        >>> import tempfile
        >>> from pathlib import Path
        >>> f = Path(tempfile.mkdtemp()) / "d.jsonl"
        >>> _ = f.write_text("".join(f'{{"text": "{"ab" * n}"}}\\n' for n in range(1, 9)))
        >>> def tokenize(record, where):
        ...     ids = np.frombuffer(record["text"].encode(), np.uint8).astype(np.int32)
        ...     return Example(ids, np.ones(ids.size, bool))
        >>> data = PackedBatches(f, tokenize, batch=2, seq=7, seed=1, shuffle_buffer=3)
        >>> stream = data.iterate()
        >>> [next(stream) for _ in range(3)][-1][0].inputs.shape
        (1, 2, 7)
        >>> batch, state = next(stream)
        >>> again, _ = next(data.iterate(state))
        >>> bool((again.inputs == next(stream)[0].inputs).all()), data.stats["epochs"]
        (True, 0)
    """

    def __init__(
        self,
        path,
        tokenize: Callable[[dict, str], Example],
        *,
        batch: int,
        seq: int,
        micro_batches: int = 1,
        seed: int = 0,
        shuffle_buffer: int = DEFAULT_SHUFFLE_BUFFER,
        eval_fraction: float | None = None,
        text_per_line: bool = False,
        name: str = "data",
    ):
        if not callable(tokenize):
            raise TypeError(f"PackedBatches: tokenize must be callable, got {type(tokenize).__name__}")
        self.batch = check_size("PackedBatches", "batch", batch, 1)
        self.seq = check_size("PackedBatches", "seq", seq, 1)
        self.micro_batches = check_size("PackedBatches", "micro_batches", micro_batches, 1)
        self.seed = check_size("PackedBatches", "seed", seed, 0)
        self.shuffle_buffer = check_size("PackedBatches", "shuffle_buffer", shuffle_buffer, 1)
        self.eval_fraction = check_fraction("PackedBatches", "eval_fraction", eval_fraction)
        self.path, self.tokenize, self.text_per_line, self.name = path, tokenize, bool(text_per_line), name
        read_records(path, text_per_line=self.text_per_line, name=name)  # a missing path fails now
        self._counts, self._eval_counts = dict.fromkeys(_COUNTS, 0), dict.fromkeys(_COUNTS, 0)
        self._epoch = 0

    @property
    def config(self) -> dict:
        """What a state's meaning depends on; ``iterate(state)`` checks it.

        Example:
            >>> import tempfile
            >>> from pathlib import Path
            >>> f = Path(tempfile.mkdtemp()) / "d.txt"
            >>> _ = f.write_text("hi")
            >>> PackedBatches(f, lambda record, where: None, batch=1, seq=3, seed=7).config
            {'seq': 3, 'seed': 7, 'shuffle_buffer': 4096, 'eval_fraction': None, 'text_per_line': False}
        """
        keys = ("seq", "seed", "shuffle_buffer", "eval_fraction", "text_per_line")
        return {key: getattr(self, key) for key in keys}

    @property
    def stats(self) -> dict:
        """The running counts as of the latest batch ``iterate`` gave (``summarize``), and
        ``epoch``, the epoch (from 0) the next batch starts in. The counts: ``documents``
        (read and tokenized, ``skipped_short`` of them with fewer than two tokens and
        ``skipped_no_target`` with no token in the loss), ``skipped_pieces`` (pieces of a split
        document with no target, e.g. the head of a long prompt: left out),
        ``split_documents`` and the ``extra_pieces`` they made, ``heldout_records``,
        ``pieces``, ``tokens`` (targets of weight 1), ``filled`` and ``padding`` slots,
        ``rows``, ``batches`` and ``epochs`` (passes finished). They continue across a resume.

        Example:
            >>> import tempfile
            >>> from pathlib import Path
            >>> f = Path(tempfile.mkdtemp()) / "d.txt"
            >>> _ = f.write_text("hello")
            >>> tok = lambda r, w: Example(np.arange(len(r["text"]), dtype=np.int32), np.ones(5, bool))
            >>> data = PackedBatches(f, tok, batch=1, seq=3)
            >>> _ = next(data.iterate())
            >>> s = data.stats
            >>> s["documents"], s["split_documents"], s["tokens"], s["packing_efficiency"]
            (1, 1, 3, 1.0)
        """
        return {**summarize(self._counts, self.seq), "epoch": self._epoch}

    def iterate(self, state: dict | None = None) -> Iterator[tuple[PackedBatch, dict]]:
        """The endless stream of ``(batch, state)``, from the start or from ``state``.

        Args:
            state: a state a previous ``iterate`` yielded (JSON round trips are fine).

        Returns:
            An iterator of ``(PackedBatch [M, B, T], state after it)``.

        Raises:
            ValueError: if ``state`` is not a state of this stream or its config differs.
            DataError: while iterating, for bad records, or data whose every record is held
                out or too short.

        Example:
            >>> import tempfile, json
            >>> from pathlib import Path
            >>> f = Path(tempfile.mkdtemp()) / "d.txt"
            >>> _ = f.write_text("abcdefghij")
            >>> tok = lambda r, w: Example(np.arange(10, dtype=np.int32), np.ones(10, bool))
            >>> data = PackedBatches(f, tok, batch=1, seq=4)
            >>> (b, state), (b2, _) = itertools.islice(data.iterate(), 2)
            >>> b.inputs.tolist(), b2.inputs.tolist()
            ([[[0, 1, 2, 3]]], [[[4, 5, 6, 7]]])
            >>> next(data.iterate(json.loads(json.dumps(state))))[0].inputs.tolist()
            [[[4, 5, 6, 7]]]
        """
        cursor, counts = self._resume(state)
        return self._iterate(cursor, counts)

    def _resume(self, state) -> tuple[dict, dict]:
        if state is None:
            return dict(zip(_CURSOR, (0, 0, None, 0, 0), strict=True)), dict.fromkeys(_COUNTS, 0)
        expected = {*_CURSOR, "config", "stats"}
        if not isinstance(state, dict) or set(state) != expected or set(state["stats"]) != set(_COUNTS):
            raise ValueError(
                "PackedBatches.iterate: state must be a state iterate yielded, with keys "
                f"{sorted(expected)}; got {state!r:.200}"
            )
        if state["config"] != self.config:
            raise ValueError(
                f"PackedBatches.iterate: state was saved with {state['config']}, but this stream has "
                f"{self.config}; resume with the same settings"
            )
        return {key: state[key] for key in _CURSOR}, dict(state["stats"])

    def _packed(self, pieces, counts: dict):
        """``pack_pieces`` over ``pieces``, counting each batch's rows and padding."""
        rows = self.batch * self.micro_batches
        for batch, filled, at in pack_pieces(
            pieces, batch=self.batch, seq=self.seq, micro_batches=self.micro_batches
        ):
            counts["rows"] += rows
            counts["padding"] += rows * self.seq - filled
            counts["batches"] += 1
            yield batch, at

    def _iterate(self, cursor: dict, counts: dict):
        for batch, at in self._packed(self._pieces(cursor, counts), counts):
            self._counts, self._epoch = dict(counts), at["epoch"]
            yield batch, {**at, "config": self.config, "stats": dict(counts)}

    def _windows(self, start):
        """The windows of records from ``start``: lists of ``(record, where, position)``."""
        reader = read_records(self.path, text_per_line=self.text_per_line, start=start, name=self.name)
        while records := list(itertools.islice(reader, self.shuffle_buffer)):
            yield records
            if len(records) < self.shuffle_buffer:
                return

    def _pieces(self, cursor: dict, counts: dict):
        """``(piece, cursor at it)`` without end; counts what it passes (a piece once placed)."""
        epoch, window, start, record, piece = (cursor[key] for key in _CURSOR)
        while True:
            fresh, produced = window == record == piece == 0, False
            for records in self._windows(start):
                order = np.random.default_rng([self.seed, epoch, window]).permutation(len(records))
                held = held_out(self.seed, window * self.shuffle_buffer, len(records), self.eval_fraction)
                for index in range(record, len(records)):
                    i = int(order[index])
                    if held[i]:
                        counts["heldout_records"] += 1
                        continue
                    pieces = self._split(records[i], counts)
                    for p in range(piece, len(pieces)):
                        yield (
                            pieces[p],
                            {"epoch": epoch, "window": window, "start": start, "record": index, "piece": p},
                        )
                        _count_piece(counts, pieces[p], p, len(pieces))
                        produced = True
                    piece = 0
                record, window, start = 0, window + 1, records[-1][2]
            if fresh and not produced:
                raise DataError(self._nothing("trains on"))
            epoch, window, start, counts["epochs"] = epoch + 1, 0, None, counts["epochs"] + 1

    def _split(self, item: tuple, counts: dict) -> list[Example]:
        """The pieces of a record that have a target: a piece with none (the head of a long
        prompt) adds nothing to the loss, since no other piece attends to it, so it is left
        out and counted in ``skipped_pieces``."""
        record, where, _ = item
        pieces = split_document(self.tokenize(record, where), self.seq, where=where)
        kept = [piece for piece in pieces if piece.loss_mask[1:].any()]
        counts["skipped_pieces"] += len(pieces) - len(kept)
        if not kept:
            counts["documents"] += 1
            counts["skipped_short" if not pieces else "skipped_no_target"] += 1
        return kept

    def _nothing(self, what: str) -> str:
        held = f" with eval_fraction={self.eval_fraction}" if self.eval_fraction is not None else ""
        return (
            f"{self.name}={str(self.path)!r}: no record the stream {what}{held}: every record is "
            "held out, has fewer than two tokens or no token in the loss"
        )

    def eval_batches(self) -> Iterator[PackedBatch]:
        """One pass, in file order and unshuffled, over the held-out records (every record
        when ``eval_fraction`` is None: build a ``PackedBatches`` on a separate eval file).

        Batches have the training shape ``[M, B, T]``; the last is padded with rows of weight
        0. ``eval_stats`` counts the pass as ``stats`` counts training (documents of fewer
        than two tokens are counted in ``skipped_short``). Held-out records are spread over
        the whole data, so a full pass reads all of it; ``itertools.islice`` bounds it.

        Raises:
            DataError: for bad records, or no held-out record with a target.

        Example:
            >>> import tempfile
            >>> from pathlib import Path
            >>> f = Path(tempfile.mkdtemp()) / "d.txt"
            >>> _ = f.write_text("abc\\ndefg\\nh\\n")
            >>> def tok(record, where):
            ...     n = len(record["text"])
            ...     return Example(np.arange(n, dtype=np.int32), np.ones(n, bool))
            >>> data = PackedBatches(f, tok, batch=2, seq=4, text_per_line=True)
            >>> [float(b.weights.sum()) for b in data.eval_batches()]
            [5.0]
            >>> data.eval_stats["documents"], data.eval_stats["skipped_short"], data.eval_stats["rows"]
            (3, 1, 2)
        """
        counts = dict.fromkeys(_COUNTS, 0)
        self._eval_counts = counts
        for batch, _ in self._packed(self._eval_pieces(counts), counts):
            yield batch
        if not counts["pieces"]:
            raise DataError(self._nothing("evaluates on"))

    @property
    def eval_stats(self) -> dict:
        """The counts of the latest ``eval_batches`` pass so far (``summarize``), as ``stats``.

        Example:
            >>> import tempfile
            >>> from pathlib import Path
            >>> f = Path(tempfile.mkdtemp()) / "d.txt"
            >>> _ = f.write_text("abcdef")
            >>> tok = lambda r, w: Example(np.arange(6, dtype=np.int32), np.ones(6, bool))
            >>> data = PackedBatches(f, tok, batch=3, seq=4)
            >>> _ = list(data.eval_batches())
            >>> data.eval_stats["tokens"], data.eval_stats["packing_efficiency"]
            (5, 0.4166666666666667)
        """
        return summarize(self._eval_counts, self.seq)

    def _eval_pieces(self, counts: dict):
        for window, records in enumerate(self._windows(None)):
            held = held_out(self.seed, window * self.shuffle_buffer, len(records), self.eval_fraction)
            for i, item in enumerate(records):
                if self.eval_fraction is not None and not held[i]:
                    continue
                pieces = self._split(item, counts)
                for p, piece in enumerate(pieces):
                    yield piece, None
                    _count_piece(counts, piece, p, len(pieces))
