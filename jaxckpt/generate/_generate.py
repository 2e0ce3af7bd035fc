"""``generate``: a prompt (text or ids) in, the model's continuation out, greedy or sampled."""

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from jaxckpt.generate._decode import decode_ids
from jaxckpt.generate._load import load_model, resolve_tokenizer
from jaxckpt.generate._sampling import Sampling
from jaxckpt.nn import Transformer

FINISH_REASONS = ("eos", "length")
"""Why generation ended: a stop id was generated (it is the last new token), or
``max_new_tokens`` were."""


@dataclasses.dataclass(frozen=True)
class Generation:
    """What ``generate`` returns.

    Attributes:
        prompt: the prompt as given (text, or a list of ids).
        completion: the new tokens' text (special tokens, the stop id among them, and ids
            beyond the tokenizer's vocabulary skipped), or None when there is no tokenizer
            (a prompt of ids to a bare model).
        new_token_ids: the generated ids only, the stop id included when one ended it
            (as transformers' ``generate`` returns it).
        finish_reason: ``"eos"`` or ``"length"`` (``FINISH_REASONS``).

    Example:
        >>> g = Generation(prompt="Hi", completion="!", new_token_ids=[33], finish_reason="length")
        >>> g.to_dict()
        {'prompt': 'Hi', 'completion': '!', 'new_token_ids': [33], 'finish_reason': 'length'}
    """

    prompt: "str | list[int]"
    completion: str | None
    new_token_ids: list[int]
    finish_reason: str

    def to_dict(self) -> dict:
        """The fields as JSON-friendly values (``jaxckpt generate --json`` prints them)."""
        return dataclasses.asdict(self)


def _check_max_new_tokens(max_new_tokens) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an int >= 1")


def _prompt_ids(prompt, tokenizer, *, chat: bool) -> np.ndarray:
    """The prompt's ids: ``tokenizer.encode`` (its BOS handling), or the chat template's
    rendering of one user turn (no special tokens added: the template writes them)."""
    if isinstance(prompt, str):
        if chat:
            messages = [{"role": "user", "content": prompt}]
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            return np.asarray(tokenizer.encode(text, add_special_tokens=False), np.int32)
        return np.asarray(tokenizer.encode(prompt), np.int32)
    if chat:
        raise ValueError("chat=True takes a text prompt (the user's message), not ids")
    ids = np.asarray(prompt)
    if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
        raise TypeError(f"prompt must be a str or a 1-D sequence of ints, got {ids.dtype}{list(ids.shape)}")
    return ids.astype(np.int32)


def _check_ids(ids: np.ndarray, vocab_size: int, text: bool) -> None:
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        where = "the tokenizer gave prompt ids" if text else "prompt ids"
        raise ValueError(
            f"{where} in [{ids.min()}, {ids.max()}], outside the model's vocabulary "
            f"[0, vocab_size={vocab_size})" + (": is it this model's tokenizer?" if text else "")
        )


def _completion(tokenizer, new: np.ndarray) -> str | None:
    """The new tokens' text; ids the tokenizer does not have (a model's padded vocabulary) have none."""
    if tokenizer is None:
        return None
    known = new[new < tokenizer.vocab_size]
    return tokenizer.decode(known, skip_special_tokens=True)


def _check_fits(n: int, max_new_tokens: int, max_len: int) -> None:
    if n == 0:
        raise ValueError("prompt has no tokens: give some text (or ids)")
    if n > max_len:
        raise ValueError(f"prompt of {n} tokens is longer than the model's max_len={max_len}")
    if n + max_new_tokens > max_len:
        raise ValueError(
            f"prompt of {n} tokens + max_new_tokens={max_new_tokens} is longer than the model's "
            f"max_len={max_len}: at most {max_len - n} new tokens fit"
        )


def _model(model_or_dir, dtype) -> tuple[Transformer, Path | None]:
    if isinstance(model_or_dir, Transformer):
        if dtype is not None:
            raise ValueError("dtype= applies to a model directory; a model object runs in its own dtypes")
        return model_or_dir, None
    if not isinstance(model_or_dir, str | os.PathLike):
        raise TypeError(
            f"model must be a jaxckpt.nn.Transformer or a directory, got {type(model_or_dir).__name__}"
        )
    return load_model(model_or_dir, dtype=dtype), Path(model_or_dir)


def generate(
    model: "Transformer | str | os.PathLike",
    prompt: "str | Sequence[int]",
    *,
    tokenizer=None,
    max_new_tokens: int = 32,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    chat: bool = False,
    stop_ids: Sequence[int] | None = None,
    dtype: str | None = None,
) -> Generation:
    """Continues ``prompt`` with up to ``max_new_tokens`` tokens of ``model``, through a KV cache.

    Greedy by default (``temperature=0``, which ignores ``top_k`` and ``top_p``); with
    ``temperature > 0`` it samples as transformers' ``generate(do_sample=True)`` does:
    temperature, then top-k, then top-p, from a JAX key of ``seed``. It stops after a stop
    id (the tokenizer's ``stop_ids``: generation_config.json's eos ids) or ``max_new_tokens``.

    Args:
        model: a ``jaxckpt.nn.Transformer``, or a directory: Hugging Face, converted
            (``jaxckpt convert``) or a training run's checkpoint directory (its latest step).
        prompt: text (``tokenizer.encode(prompt)``, with the checkpoint's BOS handling) or ids.
        tokenizer: a tokenizer, a path to one, or ``"bytes"``; default: the directory's. A
            text prompt needs one; with ids it only decodes the completion.
        max_new_tokens: ``>= 1``; the prompt plus these must fit ``config.max_len``.
        temperature: ``>= 0``; 0 is greedy.
        top_k: ``>= 1``, or None.
        top_p: in ``(0, 1]``, or None.
        seed: the sampling key's seed.
        chat: the prompt is one user message, rendered with the tokenizer's chat template
            and its generation prompt (encoded without added special tokens).
        stop_ids: the ids that end generation; default: the tokenizer's ``stop_ids`` (none
            without a tokenizer).
        dtype: for a directory, the compute and parameter dtype; default: the stored ones.

    Returns:
        A ``Generation``.

    Raises:
        ValueError: a bad argument (named), a prompt that does not fit ``max_len``, no
            tokenizer for a text prompt, or no chat template with ``chat=True``.

    Example:
        >>> from flax import nnx
        >>> from jaxckpt import data, generate, nn
        >>> model = nn.Transformer(nn.TransformerConfig.preset("tiny", n_layers=1), rngs=nnx.Rngs(0))
        >>> g = generate(model, "Hi", tokenizer=data.ByteTokenizer(), max_new_tokens=3)
        >>> len(g.new_token_ids), g.finish_reason
        (3, 'length')
    """
    sampling = Sampling(temperature=temperature, top_k=top_k, top_p=top_p)
    _check_max_new_tokens(max_new_tokens)
    model, model_dir = _model(model, dtype)
    cfg = model.config
    if not cfg.causal:
        raise ValueError("generate needs a causal model: this one's config has causal=False")
    tok = resolve_tokenizer(model_dir, tokenizer, required=isinstance(prompt, str))
    ids = _prompt_ids(prompt, tok, chat=chat)
    _check_ids(ids, cfg.vocab_size, text=isinstance(prompt, str))
    _check_fits(len(ids), max_new_tokens, cfg.max_len)
    stops = (tok.stop_ids if tok is not None else ()) if stop_ids is None else tuple(stop_ids)
    new, stopped = decode_ids(
        model, ids, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed, stop_ids=stops
    )
    return Generation(
        prompt=prompt if isinstance(prompt, str) else ids.tolist(),
        completion=_completion(tok, new),
        new_token_ids=new.tolist(),
        finish_reason=FINISH_REASONS[0] if stopped else FINISH_REASONS[1],
    )
