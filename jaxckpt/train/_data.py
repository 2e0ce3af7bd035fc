"""Byte-level training data: the shipped corpus and random windows of it, tokenized by
``jaxckpt.data.ByteTokenizer`` (the one byte tokenizer).

Every token is one byte of UTF-8, so the vocabulary is ``VOCAB_SIZE = 256`` and any text
file is a valid corpus. ``ByteBatches`` draws the batch for a step from a generator seeded
with ``(seed, step)`` alone, so a run resumed at step ``s`` sees exactly the batches an
uninterrupted run would have seen.
"""

import os
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

import numpy as np

from jaxckpt.data import ByteTokenizer

_BYTES = ByteTokenizer()
"""The one byte tokenizer (``jaxckpt.data``); ``encode`` and ``decode`` are its functions."""

VOCAB_SIZE = ByteTokenizer.vocab_size
"""Size of the byte-level vocabulary: one token per possible byte value."""


def encode(text: str) -> np.ndarray:
    """The UTF-8 bytes of ``text`` as an int32 token array (``data.ByteTokenizer().encode``).

    Args:
        text: any string; non-ASCII characters become several tokens.

    Returns:
        A 1-D ``int32`` array with values in ``[0, VOCAB_SIZE)``.

    Raises:
        TypeError: if ``text`` is not a ``str``.

    Example:
        >>> encode("Hi!").tolist()
        [72, 105, 33]
        >>> encode("é").tolist()
        [195, 169]
    """
    return _BYTES.encode(text)


def decode(tokens) -> str:
    """The text whose UTF-8 bytes are ``tokens``; invalid byte sequences become U+FFFD
    (``data.ByteTokenizer().decode``).

    Args:
        tokens: a 1-D array-like of integers in ``[0, VOCAB_SIZE)`` (e.g. model samples).

    Returns:
        The decoded string.

    Raises:
        TypeError: if ``tokens`` does not hold integers.
        ValueError: if ``tokens`` is not 1-D or holds a value outside ``[0, VOCAB_SIZE)``.

    Example:
        >>> decode(encode("café"))
        'café'
        >>> decode([104, 105, 255]) == "hi" + chr(0xFFFD)
        True
    """
    arr = np.asarray(tokens)
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"decode: tokens must be integers, got dtype {arr.dtype}")
    return _BYTES.decode(arr)


def default_corpus_path() -> Path:
    """Path of the corpus shipped with the package (an excerpt of Shakespeare's plays).

    Example:
        >>> p = default_corpus_path()
        >>> p.name, p.is_file()
        ('shakespeare.txt', True)
    """
    return Path(str(files("jaxckpt.train") / "data" / "shakespeare.txt"))


def load_tokens(path: str | os.PathLike | None = None, *, name: str = "path") -> np.ndarray:
    """Reads a text file as byte tokens.

    Args:
        path: the text file; None reads the shipped corpus (``default_corpus_path()``).
        name: the argument name errors give ``path`` under (``train`` passes ``"data"``).

    Returns:
        A 1-D ``int32`` array of the file's bytes.

    Raises:
        TypeError: if ``path`` is not a str, an ``os.PathLike`` or None.
        FileNotFoundError: if ``path`` does not exist.
        ValueError: if ``path`` is a directory or an empty file.

    Example:
        >>> tokens = load_tokens()
        >>> decode(tokens[:14])
        'First Citizen:'
    """
    if path is None:
        path = default_corpus_path()
    elif not isinstance(path, str | os.PathLike):
        raise TypeError(
            f"load_tokens: {name} must be a str, an os.PathLike or None, got {type(path).__name__}"
        )
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{name}={str(path)!r} does not exist; give a text file")
    if path.is_dir():
        raise ValueError(f"{name}={str(path)!r} is a directory; give a text file")
    data = path.read_bytes()
    if not data:
        raise ValueError(f"{name}={str(path)!r} is an empty file; give a non-empty text file")
    return np.frombuffer(data, dtype=np.uint8).astype(np.int32)


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"ByteBatches: {name}={value!r} must be an int, got {type(value).__name__}")
    if value < minimum:
        qualifier = "positive" if minimum == 1 else f">= {minimum}"
        raise ValueError(f"ByteBatches: {name}={value!r} must be {qualifier}")


@dataclass(frozen=True, eq=False)
class ByteBatches:
    """Random windows of ``seq + 1`` consecutive tokens, a pure function of ``(seed, step)``.

    Each row is an input of ``seq`` tokens followed by its last next-token target, so a
    model reads ``row[:-1]`` and predicts ``row[1:]``.

    Args:
        tokens: the 1-D integer corpus (e.g. from ``load_tokens``); at least ``seq + 2`` long.
        batch: rows per micro-batch.
        seq: tokens each row feeds the model.
        seed: a non-negative int; with the step it fixes every batch.
        micro_batches: micro-batches per step (gradient accumulation).

    Raises:
        TypeError: if ``tokens`` is not a 1-D integer array, or a size is not an int.
        ValueError: if a size is not positive or the corpus is shorter than ``seq + 2``.

    Example:
        >>> data = ByteBatches(np.arange(100, dtype=np.int32), batch=2, seq=4, seed=0)
        >>> data.batch_at(0).shape
        (1, 2, 5)
        >>> bool((data.batch_at(3) == data.batch_at(3)).all())
        True
    """

    tokens: np.ndarray
    batch: int
    seq: int
    seed: int = 0
    micro_batches: int = 1

    def __post_init__(self):
        tokens = np.asarray(self.tokens)
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise TypeError(
                "ByteBatches: tokens must be a 1-D integer array, "
                f"got shape {tokens.shape} dtype {tokens.dtype}"
            )
        _check_int("batch", self.batch, 1)
        _check_int("seq", self.seq, 1)
        _check_int("micro_batches", self.micro_batches, 1)
        _check_int("seed", self.seed, 0)
        if len(tokens) < self.seq + 2:
            raise ValueError(
                f"ByteBatches: seq={self.seq} needs a corpus of at least seq + 2 = {self.seq + 2} tokens, "
                f"got {len(tokens)}; use a smaller seq or a longer text"
            )
        object.__setattr__(self, "tokens", tokens.astype(np.int32, copy=False))

    def batch_at(self, step: int) -> np.ndarray:
        """The batch for ``step``: an int32 array of shape ``[micro_batches, batch, seq + 1]``.

        Args:
            step: a non-negative int; equal steps (and seeds) give equal batches.

        Raises:
            TypeError: if ``step`` is not an int.
            ValueError: if ``step`` is negative.

        Example:
            >>> data = ByteBatches(np.arange(50, dtype=np.int32), batch=1, seq=3, micro_batches=2)
            >>> b = data.batch_at(5)
            >>> b.shape, bool((b[..., 1:] - b[..., :-1] == 1).all())
            ((2, 1, 4), True)
        """
        if isinstance(step, bool) or not isinstance(step, int | np.integer):
            raise TypeError(f"ByteBatches.batch_at: step must be an int, got {type(step).__name__}")
        if step < 0:
            raise ValueError(f"ByteBatches.batch_at: step must be >= 0, got {step}")
        rng = np.random.default_rng([int(self.seed), int(step)])
        starts = rng.integers(0, len(self.tokens) - self.seq, size=(self.micro_batches, self.batch))
        return self.tokens[starts[..., None] + np.arange(self.seq + 1)]
