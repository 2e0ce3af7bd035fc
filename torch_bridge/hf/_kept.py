"""The ``config.json`` fields a conversion carries through unchanged: names, ids and
generation defaults (``hf_fields`` of ``Converted``, ``write_hf`` and ``save_hf``).

A ``TransformerConfig`` holds what changes the numbers; a checkpoint's ``config.json`` also
names its tokenizer's special ids (``bos_token_id``, ``eos_token_id``, ``pad_token_id``), its
origin (``_name_or_path``) and sampling defaults. They are class 2 (``_fields``: known
not to change the numbers), so reading ignores them; ``kept_fields`` collects them, and
``check_kept`` vets what a caller asks ``write_hf`` to write back.

The writer owns the fields that say which model and dtype the directory holds
(``WRITER_OWNED``): they are never copied, and refused in ``hf_fields``.
"""

from collections.abc import Mapping

from torch_bridge.hf._fields import GENERATION, NAMES_AND_IDS

WRITER_OWNED = frozenset(
    {"model_type", "architectures", "torch_dtype", "dtype", "use_bfloat16"}
    | {"transformers_version", "_commit_hash"}
)
"""Names-and-ids fields the family's writer sets from the model itself (which class
transformers builds, in which dtype) or that describe one save (its library, its commit)."""

KEPT = (NAMES_AND_IDS | GENERATION) - WRITER_OWNED
"""The fields ``hf_fields`` may hold: names, ids, labels, the initialisation scale and the
generation defaults."""


def kept_fields(hf: Mapping) -> dict:
    """The fields of the config dict ``hf`` that a conversion keeps (``KEPT``), in its order.

    Example:
        >>> kept_fields({"model_type": "llama", "hidden_size": 6, "bos_token_id": 1, "eos_token_id": 2})
        {'bos_token_id': 1, 'eos_token_id': 2}
    """
    return {field: value for field, value in hf.items() if field in KEPT}


def check_kept(hf_fields: "Mapping | None") -> dict:
    """``hf_fields`` as a dict, once every key is known to be one ``write_hf`` may write.

    Raises:
        TypeError: when ``hf_fields`` is not a mapping.
        ValueError: naming a key that is not a name, id or generation field (one that could
            change the numbers, or that the writer sets itself).

    Example:
        >>> check_kept({"eos_token_id": 2})
        {'eos_token_id': 2}
        >>> try:
        ...     check_kept({"hidden_size": 8})
        ... except ValueError as err:
        ...     print(str(err)[:58])
        hf_fields: hidden_size=8 is not a name, id or generation f
    """
    if hf_fields is None:
        return {}
    if not isinstance(hf_fields, Mapping):
        raise TypeError(f"hf_fields must be a mapping of config.json fields, got {type(hf_fields).__name__}")
    for field, value in hf_fields.items():
        if field in WRITER_OWNED:
            raise ValueError(
                f"hf_fields: {field}={value!r} is written from the model itself; leave it out of hf_fields"
            )
        if field not in KEPT:
            raise ValueError(
                f"hf_fields: {field}={value!r} is not a name, id or generation field; hf_fields carries "
                "only those (torch_bridge.hf._kept.KEPT), so that it cannot change the model the "
                "directory holds; change the model's TransformerConfig instead"
            )
    return dict(hf_fields)
