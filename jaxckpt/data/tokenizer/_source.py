"""Which tokenizer goes with a model directory: its own ``tokenizer.json``, byte-level when
a jaxckpt checkpoint says so, or the one ``--tokenizer`` names."""

import json
import os
from pathlib import Path

from jaxckpt.data._example import DataError
from jaxckpt.data.tokenizer._load import load_tokenizer
from jaxckpt.data.tokenizer._tokenizers import ByteTokenizer, Tokenizer

BYTES = "bytes"
"""The ``--tokenizer`` value (and ``jaxckpt.json``'s ``"tokenizer"``) of the byte-level tokenizer."""

META = "jaxckpt.json"


def tokenizer_for(
    model_dir: "str | os.PathLike | None", override: "str | os.PathLike | None" = None
) -> "Tokenizer | ByteTokenizer":
    """The tokenizer of the model at ``model_dir``, or the one ``override`` names.

    Args:
        model_dir: a Hugging Face, converted or trained model directory; None: no model
            directory (then the byte-level tokenizer, unless ``override`` says otherwise).
        override: ``"bytes"``, or a directory holding ``tokenizer.json``, or that file.

    Returns:
        ``override``'s tokenizer; else ``model_dir``'s ``tokenizer.json``; else the byte-level
        one when ``model_dir``'s ``jaxckpt.json`` says ``"tokenizer": "bytes"`` (a model
        trained on bytes) or there is no ``model_dir``.

    Raises:
        FileNotFoundError / DataError: for a model directory without a tokenizer (the
            message suggests ``--tokenizer``), or a tokenizer that cannot be read.

    Example:
        >>> tokenizer_for(None).vocab_size, tokenizer_for("any/dir", override="bytes").vocab_size
        (256, 256)
    """
    if override is not None:
        return ByteTokenizer() if str(override) == BYTES else load_tokenizer(override, name="tokenizer")
    if model_dir is None:
        return ByteTokenizer()
    model_dir = Path(model_dir)
    if (model_dir / "tokenizer.json").is_file():
        return load_tokenizer(model_dir, name="tokenizer")
    if _meta_tokenizer(model_dir) == BYTES:
        return ByteTokenizer()
    raise DataError(
        f"{model_dir}: the model has no tokenizer (no tokenizer.json); pass --tokenizer PATH (a directory "
        "holding tokenizer.json, or the file), or --tokenizer bytes for a byte-level model"
    )


def tokenizer_name(tokenizer: "Tokenizer | ByteTokenizer") -> str:
    """What ``jaxckpt.json`` records of a run's tokenizer: ``"bytes"``, or ``"files"`` when
    its files are copied next to the checkpoint.

    Example:
        >>> tokenizer_name(ByteTokenizer())
        'bytes'
    """
    return BYTES if isinstance(tokenizer, ByteTokenizer) else "files"


def _meta_tokenizer(model_dir: Path) -> "str | None":
    path = model_dir / META
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text()).get("tokenizer")
    except (ValueError, AttributeError) as err:
        raise DataError(f"{path}: not a JSON object ({err})") from None
