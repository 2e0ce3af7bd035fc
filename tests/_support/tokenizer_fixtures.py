"""Tiny Hugging Face tokenizer directories, built offline, in the layouts real checkpoints ship.

``make_tokenizer_dir(path, flavor)`` trains a small BPE with ``tokenizers`` on ``corpus_lines()``
(a fraction of a second) and writes ``tokenizer.json``, ``tokenizer_config.json`` and
``generation_config.json`` the way the checkpoint family does: the same pre-tokenizer, decoder,
post-processor, special tokens, ``tokenizer_class`` and chat template. No transformers here, so
tests without torch can use these directories; the torch tests load the same directories with
``transformers.AutoTokenizer`` as the oracle.

Flavors (``FLAVORS``):

- ``"llama3"``: byte-level BPE with Llama 3's split regex; ``tokenizer.json``'s post-processor adds
  ``<|begin_of_text|>``; eos ``<|eot_id|>``; generation stops on three ids; Llama 3.2's template.
- ``"gpt2"``: byte-level BPE, one ``<|endoftext|>`` (bos = eos = unk), no BOS added, no template.
- ``"qwen2.5"``: ChatML, NFC + Qwen's split regex, no BOS, eos ``<|im_end|>``, pad
  ``<|endoftext|>``, Qwen2.5's template (with its default system prompt).
- ``"smollm2"``: ChatML with ``<|im_start|>`` as bos (never added), SmolLM2's template.
- ``"mistral"``: SentencePiece-style BPE (Metaspace, byte fallback, ``<unk> <s> </s>``), BOS from
  the post-processor and ``add_bos_token: true``, Mistral-instruct's template.
- ``"gemma"``: Gemma's normalizer and split, ``<bos>`` added, Gemma's template (which raises on a
  system message and on roles that do not alternate).
- ``"phi3"``: the SentencePiece layout with Phi-3's chat tokens (``rstrip``), no BOS, its template.

Example:
    >>> import tempfile
    >>> d = make_tokenizer_dir(tempfile.mkdtemp(), "gpt2")
    >>> sorted(p.name for p in d.iterdir())
    ['generation_config.json', 'tokenizer.json', 'tokenizer_config.json']
"""

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from chat_template_cases import CHAT_TEMPLATES
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

# ----------------------------------------------------------------------------------------------
# Corpus

_WORD_TEXT = (
    "the quick brown fox jumps over lazy dog a model learns to predict next token from text "
    "memory is cheap when you recompute what you need attention blocks scale with length and "
    "batch size we train small transformers on one chip it's they're we've I'm you'll don't "
    "hello world Paris France prime number even odd count three fact water boils degrees"
)
_WORDS = _WORD_TEXT.split()
_EXTRA = ("café naïve Zürich Привет мир 日本語 難しい — “quotes” ça va très bien", "x = f(3) + 42; y != z?")


def corpus_lines(n: int = 300) -> list[str]:
    """``n`` deterministic lines of mixed English, digits, punctuation and some non-ASCII text.

    Example:
        >>> len(corpus_lines(5)), corpus_lines(5) == corpus_lines(5)
        (5, True)
    """
    lines = []
    for i in range(n):
        words = [_WORDS[(i * 7 + j * 13) % len(_WORDS)] for j in range(3 + i % 9)]
        lines.append(f"{' '.join(words).capitalize()} {i}, {i * 37 % 1000}.")
        if i % 10 == 0:
            lines.append(_EXTRA[i // 10 % len(_EXTRA)])
    return lines[:n]


# ----------------------------------------------------------------------------------------------
# Flavors

_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class Flavor:
    """How one checkpoint family lays out its tokenizer.

    ``kind`` picks the model and pipeline (``"gpt2"``, ``"llama3"``, ``"qwen"`` byte-level;
    ``"llama"``, ``"gemma"`` SentencePiece-style). ``first`` are special tokens at the start of
    the vocabulary, ``last`` chat tokens appended after it (``(content, rstrip)``). ``bos`` is the
    token the post-processor prepends (None: none). ``config`` is tokenizer_config.json less the
    tokens, ``generation`` generation_config.json with token names for ids.
    """

    kind: str
    first: tuple[str, ...] = ()
    last: tuple[tuple[str, bool], ...] = ()
    bos: str | None = None
    config: dict = field(default_factory=dict)
    generation: dict = field(default_factory=dict)
    template: str | None = None


_LLAMA_SPECIALS = ("<unk>", "<s>", "</s>")
_CHATML = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

FLAVORS = {
    "llama3": Flavor(
        "llama3",
        last=tuple(
            (t, False)
            for t in (
                "<|begin_of_text|>",
                "<|end_of_text|>",
                "<|start_header_id|>",
                "<|end_header_id|>",
                "<|eom_id|>",
                "<|eot_id|>",
                "<|python_tag|>",
            )
        ),
        bos="<|begin_of_text|>",
        config={
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<|begin_of_text|>",
            "eos_token": "<|eot_id|>",
            "clean_up_tokenization_spaces": True,
            "model_input_names": ["input_ids", "attention_mask"],
            "model_max_length": 131072,
        },
        generation={
            "bos_token_id": "<|begin_of_text|>",
            "eos_token_id": ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"],
        },
        template="llama3",
    ),
    "gpt2": Flavor(
        "gpt2",
        last=(("<|endoftext|>", False),),
        config={
            "tokenizer_class": "GPT2Tokenizer",
            "bos_token": "<|endoftext|>",
            "eos_token": "<|endoftext|>",
            "unk_token": "<|endoftext|>",
            "add_prefix_space": False,
            "model_max_length": 1024,
        },
        generation={"bos_token_id": "<|endoftext|>", "eos_token_id": "<|endoftext|>"},
    ),
    "qwen2.5": Flavor(
        "qwen",
        last=tuple((t, False) for t in _CHATML),
        config={
            "tokenizer_class": "Qwen2Tokenizer",
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "unk_token": None,
            "errors": "replace",
            "split_special_tokens": False,
            "model_max_length": 131072,
        },
        generation={
            "bos_token_id": "<|endoftext|>",
            "eos_token_id": ["<|im_end|>", "<|endoftext|>"],
            "pad_token_id": "<|endoftext|>",
        },
        template="qwen2.5",
    ),
    "smollm2": Flavor(
        "gpt2",
        first=_CHATML,
        config={
            "tokenizer_class": "GPT2Tokenizer",
            "bos_token": "<|im_start|>",
            "eos_token": "<|im_end|>",
            "pad_token": "<|im_end|>",
            "unk_token": "<|endoftext|>",
            "model_max_length": 8192,
        },
        generation={
            "bos_token_id": "<|im_start|>",
            "eos_token_id": "<|im_end|>",
            "pad_token_id": "<|im_end|>",
        },
        template="smollm2",
    ),
    "mistral": Flavor(
        "llama",
        first=_LLAMA_SPECIALS,
        bos="<s>",
        config={
            "tokenizer_class": "LlamaTokenizer",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "unk_token": "<unk>",
            "pad_token": None,
            "add_bos_token": True,
            "add_eos_token": False,
            "legacy": False,
            "model_max_length": 32768,
        },
        generation={"bos_token_id": "<s>", "eos_token_id": "</s>"},
        template="mistral",
    ),
    "gemma": Flavor(
        "gemma",
        first=("<pad>", "<eos>", "<bos>", "<unk>", "<mask>"),
        last=(("<start_of_turn>", False), ("<end_of_turn>", False)),
        bos="<bos>",
        config={
            "tokenizer_class": "GemmaTokenizer",
            "bos_token": "<bos>",
            "eos_token": "<eos>",
            "unk_token": "<unk>",
            "pad_token": "<pad>",
            "add_bos_token": True,
            "add_eos_token": False,
        },
        generation={
            "bos_token_id": "<bos>",
            "eos_token_id": ["<eos>", "<end_of_turn>"],
            "pad_token_id": "<pad>",
        },
        template="gemma",
    ),
    "phi3": Flavor(
        "llama",
        first=_LLAMA_SPECIALS,
        last=(
            ("<|endoftext|>", False),
            ("<|assistant|>", True),
            ("<|system|>", True),
            ("<|end|>", True),
            ("<|user|>", True),
        ),
        config={
            "tokenizer_class": "LlamaTokenizer",
            "bos_token": "<s>",
            "eos_token": "<|endoftext|>",
            "unk_token": "<unk>",
            "pad_token": "<|endoftext|>",
            "add_bos_token": False,
            "add_eos_token": False,
            "legacy": False,
            "model_max_length": 4096,
        },
        generation={
            "bos_token_id": "<s>",
            "eos_token_id": ["<|endoftext|>", "<|end|>"],
            "pad_token_id": "<|endoftext|>",
        },
        template="phi3",
    ),
}
"""Flavor name -> Flavor."""


def _byte_level_pipeline(kind: str) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    if kind == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True)
    else:
        regex = _LLAMA3_REGEX if kind == "llama3" else _QWEN_REGEX
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(
                    add_prefix_space=False, trim_offsets=kind == "llama3", use_regex=False
                ),
            ]
        )
    if kind == "qwen":
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    return tok


def _train_byte_level(flavor: Flavor, vocab_size: int) -> Tokenizer:
    tok = _byte_level_pipeline(flavor.kind)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        show_progress=False,
        special_tokens=list(flavor.first),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus_lines(), trainer)
    trim = flavor.kind == "gpt2"
    byte_level = processors.ByteLevel(add_prefix_space=False, trim_offsets=trim, use_regex=False)
    tok.post_processor = byte_level
    return tok


def _train_sentencepiece_like(flavor: Flavor, vocab_size: int) -> Tokenizer:
    """BPE over "▁"-joined words, then SentencePiece's layout: control tokens, the 256 byte
    tokens ``<0x00>``..``<0xFF>`` (byte fallback), then the learned pieces."""
    unk = "<unk>"
    tok = Tokenizer(models.BPE(unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, show_progress=False, special_tokens=list(flavor.first)
    )
    tok.train_from_iterator(corpus_lines(), trainer)
    model = json.loads(tok.to_str())["model"]
    learned = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    names = list(flavor.first) + [f"<0x{b:02X}>" for b in range(256)]
    names += [t for t, _ in learned if t not in flavor.first]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    vocab = {t: i for i, t in enumerate(names)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    if flavor.kind == "gemma":
        tok.normalizer = normalizers.Replace(" ", "▁")
        tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous", invert=False)
        tok.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
        tok.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
    return tok


_TRAINERS = {
    "gpt2": _train_byte_level,
    "llama3": _train_byte_level,
    "qwen": _train_byte_level,
    "llama": _train_sentencepiece_like,
    "gemma": _train_sentencepiece_like,
}
_DEFAULT_VOCAB = {"gpt2": 384, "llama3": 384, "qwen": 384, "llama": 320, "gemma": 320}


def build_tokenizer(
    flavor: str = "llama3", *, vocab_size: int | None = None, bos_in_post_processor: bool = True
) -> Tokenizer:
    """The ``tokenizers.Tokenizer`` of ``flavor`` (see ``FLAVORS``), trained on ``corpus_lines()``.

    ``vocab_size`` is the trained BPE's size; the special tokens not in ``first`` come after it,
    and the SentencePiece layouts add the 256 byte tokens too. ``bos_in_post_processor=False``
    leaves out the post-processor that prepends BOS (a ``tokenizer.json`` that relies on
    ``add_bos_token`` alone).

    Example:
        >>> tok = build_tokenizer("gpt2", vocab_size=300)
        >>> tok.get_vocab_size(), tok.decode(tok.encode("Hello world").ids)
        (301, 'Hello world')
    """
    spec = FLAVORS[flavor]
    tok = _TRAINERS[spec.kind](spec, vocab_size or _DEFAULT_VOCAB[spec.kind])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in spec.first])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False, rstrip=r) for t, r in spec.last])
    if spec.bos is not None and bos_in_post_processor:
        bos = (spec.bos, tok.token_to_id(spec.bos))
        template = processors.TemplateProcessing(
            single=f"{bos[0]} $A", pair=f"{bos[0]} $A {bos[0]}:1 $B:1", special_tokens=[bos]
        )
        steps = [tok.post_processor, template] if tok.post_processor is not None else [template]
        tok.post_processor = processors.Sequence(steps) if len(steps) > 1 else template
    elif spec.kind in ("llama", "gemma"):
        tok.post_processor = None
    return tok


def _added_tokens_decoder(tok: Tokenizer) -> dict:
    return {
        str(i): {
            "content": t.content,
            "lstrip": t.lstrip,
            "normalized": t.normalized,
            "rstrip": t.rstrip,
            "single_word": t.single_word,
            "special": t.special,
        }
        for i, t in sorted(tok.get_added_tokens_decoder().items())
    }


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def make_tokenizer_dir(
    path: "str | os.PathLike",
    flavor: str = "llama3",
    *,
    vocab_size: int | None = None,
    chat_template: "str | bool | None" = True,
    template_file: bool = False,
    bos_in_post_processor: bool = True,
    config: dict | None = None,
    generation_config: bool = True,
) -> Path:
    """Writes a Hugging Face tokenizer directory of ``flavor`` into ``path`` and returns it.

    Args:
        path: the directory (created if missing).
        flavor: a key of ``FLAVORS``.
        vocab_size: size of the trained BPE (default: a few hundred).
        chat_template: ``True``: the flavor's own template; a name of ``CHAT_TEMPLATES`` or a
            template string; ``None`` or ``False``: none.
        template_file: write the template to ``chat_template.jinja`` (as transformers 5 saves
            it) instead of into ``tokenizer_config.json``.
        bos_in_post_processor: see ``build_tokenizer``.
        config: entries that replace (or, with a value ``...``, remove) tokenizer_config.json's.
        generation_config: write ``generation_config.json``.

    Example:
        >>> import tempfile
        >>> d = make_tokenizer_dir(tempfile.mkdtemp(), "qwen2.5", template_file=True)
        >>> (d / "chat_template.jinja").read_text().startswith("{%- if tools %}")
        True
    """
    spec = FLAVORS[flavor]
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(flavor, vocab_size=vocab_size, bos_in_post_processor=bos_in_post_processor)
    tok.save(str(path / "tokenizer.json"))
    cfg = {"added_tokens_decoder": _added_tokens_decoder(tok), **spec.config}
    for key, value in (config or {}).items():
        if value is ...:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    template = spec.template if chat_template is True else (chat_template or None)
    template = CHAT_TEMPLATES.get(template, template)
    if template is not None and template_file:
        (path / "chat_template.jinja").write_text(template, encoding="utf-8")
    elif template is not None:
        cfg["chat_template"] = template
    _write_json(path / "tokenizer_config.json", cfg)
    if generation_config:
        ids = {
            k: ([tok.token_to_id(t) for t in v] if isinstance(v, list) else tok.token_to_id(v))
            for k, v in spec.generation.items()
        }
        _write_json(path / "generation_config.json", {"_from_model_config": True, **ids})
    return path
