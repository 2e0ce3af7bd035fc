"""Hugging Face ``config.json`` <-> ``jaxckpt.nn.TransformerConfig``, for every family.

``translate`` is the one entry: it finds the family of a config dict by its
``model_type`` (the ``ARCHITECTURES`` registry), sorts its fields into classes
(``hf._fields``: used, harmless, refused, unknown), and reads it (the family's ``read``);
its ``hf_config`` goes back. No field is silently dropped: an unknown one is listed,
warned about once, or (``strict``) refused.
"""

import dataclasses
from collections.abc import Mapping

from torch_bridge._archs import architecture_of
from torch_bridge.hf import check_types, classify, report_unknown

MULTIMODAL_NOTE = (
    "model_type='gemma3' is multimodal: only its language model (text_config) is read; the vision "
    "tower and the projector are left out"
)


@dataclasses.dataclass
class Translation:
    """A config dict read into ``TransformerConfig`` fields.

    Attributes:
        family: the jaxckpt family. fields: the ``TransformerConfig`` keyword arguments
        (without the dtype). notes: what was accepted but not carried over (dropout).
        unknown: fields in no class (``name=value``), ignored.

    Example:
        >>> t = translate({"model_type": "gpt2", "vocab_size": 11, "n_embd": 6, "n_layer": 1, "n_head": 3})
        >>> t.family, t.fields["d_model"], t.unknown
        ('gpt2', 6, [])
    """

    family: str
    fields: dict
    notes: list[str] = dataclasses.field(default_factory=list)
    unknown: list[str] = dataclasses.field(default_factory=list)


def translate(hf: Mapping, source: str = "config.json", *, strict: bool = False) -> Translation:
    """The ``TransformerConfig`` fields of the Hugging Face config ``hf`` (read from ``source``).

    Args:
        hf: the config dict. source: its file, for messages.
        strict: refuse fields in no class instead of warning about them.

    Raises:
        ValueError: naming ``source`` and the field: a config that is not an object, a field
            of the wrong type (``hf._schema.FIELDS``), a model_type with no family, a field
            jaxckpt cannot honour (with the reason), a missing required field, or (strict)
            an unknown one.

    Example:
        >>> t = translate({"model_type": "qwen3", "vocab_size": 11, "hidden_size": 6, "intermediate_size": 5,
        ...                "num_hidden_layers": 2, "num_attention_heads": 3, "sliding_window": None})
        >>> t.family, t.fields["head_dim"], t.fields["qk_norm"], t.unknown
        ('qwen3', 128, True, [])
    """
    check_types(hf, source)
    model_type = hf.get("model_type")
    arch = architecture_of(hf, source)
    family = arch.name
    notes: list[str] = []
    unknown: list[str] = []
    if model_type == "gemma3":
        outer = _classified(hf, "gemma3-multimodal", source)
        notes += [MULTIMODAL_NOTE, *outer.notes]
        unknown += outer.unknown
        hf = _text_config(hf, source)
        source = f"{source} text_config"
        check_types(hf, source)
    found = _classified(hf, family, source)
    notes += found.notes
    unknown += [f"text_config.{u}" if model_type == "gemma3" else u for u in found.unknown]
    try:
        fields = arch.read(hf, notes)
    except KeyError as err:
        raise ValueError(f"{source}: required field {err.args[0]!r} is missing") from err
    except ValueError as err:
        raise ValueError(f"{source}: {err}") from err
    report_unknown(unknown, source, strict)
    return Translation(family, fields, notes, unknown)


def _classified(hf: Mapping, layout: str, source: str):
    try:
        return classify(hf, layout)
    except ValueError as err:
        raise ValueError(f"{source}: {err}") from err


def _text_config(hf: Mapping, source: str) -> dict:
    """The language model's config of a multimodal Gemma 3 config; the tied head is the
    outer config's (``Gemma3ForConditionalGeneration`` ties by it)."""
    text = hf.get("text_config") or {}
    if not isinstance(text, Mapping):
        raise ValueError(f"{source}: text_config={text!r} must be an object")
    text = dict(text)
    if text.get("model_type", "gemma3_text") != "gemma3_text":
        raise ValueError(f"{source}: text_config.model_type={text['model_type']!r}; expected 'gemma3_text'")
    text["model_type"] = "gemma3_text"
    text["tie_word_embeddings"] = hf.get("tie_word_embeddings", True)
    return text
