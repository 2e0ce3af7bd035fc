"""What a run trains and evaluates on: byte windows of a text (the presets' default), or a
data file tokenized by the model's tokenizer and packed into rows with segment ids.

``run_data`` picks one. Byte-level text (the built-in corpus, or a ``.txt`` file with the
byte tokenizer) keeps the random windows of ``ByteBatches``: batch ``s`` is a pure
function of ``(seed, s)``. Everything else (``.jsonl``, ``.json``, ``.parquet``, a ``.txt``
read with a checkpoint's tokenizer or ``--text-per-line``) streams through
``jaxckpt.data.PackedBatches``, whose state after each batch is saved with every
checkpoint so that ``resume`` continues on exactly the batches of the uninterrupted run.
"""

import functools
import itertools
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from jaxckpt.data import ByteTokenizer, Example, PackedBatch, PackedBatches, encode_record, pack_documents
from jaxckpt.train._data import ByteBatches, default_corpus_path, load_tokens
from jaxckpt.train._run_config import DataConfig


def _is_bytes_text(path, tokenizer, text_per_line: bool) -> bool:
    if not isinstance(tokenizer, ByteTokenizer) or text_per_line:
        return False
    return path is None or (Path(path).is_file() and Path(path).suffix == ".txt")


class WindowData:
    """Random byte windows of a text (``ByteBatches``); the held-out part, if any, is the
    text's last ``eval_split`` fraction, or ``eval_data``'s bytes, cut into consecutive
    windows of ``seq``."""

    kind = "windows"

    def __init__(self, options: DataConfig, *, batch: int, seq: int, micro_batches: int, seed: int):
        tokens = load_tokens(options.path, name="data")
        held = None
        if options.eval_split is not None:
            cut = len(tokens) - max(int(len(tokens) * options.eval_split), seq + 1)
            tokens, held = tokens[:cut], tokens[cut:]
        elif options.eval_path is not None:
            held = load_tokens(options.eval_path, name="eval_data")
        self.batches = ByteBatches(tokens, batch, seq, seed=seed, micro_batches=micro_batches)
        self._held, self._shape = held, (micro_batches, batch, seq)

    def iterate(self, start: int, state) -> Iterator[tuple[np.ndarray, None]]:
        """``(batch, None)`` for steps ``start, start + 1, ...`` (no state: a batch is a
        function of its step)."""
        return ((self.batches.batch_at(step), None) for step in itertools.count(start))

    def eval_batches(self) -> "Iterator[PackedBatch] | None":
        """Consecutive windows of the held-out bytes as packed batches of one document per
        row (None: nothing held out)."""
        if self._held is None:
            return None
        m, b, seq = self._shape
        n = (len(self._held) - 1) // seq
        ids = self._held[: n * seq + 1]
        docs = [ids[i * seq : (i + 1) * seq + 1] for i in range(n)]
        examples = [Example(d, np.ones(len(d), bool)) for d in docs]
        return iter(pack_documents(examples, batch=b, seq=seq, micro_batches=m))

    @property
    def stats(self) -> dict:
        """No counts for random windows."""
        return {}

    @property
    def eval_stats(self) -> dict:
        """The held-out windows: ``{"tokens"}``."""
        if self._held is None:
            return {}
        seq = self._shape[2]
        return {"tokens": (len(self._held) - 1) // seq * seq}

    @property
    def first(self) -> np.ndarray:
        """A batch of the run's shape (the step compiles for it): step 0's."""
        return self.batches.batch_at(0)


class PackedData:
    """A data file tokenized by the run's tokenizer and packed (``PackedBatches``)."""

    kind = "packed"

    def __init__(self, options, tokenizer, *, batch: int, seq: int, micro_batches: int, seed: int):
        tokenize = functools.partial(_tokenize, tokenizer)
        data = default_corpus_path() if options.path is None else options.path
        sizes = dict(batch=batch, seq=seq, micro_batches=micro_batches, seed=seed)
        self.stream = PackedBatches(
            data,
            tokenize,
            **sizes,
            shuffle_buffer=options.shuffle_buffer,
            eval_fraction=options.eval_split,
            text_per_line=options.text_per_line,
        )
        self._eval = None
        if options.eval_path is not None:
            self._eval = PackedBatches(
                options.eval_path, tokenize, **sizes, text_per_line=options.text_per_line, name="eval_data"
            )
        elif options.eval_split is not None:
            self._eval = self.stream

    def iterate(self, start: int, state) -> Iterator[tuple[PackedBatch, dict]]:
        """``(batch, state after it)`` from ``state`` (None: the stream's start)."""
        return self.stream.iterate(state)

    def eval_batches(self) -> "Iterator[PackedBatch] | None":
        """One pass over the held-out records (None: nothing held out)."""
        return None if self._eval is None else self._eval.eval_batches()

    @property
    def stats(self) -> dict:
        """The stream's counts: documents, split documents, packing efficiency, ..."""
        return self.stream.stats

    @property
    def eval_stats(self) -> dict:
        """The counts of the latest held-out pass."""
        return {} if self._eval is None else self._eval.eval_stats

    @property
    def first(self) -> PackedBatch:
        """The stream's first batch: the step compiles for its shape, and reading it checks
        the data's first window before ``--force`` removes any checkpoint."""
        return next(self.stream.iterate())[0]


def _tokenize(tokenizer, record: dict, where: str):
    return encode_record(record, tokenizer, where=where)


def run_data(options: DataConfig, tokenizer, **sizes) -> "WindowData | PackedData":
    """The run's data: byte windows for byte-level text, else a packed stream.

    Example:
        >>> from jaxckpt.data import ByteTokenizer
        >>> data = run_data(DataConfig(), ByteTokenizer(), batch=2, seq=8, micro_batches=1, seed=0)
        >>> data.kind, data.first.shape
        ('windows', (1, 2, 9))
    """
    if _is_bytes_text(options.path, tokenizer, options.text_per_line):
        return WindowData(options, **sizes)
    return PackedData(options, tokenizer, **sizes)
