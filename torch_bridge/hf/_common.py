"""What the config readers and writers share: RoPE parameters and per-layer attention kinds.

RoPE: a ``rope_parameters`` dict (transformers >= 5) or ``rope_theta`` + ``rope_scaling``
(older) <-> ``rope_theta`` and a ``RopeScaling``. Layers: Hugging Face's per-layer lists
(``layer_types``, SmolLM3's ``no_rope_layers``) <-> ``layer_pattern``, the shortest period
(``jaxckpt.nn.period``).
"""

from collections.abc import Mapping

from jaxckpt.nn import LAYER_KINDS, RopeScaling, TransformerConfig
from torch_bridge.hf._fields import refusal

SCALING_KEYS: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "truncate", "attention_factor"),
    "longrope": ("factor", "original_max_position_embeddings", "attention_factor", "short_factor",
                 "long_factor"),
}  # fmt: skip
"""Per implemented ``rope_type``, the keys of its parameters (Hugging Face's names)."""

REFUSED_ROPE = {
    "dynamic": "dynamic NTK scaling recomputes the frequencies from each input's length; not implemented",
    "proportional": "proportional RoPE is not implemented",
}
"""``rope_type``s known and refused, with the reason."""

_NEEDS_ORIGINAL = ("llama3", "yarn", "longrope")


def flat_rope_params(hf: Mapping) -> tuple[str, dict]:
    """Where the RoPE parameters of a one-RoPE config are, and a copy of them: ``rope_scaling``
    when set (it wins, as in transformers), else ``rope_parameters``."""
    if hf.get("rope_scaling"):
        return "rope_scaling", dict(hf["rope_scaling"])
    return "rope_parameters", dict(hf.get("rope_parameters") or {})


def read_rope(
    where: str, params: Mapping, hf: Mapping, *, theta: float, aliases: Mapping[str, str] | None = None
) -> tuple[float, RopeScaling | None]:
    """``(rope_theta, scaling)`` of one RoPE parameter dict.

    Args:
        where: the field's name, for errors (``rope_parameters.full_attention``).
        params: the dict (``rope_type``/``type``, ``rope_theta``, the scaling's keys).
        hf: the whole config: ``original_max_position_embeddings`` at its top level wins
            (as in transformers), ``max_position_embeddings`` is the fallback.
        theta: the base when ``params`` has no ``rope_theta``.
        aliases: legacy ``rope_type`` names (Phi-3's ``su`` and ``yarn`` mean ``longrope``).

    Raises:
        ValueError: for a refused or unknown ``rope_type`` (named).

    Example:
        >>> read_rope("rope_scaling", {"rope_type": "linear", "factor": 2.0}, {}, theta=1e4)
        (10000.0, RopeScaling(kind='linear', factor=2.0))
    """
    kind = params.get("rope_type", params.get("type", "default"))
    kind = (aliases or {}).get(kind, kind)
    theta = float(params.get("rope_theta", theta))
    if kind == "default":
        return theta, None
    if kind in REFUSED_ROPE:
        raise refusal(f"{where}.rope_type", kind, REFUSED_ROPE[kind])
    if kind not in SCALING_KEYS:
        known = ", ".join(("default", *SCALING_KEYS))
        raise refusal(f"{where}.rope_type", kind, f"implemented: {known}")
    fields = {k: params[k] for k in SCALING_KEYS[kind] if params.get(k) is not None}
    if kind in _NEEDS_ORIGINAL:
        top = hf.get("original_max_position_embeddings")
        fields["original_max_position_embeddings"] = top or fields.get(
            "original_max_position_embeddings", hf.get("max_position_embeddings")
        )
    try:
        return theta, RopeScaling.from_dict({"rope_type": kind, **fields})
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}: {err}") from None


def hf_rope(theta: float, scaling: RopeScaling | None, **extra) -> dict:
    """The ``rope_parameters`` dict of ``theta`` and ``scaling`` (the inverse of ``read_rope``).

    Example:
        >>> hf_rope(500.0, RopeScaling.from_dict({"rope_type": "linear", "factor": 2.0}))
        {'rope_type': 'linear', 'rope_theta': 500.0, 'factor': 2.0}
    """
    out = {"rope_type": "default", "rope_theta": theta}
    if scaling is not None:
        fields = scaling.to_dict()
        out["rope_type"] = fields.pop("kind")
        if "original_max_len" in fields:
            fields["original_max_position_embeddings"] = fields.pop("original_max_len")
        out |= fields
    return out | extra


def layer_kind(sliding: bool, rope: bool = True) -> str:
    """The ``LAYER_KINDS`` name of a layer.

    Example:
        >>> layer_kind(True), layer_kind(False, rope=False)
        ('sliding', 'full_nope')
    """
    return ("sliding" if sliding else "full") + ("" if rope else "_nope")


def kinds_of(config: TransformerConfig) -> list:
    """One ``LayerKind`` per layer of ``config``; a sliding layer without a window is full."""
    kinds = config.layer_kinds
    if config.sliding_window is None:
        kinds = tuple(LAYER_KINDS[layer_kind(False, k.rope)] for k in kinds)
    return list(kinds)


def read_layer_types(field: str, value, n_layers: int) -> list[bool]:
    """Per layer, whether a ``layer_types`` list makes it sliding.

    Raises:
        ValueError: for a list of the wrong length or an attention kind not implemented.

    Example:
        >>> read_layer_types("layer_types", ["sliding_attention", "full_attention"], 2)
        [True, False]
    """
    if not isinstance(value, list | tuple) or len(value) != n_layers:
        raise ValueError(
            f"{field}={value!r} must list one attention kind per layer (num_hidden_layers={n_layers})"
        )
    known = ("full_attention", "sliding_attention")
    for i, kind in enumerate(value):
        if kind not in known:
            raise refusal(f"{field}[{i}]", kind, f"implemented attention kinds: {', '.join(known)}")
    return [kind == "sliding_attention" for kind in value]


def hf_layer_types(config: TransformerConfig) -> list[str]:
    """The ``layer_types`` list of ``config``.

    Example:
        >>> cfg = TransformerConfig(n_layers=3, layer_pattern=("sliding", "full"), sliding_window=5)
        >>> hf_layer_types(cfg)
        ['sliding_attention', 'full_attention', 'sliding_attention']
    """
    return ["sliding_attention" if k.sliding else "full_attention" for k in kinds_of(config)]
