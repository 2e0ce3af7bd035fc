"""The files that make up a model's tokenizer, and copying them next to converted or trained weights."""

import os
import shutil
from pathlib import Path

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)
"""Every file a Hugging Face model directory may hold for its tokenizer, chat template and
generation defaults (``generation_config.json``: its ``eos_token_id`` list stops generation)."""


def tokenizer_files(directory: "str | os.PathLike") -> list[Path]:
    """The ``TOKENIZER_FILES`` present in ``directory``, in that order.

    Example:
        >>> import tempfile
        >>> d = Path(tempfile.mkdtemp())
        >>> _ = (d / "tokenizer.json").write_text("{}")
        >>> [p.name for p in tokenizer_files(d)]
        ['tokenizer.json']
    """
    directory = Path(directory)
    return [directory / name for name in TOKENIZER_FILES if (directory / name).is_file()]


def copy_tokenizer_files(src: "str | os.PathLike", dst: "str | os.PathLike") -> list[str]:
    """Copies the tokenizer files of ``src`` into ``dst`` (each through a temporary file
    and a rename, so a failed copy leaves no partial file); returns the names copied.

    Example:
        >>> import tempfile
        >>> src, dst = Path(tempfile.mkdtemp()), Path(tempfile.mkdtemp())
        >>> _ = (src / "tokenizer_config.json").write_text("{}")
        >>> copy_tokenizer_files(src, dst), (dst / "tokenizer_config.json").is_file()
        (['tokenizer_config.json'], True)
    """
    dst = Path(dst)
    names = []
    for path in tokenizer_files(src):
        tmp = dst / f".{path.name}.tmp"
        shutil.copyfile(path, tmp)
        tmp.replace(dst / path.name)
        names.append(path.name)
    return names
