"""Data: tokenizers (byte-level, or a checkpoint's own through ``tokenizers``), chat
templates, streamed dataset readers, and packing into rows with segment ids.

No model and no training here: ``jaxckpt.train`` feeds these batches to the model.
"""

from jaxckpt.data._example import DataError, Example
from jaxckpt.data.tokenizer import TOKENIZER_FILES, copy_tokenizer_files, tokenizer_files

# >>> tokenizer and chat (helper A1) >>>
# isort: split
from jaxckpt.data._chat import CHAT_ROLES
from jaxckpt.data._records import RECORD_SHAPES, encode_record, record_shape
from jaxckpt.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

# <<< tokenizer and chat <<<

# >>> readers and packing (helper A2) >>>
# isort: split
from jaxckpt.data._batches import DEFAULT_SHUFFLE_BUFFER, PackedBatches
from jaxckpt.data._holdout import check_fraction
from jaxckpt.data._packing import PackedBatch, pack_documents, split_document
from jaxckpt.data._readers import SUPPORTED_SUFFIXES, read_records

# <<< readers and packing <<<

# isort: split
from jaxckpt.data.tokenizer import BYTES, tokenizer_for, tokenizer_name

__all__ = [
    "BYTES",
    "CHAT_ROLES",
    "DEFAULT_SHUFFLE_BUFFER",
    "RECORD_SHAPES",
    "SUPPORTED_SUFFIXES",
    "TOKENIZER_FILES",
    "ByteTokenizer",
    "DataError",
    "Example",
    "PackedBatch",
    "PackedBatches",
    "Tokenizer",
    "check_fraction",
    "copy_tokenizer_files",
    "encode_record",
    "load_tokenizer",
    "pack_documents",
    "read_records",
    "record_shape",
    "split_document",
    "tokenizer_files",
    "tokenizer_for",
    "tokenizer_name",
]
