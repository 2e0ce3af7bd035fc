"""One training record (a JSON object of a dataset) -> an ``Example``, whatever its shape.

Three shapes, told apart by their fields (other fields are ignored):

- ``{"text": str}``: a plain document, ``tokenizer.encode_document(text)`` (BOS as the
  checkpoint adds it, then EOS); the loss is on every token.
- ``{"messages": [{"role", "content"}, ...]}``: a conversation, ``tokenizer.encode_chat``;
  the loss is on the assistant's turns only.
- ``{"prompt": str, "completion": str}``: ``encode(prompt)`` (with the special tokens the
  tokenizer adds, no EOS), then ``encode(completion, add_special_tokens=False)`` and EOS; the loss
  is on the completion and the EOS only.
"""

from collections.abc import Callable

import numpy as np

from jaxckpt.data._example import DataError, Example


def _text(record: dict, tokenizer) -> Example:
    ids = tokenizer.encode_document(record["text"])
    return Example(ids, np.ones(len(ids), bool))


def _messages(record: dict, tokenizer) -> Example:
    return tokenizer.encode_chat(record["messages"])


def _prompt_completion(record: dict, tokenizer) -> Example:
    prompt = tokenizer.encode(record["prompt"])
    completion = tokenizer.encode(record["completion"], add_special_tokens=False)
    eos = [] if tokenizer.eos_id is None else [tokenizer.eos_id]
    ids = np.concatenate([prompt, completion, np.asarray(eos, np.int32)]).astype(np.int32)
    mask = np.arange(len(ids)) >= len(prompt)
    return Example(ids, mask)


RECORD_SHAPES: dict[str, tuple[dict[str, type], Callable]] = {
    "text": ({"text": str}, _text),
    "messages": ({"messages": list}, _messages),
    "prompt_completion": ({"prompt": str, "completion": str}, _prompt_completion),
}
"""Shape name -> (its fields and their types, its encoder)."""


def _expected() -> str:
    return "; ".join(
        "{" + ", ".join(f'"{f}": {t.__name__}' for f, t in fields.items()) + "}"
        for fields, _ in RECORD_SHAPES.values()
    )


def record_shape(record: dict, *, where: str = "record") -> str:
    """Which of ``RECORD_SHAPES`` ``record`` has (``"text"``, ``"messages"`` or
    ``"prompt_completion"``), from its fields.

    Raises:
        DataError: ``f"{where}: ..."`` when it is not an object, has no shape's fields, has two
            shapes' fields, or a field of the wrong type.

    Example:
        >>> record_shape({"prompt": "2+2=", "completion": "4", "id": 7})
        'prompt_completion'
        >>> record_shape({"txt": "hello"}, where="data.jsonl:3")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        jaxckpt.data._example.DataError: data.jsonl:3: a record needs the fields of one of ... ['txt']
    """
    if not isinstance(record, dict):
        raise DataError(f"{where}: a record must be a JSON object, got {type(record).__name__}")
    shapes = [name for name, (fields, _) in RECORD_SHAPES.items() if fields.keys() <= record.keys()]
    if len(shapes) != 1:
        found = (
            f"found the fields {sorted(record)}"
            if not shapes
            else f"it has the fields of {' and '.join(shapes)}"
        )
        raise DataError(f"{where}: a record needs the fields of one of {_expected()}; {found}")
    for field, kind in RECORD_SHAPES[shapes[0]][0].items():
        if not isinstance(record[field], kind):
            raise DataError(
                f"{where}: {field!r} must be a {kind.__name__}, got {type(record[field]).__name__}"
            )
    return shapes[0]


def encode_record(record: dict, tokenizer, *, where: str) -> Example:
    """``record`` tokenized by ``tokenizer`` (a ``Tokenizer`` or ``ByteTokenizer``), with its
    loss mask, according to its shape (see the module docstring).

    Args:
        record: one object of the dataset.
        tokenizer: what ``load_tokenizer`` returns, or ``ByteTokenizer()``.
        where: the record's location for messages, e.g. ``"data.jsonl:7"``.

    Raises:
        DataError: ``f"{where}: ..."``: see ``record_shape``, and bad messages or a tokenizer
            without a chat template for a conversation.

    Example:
        >>> from jaxckpt.data.tokenizer._tokenizers import ByteTokenizer
        >>> ex = encode_record({"prompt": "Q", "completion": "A!"}, ByteTokenizer(), where="x:1")
        >>> ex.ids.tolist(), ex.loss_mask.tolist()
        ([81, 65, 33], [False, True, True])
    """
    shape = record_shape(record, where=where)
    try:
        return RECORD_SHAPES[shape][1](record, tokenizer)
    except DataError as e:
        raise DataError(f"{where}: {e}") from None
    except UnicodeEncodeError as e:  # a lone surrogate ("\\ud800" in the JSON) has no UTF-8 bytes
        raise DataError(
            f"{where}: the text is not valid Unicode ({e.reason} at character {e.start})"
        ) from None
