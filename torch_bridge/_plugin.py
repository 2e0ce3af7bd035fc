"""The ``jaxckpt.model_sources`` plugin: ``jaxckpt train --init-from HF_DIR`` reads a
Hugging Face directory through these two functions (jaxckpt never imports torch_bridge)."""

import json
import os
from pathlib import Path

from jaxckpt.nn import TransformerConfig
from torch_bridge._models import config_from_hf, read_checkpoint
from torch_bridge.hf import kept_fields


def config(path: "str | os.PathLike") -> TransformerConfig:
    """The jaxckpt config of the Hugging Face directory ``path`` (fp32)."""
    return config_from_hf(path)


def params(path: "str | os.PathLike", config: TransformerConfig) -> dict:
    """The directory's parameters for ``config`` (cast to ``config.param_dtype``), as the
    nested dict of numpy arrays of the model's ``nnx.Param`` state."""
    return read_checkpoint(path, config=config, dtype=config.param_dtype).params


def hf_fields(path: "str | os.PathLike") -> dict:
    """The fields of the directory's ``config.json`` that ``save_hf(..., hf_fields=)`` writes
    back (token ids and names, generation defaults)."""
    return kept_fields(json.loads((Path(path) / "config.json").read_text()))
