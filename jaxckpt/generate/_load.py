"""What ``generate`` runs: the model of a directory (Hugging Face, converted, or a training
run's latest step), in its stored dtypes, and the tokenizer that goes with it."""

import json
import os
from pathlib import Path

from jaxckpt import data, train
from jaxckpt.nn import Transformer

HF_DTYPE_FIELDS = ("dtype", "torch_dtype")
"""``config.json``'s fields for the stored dtype (transformers 5 writes ``dtype``, 4 ``torch_dtype``)."""

STORED_DTYPES = ("float32", "bfloat16", "float16")
"""The stored dtypes a Hugging Face model runs in as they are (any other: the config's float32)."""


def _stored_dtype(path: Path) -> str | None:
    """A Hugging Face directory's stored dtype (``config.json``), if it is one jaxckpt runs in."""
    config = path / "config.json"
    if not config.is_file():
        return None  # a jaxckpt checkpoint: its jaxckpt.json config has the dtypes already
    fields = json.loads(config.read_text(encoding="utf-8"))
    found = next((fields[k] for k in HF_DTYPE_FIELDS if isinstance(fields.get(k), str)), None)
    return found if found in STORED_DTYPES else None


def load_model(path: "str | os.PathLike", *, dtype: str | None = None, name: str = "model") -> Transformer:
    """The model stored at ``path``: a Hugging Face directory (read through torch_bridge), a
    directory written by ``jaxckpt convert``, or a training run's ``--checkpoint-dir`` (its
    latest step; the optimizer state is not used).

    Args:
        path: the directory.
        dtype: compute and parameter dtype (``"float32"``, ``"bfloat16"``, ``"float16"``);
            default: the stored ones (a Hugging Face ``config.json``'s ``dtype``, or the
            jaxckpt config's ``dtype`` and ``param_dtype``).
        name: the argument name errors give ``path`` under.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``path`` holds no model, or ``dtype`` is not a dtype a config takes.

    Example:
        >>> import tempfile
        >>> from jaxckpt import nn, train
        >>> d = tempfile.mkdtemp()
        >>> cfg = nn.TransformerConfig.preset("tiny", n_layers=1, d_model=32, n_heads=2, ffn_dim=48)
        >>> run = train.RunConfig(steps=1, batch=2, seq=16, checkpoint={"dir": d}, progress=False)
        >>> _ = train.train(cfg, run)
        >>> load_model(d, dtype="bfloat16").config.dtype
        'bfloat16'
    """
    config = train.source_config(path, name=name)
    dtype = dtype or _stored_dtype(Path(path))
    if dtype is not None:
        config = config.replace(dtype=dtype, param_dtype=dtype)
    return train.initial_model(config, seed=0, init_from=path)


def resolve_tokenizer(model_dir: "Path | None", tokenizer, *, required: bool):
    """The tokenizer of a ``generate`` call.

    Args:
        model_dir: the model's directory, or None for a model object.
        tokenizer: a tokenizer object (``encode``, ``decode``, ``stop_ids``), a path to one,
            ``"bytes"``, or None: the directory's own (``data.tokenizer_for``).
        required: whether the prompt is text. Else (ids) a tokenizer only decodes the
            completion and gives the stop ids: a directory without one gives None.

    Raises:
        ValueError: a text prompt and no tokenizer (a ``DataError`` says why, for a directory).

    Example:
        >>> resolve_tokenizer(None, "bytes", required=True)
        ByteTokenizer()
    """
    if tokenizer is not None and not isinstance(tokenizer, str | os.PathLike):
        return tokenizer
    if model_dir is None and tokenizer is None:
        if required:
            raise ValueError(
                "tokenizer=None: a text prompt to a model object needs a tokenizer "
                "(a tokenizer, a path to one, or 'bytes'), or give the prompt as ids"
            )
        return None
    try:
        return data.tokenizer_for(model_dir, override=tokenizer)
    except data.DataError:
        if required or tokenizer is not None or (model_dir / "tokenizer.json").is_file():
            raise  # a text prompt, a tokenizer named, or one there that cannot be read
        return None  # ids in, ids out: a model directory without a tokenizer is fine
