"""``load_tokenizer``: a Hugging Face model directory (or its ``tokenizer.json``) -> ``Tokenizer``.

What transformers 5 does with the same files, and so what this does:

- ``tokenizer.json`` is the tokenizer, post-processor included: the BOS (or EOS) that ``encode``
  adds is the one its post-processor adds. transformers 5 drops ``add_bos_token`` and
  ``add_eos_token`` from ``tokenizer_config.json`` whenever a ``tokenizer.json`` exists
  (``_from_pretrained``), so they change nothing there either; a ``JaxckptWarning`` says when
  they disagree with ``tokenizer.json`` (a checkpoint transformers 4 would have encoded with BOS).
- The named special tokens (``bos_token``, ``eos_token``, ``pad_token``, ...) come from
  ``tokenizer_config.json``, or ``special_tokens_map.json`` where the config does not set them;
  one missing from the vocabulary is added as a special token, as transformers adds it.
- The chat template is ``chat_template.jinja`` (where transformers 5 saves it), else
  ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of named templates: the one
  named ``"default"``).
- ``generation_config.json`` gives the ids that stop generation (``eos_token_id``, an int or a
  list), and the bos/eos/pad ids where the tokenizer files name no such token.
"""

import json
import os
import warnings
from pathlib import Path

import tokenizers

from jaxckpt._warnings import JaxckptWarning
from jaxckpt.data._example import DataError
from jaxckpt.data.tokenizer._tokenizers import Tokenizer

_NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
"""transformers' ``SPECIAL_TOKENS_ATTRIBUTES``: the token names every chat template sees."""

_HUGE = 10**18
"""transformers writes ``model_max_length`` 1e30 (``VERY_LARGE_INTEGER``) for "no limit"."""


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise DataError(f"{path}: expected a JSON object, got {type(obj).__name__}")
    return obj


def _token(value, file: Path, field: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]  # a serialized AddedToken
    raise DataError(f"{file}: {field} must be a token string or {{'content': str, ...}}, got {value!r}")


def _flag(cfg: dict, file: Path, field: str) -> bool:
    value = cfg.get(field, False)
    if not isinstance(value, bool):
        raise DataError(f"{file}: {field} must be true or false, got {value!r}")
    return value


def _template(value, file: Path) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(
        isinstance(t, dict) and "name" in t and "template" in t for t in value
    ):
        named = {t["name"]: t["template"] for t in value}
        if "default" not in named or not isinstance(named["default"], str):
            raise DataError(
                f"{file}: chat_template lists {sorted(named)} but no string template named 'default'"
            )
        return named["default"]
    raise DataError(
        f"{file}: chat_template must be a string or a list of {{name, template}}, got {type(value).__name__}"
    )


def _max_length(value, file: Path) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 1:
        raise DataError(f"{file}: model_max_length must be a positive number, got {value!r}")
    return None if value >= _HUGE else int(value)


def _gen_id(value, file: Path, field: str, many: bool = False):
    ok = lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0
    if value is None or ok(value) or (many and isinstance(value, list) and value and all(map(ok, value))):
        return value
    expected = "an id or a non-empty list of ids" if many else "an id"
    raise DataError(f"{file}: {field} must be {expected}, got {value!r}")


def _generation(directory: Path) -> dict:
    file = directory / "generation_config.json"
    cfg = _read_json(file)
    return {
        "bos_token_id": _gen_id(cfg.get("bos_token_id"), file, "bos_token_id"),
        "eos_token_id": _gen_id(cfg.get("eos_token_id"), file, "eos_token_id", many=True),
        "pad_token_id": _gen_id(cfg.get("pad_token_id"), file, "pad_token_id"),
    }


def _special_tokens(directory: Path, cfg: dict) -> tuple[dict[str, str | None], list[str]]:
    """The named and model-specific ``*_token`` strings, and every special token to ensure."""
    config_file, map_file = directory / "tokenizer_config.json", directory / "special_tokens_map.json"
    legacy = _read_json(map_file)
    named = {}
    for field in _NAMED_TOKENS:
        file, source = (config_file, cfg) if field in cfg else (map_file, legacy)
        if field in source:  # absent is not null: generation_config.json may give the id
            named[field] = _token(source[field], file, field)
    extra = cfg.get("extra_special_tokens") or cfg.get("additional_special_tokens") or []
    if isinstance(extra, dict):  # transformers 5: model-specific names, e.g. {"image_token": "<img>"}
        named.update({k: _token(v, config_file, f"extra_special_tokens.{k}") for k, v in extra.items()})
        extra = []
    if not isinstance(extra, list):
        raise DataError(
            f"{config_file}: additional_special_tokens must be a list, got {type(extra).__name__}"
        )
    named.update(
        {k: v for k, v in cfg.items() if k.endswith("_token") and k not in named and isinstance(v, str)}
    )
    listed = [_token(t, config_file, "additional_special_tokens") for t in extra]
    return named, [t for t in [*named.values(), *listed] if t]


def _locate(path: Path, name: str) -> Path:
    """The ``tokenizer.json`` file that ``path`` names."""
    hint = (
        f"{name} must be a Hugging Face model directory holding tokenizer.json, or that file; "
        "--tokenizer PATH chooses one"
    )
    if path.is_dir() and (path / "tokenizer.json").is_file():
        return path / "tokenizer.json"
    if path.is_dir():
        spm = (path / "tokenizer.model").is_file()
        note = (
            (
                " (its sentencepiece tokenizer.model is not read: transformers' save_pretrained writes the "
                "tokenizer.json)"
            )
            if spm
            else ""
        )
        raise FileNotFoundError(f"{path}: no tokenizer.json in this directory{note}; {hint}")
    if path.is_file() and path.suffix == ".model":
        raise FileNotFoundError(f"{path}: a sentencepiece model is not read, only a tokenizer.json; {hint}")
    if path.is_file():
        return path
    raise FileNotFoundError(f"{path}: no such file or directory; {hint}")


def _backend(file: Path) -> tokenizers.Tokenizer:
    try:
        backend = tokenizers.Tokenizer.from_file(str(file))
    except Exception as e:  # the Rust library raises a bare Exception
        reason = " ".join(str(e).split())
        raise DataError(f"{file}: not a tokenizer.json the tokenizers library can read ({reason})") from None
    unk = getattr(backend.model, "unk_token", None)  # BPE, WordLevel and WordPiece name one
    if unk is not None and backend.token_to_id(unk) is None:
        raise DataError(
            f"{file}: model.unk_token={unk!r} is not in the vocabulary, so any unknown text would fail "
            "to encode; is the file damaged?"
        )
    return backend


def _ensure_special(backend: tokenizers.Tokenizer, tokens: list[str]) -> None:
    added = {t.content for t in backend.get_added_tokens_decoder().values()}
    missing = [t for t in dict.fromkeys(tokens) if t not in added]
    if missing:
        backend.add_special_tokens(
            [tokenizers.AddedToken(t, special=True, normalized=False) for t in missing]
        )


def _check_flags(tok: Tokenizer, cfg: dict, file: Path) -> None:
    flags = {f: _flag(cfg, file, f) for f in ("add_bos_token", "add_eos_token")}
    if not any(flags.values()):
        return
    try:
        with_, without = tok.encode("a").tolist(), tok.encode("a", add_special_tokens=False).tolist()
    except Exception:  # a vocabulary without "a" and without an unknown token: nothing to check
        return
    added = {"add_bos_token": (with_[:1], tok.bos_id), "add_eos_token": (with_[-1:], tok.eos_id)}
    ignored = [
        f
        for f, (got, token_id) in added.items()
        if flags[f] and token_id is not None and (got != [token_id] or len(with_) == len(without))
    ]
    if ignored:
        warnings.warn(
            f"{file}: {' and '.join(ignored)} set to true, but tokenizer.json's post-processor does not add "
            "the token; following tokenizer.json, as transformers 5 does",
            JaxckptWarning,
            stacklevel=3,
        )


def load_tokenizer(path: "str | os.PathLike", *, name: str = "tokenizer") -> Tokenizer:
    """The tokenizer of a Hugging Face model directory, or of a ``tokenizer.json`` (whose
    directory's other tokenizer files are read too), as transformers 5 would load it (see the
    module docstring).

    Args:
        path: a model directory holding ``tokenizer.json``, or that file.
        name: what messages call the argument (e.g. ``"--tokenizer"``).

    Returns:
        A ``Tokenizer``.

    Raises:
        FileNotFoundError: no ``tokenizer.json`` there (a sentencepiece-only directory included).
        DataError: a file that does not parse, or a field of the wrong type (named).

    Example:
        >>> import tempfile
        >>> from tokenizers import Tokenizer as Backend, models, pre_tokenizers
        >>> d = Path(tempfile.mkdtemp())
        >>> backend = Backend(models.WordLevel({"<unk>": 0, "hi": 1, "</s>": 2}, unk_token="<unk>"))
        >>> backend.pre_tokenizer = pre_tokenizers.Whitespace()
        >>> backend.save(str(d / "tokenizer.json"))
        >>> _ = (d / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
        >>> tok = load_tokenizer(d)
        >>> tok.encode_document("hi hi").tolist(), tok.stop_ids
        ([1, 1, 2], (2,))
    """
    file = _locate(Path(path), name)
    directory = file.parent
    config_file = directory / "tokenizer_config.json"
    cfg = _read_json(config_file)
    backend = _backend(file)
    named, specials = _special_tokens(directory, cfg)
    _ensure_special(backend, specials)
    jinja = directory / "chat_template.jinja"
    template = (
        jinja.read_text(encoding="utf-8")
        if jinja.is_file()
        else _template(cfg.get("chat_template"), config_file)
    )
    tok = Tokenizer(
        backend,
        special_tokens=named,
        chat_template=template,
        generation=_generation(directory),
        name_or_path=str(path),
        model_max_length=_max_length(cfg.get("model_max_length"), config_file),
        clean_up_tokenization_spaces=_flag(cfg, config_file, "clean_up_tokenization_spaces"),
    )
    _check_flags(tok, cfg, config_file)
    return tok
