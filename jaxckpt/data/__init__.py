"""Data: tokenizers (byte-level, or a checkpoint's own through ``tokenizers``), chat
templates, streamed dataset readers, and packing into rows with segment ids.

No model and no training here: ``jaxckpt.train`` feeds these batches to the model.
"""

from jaxckpt.data._example import DataError, Example
from jaxckpt.data._tokenizer_files import TOKENIZER_FILES, copy_tokenizer_files, tokenizer_files

# >>> tokenizer and chat (helper A1) >>>
# <<< tokenizer and chat <<<

# >>> readers and packing (helper A2) >>>
# <<< readers and packing <<<

__all__ = [
    "TOKENIZER_FILES",
    "DataError",
    "Example",
    "copy_tokenizer_files",
    "tokenizer_files",
]
