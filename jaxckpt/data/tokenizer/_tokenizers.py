"""Tokenizers with one interface: a checkpoint's own (``Tokenizer``, through the Rust
``tokenizers`` library: no torch, no transformers) and the byte-level default (``ByteTokenizer``).

Both give ``encode``/``decode``, ``encode_document`` (a plain-text training document), and the
chat side: ``apply_chat_template`` (the text) and ``encode_chat`` (ids and a loss mask on the
assistant's turns). ``load_tokenizer`` (in ``_tokenizer_load.py``) reads a model directory.
"""

from collections.abc import Mapping, Sequence

import numpy as np
import tokenizers

from jaxckpt.data._chat import chat_example, check_messages, render_chat
from jaxckpt.data._example import DataError, Example


def _text(text, where: str) -> str:
    if not isinstance(text, str):
        raise TypeError(f"{where}: text must be a str, got {type(text).__name__}")
    return text


def _ids(ids, vocab_size: int) -> list[int]:
    arr = np.asarray(ids)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(f"decode: ids must be a 1-D array of integers, got {arr.dtype}{list(arr.shape)}")
    if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
        raise ValueError(
            f"decode: ids must lie in [0, {vocab_size}), got values in [{arr.min()}, {arr.max()}]"
        )
    return arr.astype(np.int64).tolist()


class _Chat:
    """What both tokenizers build on ``encode``, ``encode_batch``, ``eos_id``, ``chat_template``."""

    chat_template: str | None = None
    eos_id: int | None = None
    name_or_path: str = ""
    _variables: Mapping[str, str] = {}

    def encode_document(self, text: str) -> np.ndarray:
        """What one plain-text training document becomes: ``encode(text)`` (so BOS where the
        checkpoint's tokenizer adds one) then one EOS, unless there is no EOS or the encoding
        already ends with it. The EOS teaches the model where a document ends, and separates
        documents packed into one row. ``ByteTokenizer`` has no EOS: just the bytes.

        Example:
            >>> ByteTokenizer().encode_document("Hi").tolist()
            [72, 105]
        """
        ids = self.encode(_text(text, "encode_document"))
        if self.eos_id is None or (len(ids) and ids[-1] == self.eos_id):
            return ids
        return np.append(ids, np.int32(self.eos_id)).astype(np.int32)

    def _template(self) -> str:
        if self.chat_template is None:
            raise DataError(
                f"the tokenizer {self.name_or_path!r} has no chat template, so it cannot encode messages: "
                "--tokenizer PATH can point to a model directory whose tokenizer has one"
            )
        return self.chat_template

    def _render(self, messages: Sequence[dict], add_generation_prompt: bool) -> str:
        return render_chat(
            self._template(), messages, add_generation_prompt=add_generation_prompt, variables=self._variables
        )

    def apply_chat_template(self, messages: Sequence[dict], *, add_generation_prompt: bool = False) -> str:
        """``messages`` rendered through the chat template, as transformers'
        ``apply_chat_template(messages, tokenize=False)``.

        Args:
            messages: ``[{"role": "system" | "user" | "assistant" | "tool", "content": str}, ...]``.
            add_generation_prompt: end with the header of an assistant turn.

        Raises:
            DataError: no chat template, a bad message, or the template refused the conversation.

        Example:
            >>> ByteTokenizer().apply_chat_template([{"role": "user", "content": "Hi"}])  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            jaxckpt.data._example.DataError: the tokenizer 'bytes' has no chat template, ...
        """
        self._template()
        return self._render(check_messages(messages), add_generation_prompt)

    def encode_chat(self, messages: Sequence[dict], *, add_generation_prompt: bool = False) -> Example:
        """The rendered conversation's ids (no special tokens added: the template writes them),
        equal to transformers' ``apply_chat_template(messages, tokenize=True)``, and a loss mask
        that is True on the assistant's turns: their content and end-of-turn markup, not their
        header (see ``chat_example``).

        Raises:
            DataError: as ``apply_chat_template``.

        Example:
            >>> from tokenizers import Tokenizer as Backend, models
            >>> backend = Backend(models.WordLevel({"[user]": 0, "[bot]": 1, "hi": 2, "yo": 3, "[end]": 4}))
            >>> t = "{% for m in messages %}{{ '[bot]' if m.role == 'assistant' else '[user]' }}"
            >>> t += "{{ m.content }}{{ eos_token }}{% endfor %}"
            >>> t += "{% if add_generation_prompt %}[bot]{% endif %}"
            >>> backend.add_special_tokens(["[user]", "[bot]", "[end]"])
            3
            >>> tok = Tokenizer(backend, special_tokens={"eos_token": "[end]"}, chat_template=t)
            >>> chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
            >>> ex = tok.encode_chat(chat)
            >>> ex.ids.tolist(), ex.loss_mask.tolist()
            ([0, 2, 4, 1, 3, 4], [False, False, False, False, True, True])
        """
        self._template()
        return chat_example(
            check_messages(messages),
            render=self._render,
            add_generation_prompt=add_generation_prompt,
            encode_batch=lambda texts: self.encode_batch(texts, add_special_tokens=False),
        )


class Tokenizer(_Chat):
    """A Hugging Face tokenizer (``tokenizer.json``) with its special tokens and chat template.

    ``load_tokenizer(path)`` builds one from a model directory; the constructor takes a
    ``tokenizers.Tokenizer`` and what the other files say.

    Args:
        backend: the ``tokenizers.Tokenizer`` (its post-processor decides what ``encode`` adds).
        special_tokens: named special tokens, e.g. ``{"bos_token": "<s>", "eos_token": "</s>"}``
            (every ``*_token`` the chat template may read); each must be in the vocabulary. A
            name set to None has no token (Qwen's ``bos_token``).
        chat_template: a Jinja chat template, or None.
        generation: ``generation_config.json``'s ``bos_token_id``, ``eos_token_id`` (an int or a
            list: the ids that stop generation) and ``pad_token_id``: the ids of the tokens that
            ``special_tokens`` does not name at all.
        name_or_path: where it came from (for messages).
        model_max_length: the longest sequence the model was trained on, if known.
        clean_up_tokenization_spaces: transformers' decode option (it applies only to non-BPE
            models, as in transformers 5).

    Attributes:
        vocab_size: ids lie in ``[0, vocab_size)`` (added tokens included).
        bos_id, eos_id, pad_id: ids of those tokens, or None.
        stop_ids: the ids that end generation: generation_config's eos list, else ``(eos_id,)``.

    Example:
        >>> from tokenizers import Tokenizer as Backend, models, pre_tokenizers
        >>> backend = Backend(models.WordLevel({"hi": 0, "there": 1, "</s>": 2, "?": 3}, unk_token="?"))
        >>> backend.pre_tokenizer = pre_tokenizers.Whitespace()
        >>> tok = Tokenizer(backend, special_tokens={"eos_token": "</s>"})
        >>> tok.vocab_size, tok.eos_id, tok.stop_ids, tok.encode("hi there").tolist()
        (4, 2, (2,), [0, 1])
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        special_tokens: Mapping[str, str | None] | None = None,
        chat_template: str | None = None,
        generation: Mapping | None = None,
        name_or_path: str = "tokenizer",
        model_max_length: int | None = None,
        clean_up_tokenization_spaces: bool = False,
    ):
        self._backend = backend
        self.name_or_path = str(name_or_path)
        self.chat_template = chat_template
        self.model_max_length = model_max_length
        self._named = dict(special_tokens or {})
        self._variables = {k: v for k, v in self._named.items() if v is not None}
        unknown = [f"{k}={v!r}" for k, v in self._variables.items() if backend.token_to_id(v) is None]
        if unknown:
            raise ValueError(
                f"{self.name_or_path}: special tokens not in the vocabulary: {', '.join(unknown)}"
            )
        self._clean_up = clean_up_tokenization_spaces and type(backend.model).__name__ != "BPE"
        gen = dict(generation or {})
        self.bos_id = self._id("bos_token", gen.get("bos_token_id"))
        self.pad_id = self._id("pad_token", gen.get("pad_token_id"))
        stops = gen.get("eos_token_id")
        stops = () if stops is None else tuple(int(i) for i in np.atleast_1d(stops))
        self.eos_id = self._id("eos_token", stops[0] if stops else None)
        self.stop_ids = stops or (() if self.eos_id is None else (self.eos_id,))

    def _id(self, name: str, fallback: int | None) -> int | None:
        if name not in self._named:  # unset, not set to None: generation_config's id, if any
            return fallback
        token = self._named[name]
        return None if token is None else self._backend.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The ``tokenizers.Tokenizer`` (e.g. for offsets)."""
        return self._backend

    def token_to_id(self, token: str) -> int | None:
        """The id of ``token`` (None if it is not in the vocabulary)."""
        return self._backend.token_to_id(token)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> np.ndarray:
        """``text`` as ``int32`` ids; ``add_special_tokens`` lets ``tokenizer.json``'s post-processor
        add what the checkpoint adds (Llama 3's ``<|begin_of_text|>``, Llama 2's ``<s>``, nothing
        for GPT-2 or Qwen), as transformers' ``tokenizer(text)["input_ids"]``.

        Example:
            >>> ByteTokenizer().encode("é").tolist()
            [195, 169]
        """
        enc = self._backend.encode(_text(text, "encode"), add_special_tokens=add_special_tokens)
        return np.asarray(enc.ids, np.int32)

    def encode_batch(self, texts: Sequence[str], *, add_special_tokens: bool = True) -> list[np.ndarray]:
        """``[encode(t) for t in texts]``, tokenized in parallel."""
        texts = [_text(t, "encode_batch") for t in texts]
        encs = self._backend.encode_batch(texts, add_special_tokens=add_special_tokens)
        return [np.asarray(e.ids, np.int32) for e in encs]

    def decode(self, ids, *, skip_special_tokens: bool = False) -> str:
        """The text of ``ids`` (a 1-D array-like), as transformers' ``decode``.

        Raises:
            ValueError: ``ids`` is not 1-D integers in ``[0, vocab_size)``.
        """
        text = self._backend.decode(_ids(ids, self.vocab_size), skip_special_tokens=skip_special_tokens)
        return _clean_up(text) if self._clean_up else text

    def __repr__(self) -> str:
        return (
            f"Tokenizer({self.name_or_path!r}, vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
            f"eos_id={self.eos_id}, chat_template={self.chat_template is not None})"
        )


_CLEAN_UP = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)


def _clean_up(text: str) -> str:
    for old, new in _CLEAN_UP:
        text = text.replace(old, new)
    return text


class ByteTokenizer(_Chat):
    """The byte-level default: ids are the UTF-8 bytes of the text (``vocab_size`` 256), with no
    special tokens (``bos_id``, ``eos_id``, ``pad_id`` None, ``stop_ids`` empty) and no chat
    template (``encode_chat`` raises a ``DataError``).

    Example:
        >>> tok = ByteTokenizer()
        >>> tok.encode("Hi!").tolist(), tok.decode([72, 105, 255]) == "Hi" + chr(0xFFFD)
        ([72, 105, 33], True)
    """

    vocab_size = 256
    bos_id = eos_id = pad_id = None
    stop_ids = ()
    chat_template = None
    model_max_length = None
    name_or_path = "bytes"

    def encode(self, text: str, *, add_special_tokens: bool = True) -> np.ndarray:
        """The UTF-8 bytes of ``text`` (``add_special_tokens`` changes nothing: there are none)."""
        return np.frombuffer(_text(text, "encode").encode("utf-8"), np.uint8).astype(np.int32)

    def encode_batch(self, texts: Sequence[str], *, add_special_tokens: bool = True) -> list[np.ndarray]:
        """``[encode(t) for t in texts]``."""
        return [self.encode(t) for t in texts]

    def decode(self, ids, *, skip_special_tokens: bool = False) -> str:
        """The text whose UTF-8 bytes are ``ids``; invalid sequences become U+FFFD."""
        return bytes(_ids(ids, 256)).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"
