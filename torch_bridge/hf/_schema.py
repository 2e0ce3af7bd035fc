"""Reading ``config.json``, and the types of the fields torch_bridge reads from it, as data.

``read_config_json`` turns the file into a dict, or refuses it with one line naming the
file and where it stops being JSON (line and column, or byte). ``check_types`` checks every
field of ``FIELDS`` (and of ``ROPE_FIELDS`` inside the RoPE dicts) that the config holds,
before any family's reader sees it: a string ``rms_norm_eps``, a list ``rope_theta`` or a
size that is not a positive int is refused with the file and the field as config.json
spells it. ``hf_names`` says which config.json field an error of ``TransformerConfig``
(``d_model``, ``n_heads``) is about.
"""

import dataclasses
import json
import math
import re
from collections.abc import Callable, Mapping
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Kind:
    """What a field must hold: ``ok(value)``, and ``what`` for the message.

    Example:
        >>> SIZE.ok(3), SIZE.ok(-3), SIZE.ok(True), optional(SIZE).ok(None)
        (True, False, False, True)
    """

    what: str
    ok: Callable[[object], bool]


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def optional(kind: Kind) -> Kind:
    """``kind``, or null."""
    return Kind(f"{kind.what} or null", lambda value: value is None or kind.ok(value))


SIZE = Kind("a positive int", lambda v: _int(v) and v > 0)
COUNT = Kind("an int >= 0", lambda v: _int(v) and v >= 0)
POSITIVE = Kind("a positive finite number", lambda v: _number(v) and v > 0)
NON_NEGATIVE = Kind("a finite number >= 0", lambda v: _number(v) and v >= 0)
NUMBER = Kind("a finite number", _number)
FRACTION = Kind("a number in (0, 1]", lambda v: _number(v) and 0 < v <= 1)
FLAG = Kind("true or false", lambda v: isinstance(v, bool))
TEXT = Kind("a string", lambda v: isinstance(v, str))
OBJECT = Kind("an object", lambda v: isinstance(v, Mapping))
LIST = Kind("a list", lambda v: isinstance(v, list))
NUMBERS = Kind("a list of finite numbers", lambda v: isinstance(v, list) and all(map(_number, v)))

_SIZES = """vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads
    max_position_embeddings sliding_window_pattern no_rope_layer_interval n_embd n_layer n_head n_positions"""
_OPTIONAL_SIZES = "num_key_value_heads head_dim sliding_window n_inner original_max_position_embeddings"
_POSITIVE = "rms_norm_eps layer_norm_epsilon rope_theta rope_local_base_freq query_pre_attn_scalar"
_FLAGS = "tie_word_embeddings attention_bias mlp_bias use_sliding_window scale_attn_weights"
FIELDS: dict[str, Kind] = dict.fromkeys(_SIZES.split(), SIZE)
FIELDS |= dict.fromkeys(_OPTIONAL_SIZES.split(), optional(SIZE))
FIELDS |= dict.fromkeys(_POSITIVE.split(), POSITIVE)
FIELDS |= dict.fromkeys(_FLAGS.split(), FLAG)
FIELDS |= dict.fromkeys(("final_logit_softcapping", "attn_logit_softcapping"), optional(NON_NEGATIVE))
FIELDS |= {"max_window_layers": COUNT, "partial_rotary_factor": optional(FRACTION)}
FIELDS |= {"model_type": TEXT}
FIELDS |= dict.fromkeys(("hidden_act", "hidden_activation", "activation_function"), optional(TEXT))
FIELDS |= dict.fromkeys(("layer_types", "no_rope_layers"), optional(LIST))
FIELDS |= dict.fromkeys(("rope_parameters", "rope_scaling", "text_config"), optional(OBJECT))
"""Every config.json field a family's reader reads, and what it must hold (whatever the family)."""

ROPE_FIELDS: dict[str, Kind] = {"rope_type": TEXT, "type": TEXT, "rope_theta": POSITIVE, "factor": POSITIVE}
ROPE_FIELDS |= {"partial_rotary_factor": optional(FRACTION), "truncate": FLAG}
ROPE_FIELDS |= {"original_max_position_embeddings": optional(SIZE)}
ROPE_FIELDS |= dict.fromkeys(("short_factor", "long_factor"), NUMBERS)
_ROPE_NUMBERS = "low_freq_factor high_freq_factor beta_fast beta_slow mscale mscale_all_dim attention_factor"
ROPE_FIELDS |= dict.fromkeys(_ROPE_NUMBERS.split(), optional(NUMBER))
"""The keys of a ``rope_parameters`` / ``rope_scaling`` dict (or of its per-layer-type dicts)."""

HF_NAMES = {
    "d_model": "hidden_size", "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads",
    "n_layers": "num_hidden_layers", "ffn_dim": "intermediate_size", "max_len": "max_position_embeddings",
    "norm_eps": "rms_norm_eps",
}  # fmt: skip
GPT2_NAMES = HF_NAMES | {
    "d_model": "n_embd",
    "n_heads": "n_head",
    "n_layers": "n_layer",
    "ffn_dim": "n_inner",
}
GPT2_NAMES |= {"max_len": "n_positions", "norm_eps": "layer_norm_epsilon"}
"""``TransformerConfig`` field -> the config.json field it is read from (GPT-2's own names)."""


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check(fields: Mapping, kinds: Mapping[str, Kind], source: str, prefix: str = "") -> None:
    for field, kind in kinds.items():
        if field in fields and not kind.ok(fields[field]):
            value = _short(fields[field])
            raise ValueError(f"{source}: {prefix}{field}={value} must be {kind.what}")


def check_types(hf: Mapping, source: str = "config.json") -> None:
    """Refuses a config whose fields of ``FIELDS`` or ``ROPE_FIELDS`` hold the wrong type.

    Raises:
        ValueError: naming ``source``, the field (``rope_parameters.rope_theta``), its value
            and what it must hold.

    Example:
        >>> check_types({"hidden_size": -8}, "m/config.json")
        Traceback (most recent call last):
        ...
        ValueError: m/config.json: hidden_size=-8 must be a positive int
    """
    if not isinstance(hf, Mapping):
        raise ValueError(f"{source}: expected a JSON object of config fields, got a {type(hf).__name__}")
    _check(hf, FIELDS, source)
    for field in ("rope_parameters", "rope_scaling"):
        params = hf.get(field) or {}
        groups = {k: v for k, v in params.items() if k in ("full_attention", "sliding_attention")}
        for where, group in ({f"{field}.{k}": v for k, v in groups.items()} or {field: params}).items():
            if not isinstance(group, Mapping):
                raise ValueError(f"{source}: {where}={_short(group)} must be an object")
            _check(group, ROPE_FIELDS, source, f"{where}.")


def hf_name(field: str, family: str) -> str:
    """The config.json name of the ``TransformerConfig`` field ``field``.

    Example:
        >>> hf_name("n_layers", "llama"), hf_name("n_layers", "gpt2")
        ('num_hidden_layers', 'n_layer')
    """
    return (GPT2_NAMES if family == "gpt2" else HF_NAMES).get(field, field)


def hf_names(message: str, family: str) -> str:
    """The config.json names of the ``TransformerConfig`` fields ``message`` names, as a
    parenthesis to append ("" when it names none).

    Example:
        >>> hf_names("d_model=25 is not divisible by n_heads=4", "llama")
        ' (config.json: d_model is hidden_size, n_heads is num_attention_heads)'
    """
    names = GPT2_NAMES if family == "gpt2" else HF_NAMES
    found = [f"{ours} is {theirs}" for ours, theirs in names.items() if re.search(rf"\b{ours}\b", message)]
    return f" (config.json: {', '.join(found)})" if found else ""


def read_config_json(path: Path) -> dict:
    """The object in the JSON file ``path``.

    Raises:
        ValueError: one line naming ``path`` and why it is not a JSON object: not UTF-8 (at
            which byte), not JSON (at which line and column), or JSON of another type.
        OSError: the file cannot be read.

    Example:
        >>> import tempfile
        >>> bad = Path(tempfile.mkdtemp()) / "config.json"
        >>> _ = bad.write_text('{"model_type": "llama",}')
        >>> read_config_json(bad)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: .../config.json: not valid JSON (Expecting property name ...: line 1 column 24)
    """
    raw = path.read_bytes()
    try:
        config = json.loads(raw.decode("utf-8-sig"))
    except UnicodeDecodeError as err:
        reason = f"{err.reason} at byte {err.start}"
        raise ValueError(f"{path}: not UTF-8 text ({reason}); is it a config.json?") from None
    except json.JSONDecodeError as err:
        where = f"line {err.lineno} column {err.colno}"
        raise ValueError(f"{path}: not valid JSON ({err.msg}: {where})") from None
    except (ValueError, RecursionError) as err:  # an int of over 4300 digits; nesting too deep
        raise ValueError(f"{path}: not valid JSON ({type(err).__name__}: {err})") from None
    if not isinstance(config, dict):
        got = type(config).__name__
        raise ValueError(f"{path}: expected a JSON object of config fields, got a JSON {got}")
    return config
