"""Tokenizers: byte-level, or a checkpoint's own through the Rust ``tokenizers`` library.

Call path: ``tokenizer_for(model_dir)`` (``_source``: which tokenizer a model directory
names) calls ``load_tokenizer`` (``_load``: ``tokenizer.json`` and its config files) for a
``Tokenizer``, or returns a ``ByteTokenizer`` (both in ``_tokenizers``, with the chat
template); ``_files`` lists and copies the tokenizer's files next to converted weights.
"""

from jaxckpt.data.tokenizer._files import TOKENIZER_FILES, copy_tokenizer_files, tokenizer_files
from jaxckpt.data.tokenizer._load import load_tokenizer
from jaxckpt.data.tokenizer._source import BYTES, tokenizer_for, tokenizer_name
from jaxckpt.data.tokenizer._tokenizers import ByteTokenizer, Tokenizer

__all__ = [
    "BYTES",
    "TOKENIZER_FILES",
    "ByteTokenizer",
    "Tokenizer",
    "copy_tokenizer_files",
    "load_tokenizer",
    "tokenizer_files",
    "tokenizer_for",
    "tokenizer_name",
]
