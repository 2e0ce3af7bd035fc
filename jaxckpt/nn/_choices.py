"""The closed choice sets of a ``TransformerConfig``, defined once: ``nn`` and ``plan`` read them.

Each set is a ``StrEnum`` (its members compare equal to their strings, so a config written
as JSON reads back unchanged) or a registry dict. Strings become members once, in
``TransformerConfig.__post_init__``; code compares members, never strings.
"""

import dataclasses
import enum
from types import MappingProxyType


class Choice(enum.StrEnum):
    """A member of a closed choice set; its repr is its string, as the config was written.

    Example:
        >>> Norm.RMS, str(Norm.RMS), Norm("rms") is Norm.RMS
        ('rms', 'rms', True)
    """

    def __repr__(self) -> str:
        return repr(self.value)


class Norm(Choice):
    """The normalisation of every norm in the model.

    ``RMS``: ``x / rms(x) * w`` (LLaMA). ``LAYER``: ``(x - mean) / std * w + b`` (GPT-2).
    ``GEMMA_RMS``: ``x / rms(x) * (1 + w)``, the product taken in fp32 (Gemma 2 and 3).

    Example:
        >>> Norm("gemma_rms") is Norm.GEMMA_RMS, Norm.RMS == "rms"
        (True, True)
    """

    RMS = "rms"
    LAYER = "layer"
    GEMMA_RMS = "gemma_rms"


class Activation(Choice):
    """The MLP's activation. The gated ones (``GATED``) have a gate projection.

    ``SWIGLU``: ``down(silu(gate(x)) * up(x))`` (LLaMA, Qwen, Mistral, Phi-3).
    ``GEGLU_TANH``: ``down(gelu_tanh(gate(x)) * up(x))`` (Gemma). ``GELU_TANH`` and
    ``GELU``: ``down(gelu(up(x)))`` with the tanh approximation (GPT-2) or exact (the seed).

    Example:
        >>> Activation.GEGLU_TANH in GATED, Activation.GELU in GATED
        (True, False)
    """

    SWIGLU = "swiglu"
    GEGLU_TANH = "geglu_tanh"
    GELU_TANH = "gelu_tanh"
    GELU = "gelu"


GATED = frozenset({Activation.SWIGLU, Activation.GEGLU_TANH})
"""The activations whose MLP has a gate projection."""


class Positions(Choice):
    """How positions enter the model: rotary (in attention), learned (added to the
    embeddings) or none.

    Example:
        >>> Positions("learned") is Positions.LEARNED
        True
    """

    ROPE = "rope"
    LEARNED = "learned"
    NONE = "none"


class RopeKind(Choice):
    """A RoPE frequency scaling, as Hugging Face's ``rope_type`` names it.

    ``LINEAR`` divides positions by ``factor``; ``LLAMA3`` rescales the low frequencies
    (Llama 3.1+); ``YARN`` interpolates by frequency band and scales the attention;
    ``LONGROPE`` takes per-frequency factors, short or long by sequence length (Phi-3).

    Example:
        >>> RopeKind("llama3").value
        'llama3'
    """

    LINEAR = "linear"
    LLAMA3 = "llama3"
    YARN = "yarn"
    LONGROPE = "longrope"


@dataclasses.dataclass(frozen=True)
class LayerKind:
    """What one layer of the stack does differently from another.

    Attributes:
        sliding: attention sees the config's ``sliding_window`` keys back (itself included);
            else every earlier key.
        rope: the layer applies RoPE (False: a NoPE layer, SmolLM3).

    Example:
        >>> LAYER_KINDS["sliding"]
        LayerKind(sliding=True, rope=True)
    """

    sliding: bool = False
    rope: bool = True


LAYER_KINDS = MappingProxyType(
    {
        "full": LayerKind(sliding=False, rope=True),
        "sliding": LayerKind(sliding=True, rope=True),
        "full_nope": LayerKind(sliding=False, rope=False),
        "sliding_nope": LayerKind(sliding=True, rope=False),
    }
)
"""Layer kind names (the entries of ``TransformerConfig.layer_pattern``) -> ``LayerKind``."""


def period(kinds: "tuple[LayerKind, ...]") -> int:
    """The smallest p such that ``kinds[i] == kinds[i % p]`` for every i.

    Example:
        >>> full, local = LAYER_KINDS["full"], LAYER_KINDS["sliding"]
        >>> period((local, full) * 3), period((full,) * 4), period((local,) * 5 + (full,) * 2)
        (2, 1, 7)
    """
    n = len(kinds)
    return next(p for p in range(1, n + 1) if all(kinds[i] == kinds[i % p] for i in range(n)))
