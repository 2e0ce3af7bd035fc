"""``RopeScaling`` (a RoPE frequency scaling as config data) and ``inv_frequencies``.

The frequencies are static numpy float32, computed with the operations, the order and the
float32 roundings of Hugging Face transformers' ``ROPE_INIT_FUNCTIONS`` (``modeling_rope_utils``),
so that they agree with it to float32 rounding (within 2 ulp: torch's ``pow`` is not correctly
rounded). Where torch writes ``c / t`` for a tensor ``t`` it computes ``t.reciprocal() * c``;
the code below does the same.
"""

import dataclasses
import math
import numbers

import numpy as np

from jaxckpt._checks import known_fields
from jaxckpt.nn._choices import RopeKind

_F32 = np.float32

_NOT_IMPLEMENTED_HINTS = {
    "default": "plain RoPE (Hugging Face's 'default') is rope_scaling=None",
    "dynamic": "dynamic NTK rescales theta from the running sequence length at inference",
}

_REQUIRED = {
    RopeKind.LINEAR: ("factor",),
    RopeKind.LLAMA3: ("factor", "low_freq_factor", "high_freq_factor", "original_max_len"),
    RopeKind.YARN: (),  # factor None: max_len / original_max_len; original_max_len None: max_len
    RopeKind.LONGROPE: ("short_factor", "long_factor", "original_max_len"),
}
_POSITIVE = ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "attention_factor")
_REAL = ("mscale", "mscale_all_dim")


_ORIGINAL_MAX_LEN_HINT = (
    " (original_max_len is Hugging Face's original_max_position_embeddings; Phi-3 keeps it at the "
    "top level of config.json, outside rope_scaling)"
)


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _positive_tuple(name: str, value) -> tuple[float, ...]:
    """A longrope factor list as a tuple of floats (hashable), or a ValueError naming it."""
    try:
        items = None if isinstance(value, str | bytes) else tuple(value)
    except TypeError:
        items = None
    if not items or not all(_is_real(v) and v > 0 for v in items):
        raise ValueError(f"rope_scaling.{name}={value!r} must be a non-empty list of positive numbers")
    return tuple(float(v) for v in items)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """The parameters of a RoPE scaling, named as in Hugging Face's ``rope_parameters``.

    Only the fields of ``kind`` are read; the others stay None. Frozen and hashable (the
    longrope factors are tuples), so a config holding one stays a cache key. Required:
    linear ``factor``; llama3 ``factor``, ``low_freq_factor < high_freq_factor`` and
    ``original_max_len``; longrope ``short_factor``, ``long_factor`` and ``original_max_len``.
    Yarn's ``factor`` defaults to ``max_len / original_max_len`` and its ``original_max_len``
    to ``max_len`` (as transformers does; ``max_len`` is ``max_position_embeddings``).

    Attributes:
        kind: the scaling (``RopeKind``).
        factor: the context extension factor (linear, llama3, yarn; longrope's is derived).
        original_max_len: ``original_max_position_embeddings`` (llama3, yarn, longrope).
        low_freq_factor, high_freq_factor: llama3's band edges.
        beta_fast, beta_slow, mscale, mscale_all_dim, truncate: yarn's.
        attention_factor: the scale of cos and sin (yarn, longrope); None: derived.
        short_factor, long_factor: longrope's per-frequency factors (``rotary_dim / 2`` each).

    Raises:
        ValueError: for a kind that is not implemented (``dynamic``, ``default``, ...), a
            missing required field or a field of the wrong type.

    Example:
        >>> RopeScaling.from_dict({"rope_type": "linear", "factor": 8.0})
        RopeScaling(kind='linear', factor=8.0)
        >>> RopeScaling(kind="dynamic", factor=2.0)
        Traceback (most recent call last):
        ValueError: rope_scaling.kind='dynamic' is not implemented (dynamic NTK ...
    """

    kind: RopeKind
    factor: float | None = None
    original_max_len: int | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool | None = None
    attention_factor: float | None = None
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None

    def __post_init__(self):
        try:
            object.__setattr__(self, "kind", RopeKind(self.kind))
        except ValueError:
            known = ", ".join(k.value for k in RopeKind)
            hint = _NOT_IMPLEMENTED_HINTS.get(self.kind)
            hint = f" ({hint})" if hint else ""
            raise ValueError(
                f"rope_scaling.kind={self.kind!r} is not implemented{hint}; the implemented kinds are {known}"
            ) from None
        for name in ("short_factor", "long_factor"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, _positive_tuple(name, getattr(self, name)))
        self._check_types()
        missing = [name for name in _REQUIRED[self.kind] if getattr(self, name) is None]
        if missing:
            need = ", ".join(_REQUIRED[self.kind])
            hint = _ORIGINAL_MAX_LEN_HINT if missing[0] == "original_max_len" else ""
            raise ValueError(f"rope_scaling.{missing[0]}=None: kind={self.kind.value} needs {need}{hint}")
        if self.kind == RopeKind.LLAMA3 and not self.low_freq_factor < self.high_freq_factor:
            raise ValueError(
                f"rope_scaling.low_freq_factor={self.low_freq_factor} must be less than "
                f"rope_scaling.high_freq_factor={self.high_freq_factor} (Llama 3.1: 1.0 and 4.0)"
            )

    def _check_types(self):
        for name in _POSITIVE:
            value = getattr(self, name)
            if value is not None and not (_is_real(value) and value > 0):
                raise ValueError(f"rope_scaling.{name}={value!r} must be a positive number for {self.kind}")
        for name in _REAL:
            value = getattr(self, name)
            if value is not None and not _is_real(value):
                raise ValueError(f"rope_scaling.{name}={value!r} must be a number")
        value = self.original_max_len
        if value is not None and not (isinstance(value, numbers.Integral) and not isinstance(value, bool)):
            raise ValueError(f"rope_scaling.original_max_len={value!r} must be a positive int")
        if value is not None and value <= 0:
            raise ValueError(f"rope_scaling.original_max_len={value!r} must be a positive int")
        if self.truncate is not None and not isinstance(self.truncate, bool):
            raise ValueError(f"rope_scaling.truncate={self.truncate!r} must be True, False or None")

    def __repr__(self) -> str:
        fields = [f"kind={self.kind!r}"]
        fields += [
            f"{f.name}={getattr(self, f.name)!r}"
            for f in dataclasses.fields(self)[1:]
            if getattr(self, f.name) is not None
        ]
        return f"RopeScaling({', '.join(fields)})"

    def to_dict(self) -> dict:
        """The set fields as plain JSON values (``kind`` as ``rope_type``'s string).

        Example:
            >>> RopeScaling(kind="yarn", factor=4.0, original_max_len=32768).to_dict()
            {'kind': 'yarn', 'factor': 4.0, 'original_max_len': 32768}
        """
        out = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) is not None
        }
        out["kind"] = self.kind.value
        return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}

    @classmethod
    def from_dict(cls, fields: dict) -> "RopeScaling":
        """From ``to_dict``'s output, or from a Hugging Face ``rope_parameters`` dict
        (``rope_type``, ``original_max_position_embeddings``; ``rope_theta`` and
        ``partial_rotary_factor`` are not scaling and are left to the caller).

        Raises:
            ValueError: naming a field that no scaling has.

        Example:
            >>> s = RopeScaling.from_dict({"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6})
            >>> RopeScaling.from_dict(s.to_dict()) == s
            True
        """
        renames = {
            "rope_type": "kind",
            "type": "kind",
            "original_max_position_embeddings": "original_max_len",
        }
        fields = {
            renames.get(k, k): v
            for k, v in fields.items()
            if k not in ("rope_theta", "partial_rotary_factor")
        }
        return cls(**known_fields(cls, fields, "rope_scaling"))


def _exponents(rotary_dim: int) -> np.ndarray:
    """``torch.arange(0, dim, 2).float() / dim``: ``[rotary_dim // 2]`` float32."""
    return np.arange(0, rotary_dim, 2, dtype=np.int64).astype(_F32) / _F32(rotary_dim)


def _rdiv(c: float, t: np.ndarray) -> np.ndarray:
    """``c / t`` as torch computes it for a float32 tensor ``t``: ``t.reciprocal() * c``."""
    return (_F32(1.0) / t) * _F32(c)


def _linear(s: RopeScaling, pos_freqs: np.ndarray, **_) -> tuple[np.ndarray, float]:
    return _rdiv(1.0, pos_freqs) / _F32(s.factor), 1.0


def _llama3(s: RopeScaling, pos_freqs: np.ndarray, **_) -> tuple[np.ndarray, float]:
    base = _rdiv(1.0, pos_freqs)
    factor, low, high, old_len = s.factor, s.low_freq_factor, s.high_freq_factor, s.original_max_len
    low_wavelen, high_wavelen = _F32(old_len / low), _F32(old_len / high)
    wavelen = _rdiv(2 * math.pi, base)
    inv_freq = np.where(wavelen > low_wavelen, base / _F32(factor), base)
    smooth = (_rdiv(old_len, wavelen) - _F32(low)) / _F32(high - low)
    smoothed = (_F32(1.0) - smooth) * inv_freq / _F32(factor) + smooth * inv_freq
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, inv_freq).astype(_F32), 1.0


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(
    s: RopeScaling, pos_freqs: np.ndarray, *, theta, rotary_dim, max_len, **_
) -> tuple[np.ndarray, float]:
    original = s.original_max_len or _need_max_len(max_len, "original_max_len=None defaults to max_len")
    factor = s.factor or _ratio(max_len, original)
    if s.attention_factor is not None:
        attention_factor = float(s.attention_factor)
    elif s.mscale and s.mscale_all_dim:
        attention_factor = float(_yarn_mscale(factor, s.mscale) / _yarn_mscale(factor, s.mscale_all_dim))
    else:
        attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = s.beta_fast or 32, s.beta_slow or 1

    def correction_dim(rotations):
        return (rotary_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.truncate is None or s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    extrapolation, interpolation = _rdiv(1.0, pos_freqs), _rdiv(1.0, _F32(factor) * pos_freqs)
    ramp = np.clip((np.arange(rotary_dim // 2, dtype=_F32) - _F32(low)) / _F32(high - low), 0, 1)
    extrapolation_factor = _F32(1.0) - ramp
    inv_freq = interpolation * (_F32(1.0) - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq.astype(_F32), attention_factor


def _longrope(s: RopeScaling, pos_freqs: np.ndarray, *, rotary_dim, max_len, seq_len, **_):
    for name in ("short_factor", "long_factor"):
        if len(getattr(s, name)) != rotary_dim // 2:
            raise ValueError(
                f"rope_scaling.{name} has {len(getattr(s, name))} entries; rotary_dim={rotary_dim} needs "
                f"rotary_dim / 2 = {rotary_dim // 2} (one per frequency)"
            )
    original = s.original_max_len
    attention_factor = None if s.attention_factor is None else float(s.attention_factor)
    if attention_factor is None:
        factor = s.factor or _ratio(max_len, original)
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext = s.long_factor if seq_len and seq_len > original else s.short_factor
    return _rdiv(1.0, np.asarray(ext, dtype=_F32) * pos_freqs), attention_factor


def _need_max_len(max_len: int | None, why: str) -> int:
    if max_len is None:
        raise ValueError(
            f"inv_frequencies: max_len=None, but rope_scaling.{why}; pass max_position_embeddings"
        )
    return max_len


def _ratio(max_len: int | None, original: int) -> float:
    """``max_len / original_max_len``: the factor transformers derives when ``factor`` is None."""
    return _need_max_len(max_len, "factor=None is derived as max_len / original_max_len") / original


_INIT = {
    RopeKind.LINEAR: _linear,
    RopeKind.LLAMA3: _llama3,
    RopeKind.YARN: _yarn,
    RopeKind.LONGROPE: _longrope,
}


def inv_frequencies(
    rotary_dim: int,
    theta: float,
    scaling: RopeScaling | None = None,
    *,
    max_len: int | None = None,
    seq_len: int | None = None,
) -> tuple[np.ndarray, float]:
    """RoPE's inverse frequencies ``[rotary_dim // 2]`` (float32 numpy) and attention factor.

    Computed as Hugging Face transformers' ``ROPE_INIT_FUNCTIONS[kind](config, seq_len=...)``
    with ``dim = rotary_dim`` (``int(head_dim * partial_rotary_factor)`` there), to float32
    rounding. The attention factor scales cos and sin; it is 1.0 except for yarn and longrope.

    Args:
        rotary_dim: the rotated dims of each head (even).
        theta: the RoPE base (``rope_theta``).
        scaling: the frequency scaling; None: plain RoPE.
        max_len: ``max_position_embeddings``; read by yarn (its default factor and
            original_max_len) and longrope (its default factor).
        seq_len: the static sequence length; longrope takes ``long_factor`` when
            ``seq_len > original_max_len``, else (and when None) ``short_factor``, as
            transformers' ``dynamic_rope_update`` does with ``max(position_ids) + 1``.

    Returns:
        ``(inv_freq, attention_factor)``.

    Raises:
        ValueError: for an odd or non-positive ``rotary_dim``, longrope factors of the wrong
            length, or a missing ``max_len`` that the scaling needs.

    Example:
        >>> inv_freq, attn = inv_frequencies(4, 10000.0)
        >>> inv_freq.tolist(), attn
        ([1.0, 0.009999999776482582], 1.0)
        >>> yarn = RopeScaling(kind="yarn", factor=4.0, original_max_len=32)
        >>> round(inv_frequencies(4, 10000.0, yarn)[1], 4)  # 0.1 ln(4) + 1
        1.1386
    """
    if not isinstance(rotary_dim, numbers.Integral) or isinstance(rotary_dim, bool) or rotary_dim <= 0:
        raise ValueError(f"inv_frequencies: rotary_dim={rotary_dim!r} must be a positive even int")
    if rotary_dim % 2:
        raise ValueError(
            f"inv_frequencies: rotary_dim={rotary_dim} must be even (it is rotated in pairs; "
            "transformers rounds an odd partial rotary dim up, which no checkpoint uses)"
        )
    if not (_is_real(theta) and theta > 0):
        raise ValueError(f"inv_frequencies: theta={theta!r} must be a positive number")
    rotary_dim = int(rotary_dim)
    pos_freqs = _F32(theta) ** _exponents(rotary_dim)  # theta ** (2i / dim)
    if scaling is None:
        return _rdiv(1.0, pos_freqs), 1.0
    if not isinstance(scaling, RopeScaling):
        raise ValueError(f"inv_frequencies: scaling={scaling!r} must be a RopeScaling or None")
    init = _INIT[scaling.kind]
    return init(scaling, pos_freqs, theta=theta, rotary_dim=rotary_dim, max_len=max_len, seq_len=seq_len)
