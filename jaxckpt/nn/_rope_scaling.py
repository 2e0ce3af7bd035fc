"""``RopeScaling``: a RoPE frequency scaling (linear, llama3, yarn, longrope) as config data."""

import dataclasses

from jaxckpt.nn._choices import RopeKind


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """The parameters of a RoPE scaling, named as in Hugging Face's ``rope_parameters``.

    Only the fields of ``kind`` are read; the others stay None. Frozen and hashable (the
    longrope factors are tuples), so a config holding one stays a cache key.

    Attributes:
        kind: the scaling (``RopeKind``).
        factor: the context extension factor (linear, llama3, yarn; longrope's is derived).
        original_max_len: ``original_max_position_embeddings`` (llama3, yarn, longrope).
        low_freq_factor, high_freq_factor: llama3's band edges.
        beta_fast, beta_slow, mscale, mscale_all_dim, truncate: yarn's.
        attention_factor: the scale of cos and sin (yarn, longrope); None: derived.
        short_factor, long_factor: longrope's per-frequency factors (``rotary_dim / 2`` each).

    Example:
        >>> RopeScaling.from_dict({"rope_type": "linear", "factor": 8.0})
        RopeScaling(kind=<RopeKind.LINEAR: 'linear'>, factor=8.0)
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
            raise ValueError(f"rope_scaling.kind={self.kind!r} is not one of {known}") from None
        for name in ("short_factor", "long_factor"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, tuple(float(v) for v in value))
        if self.kind != RopeKind.LONGROPE and not (isinstance(self.factor, int | float) and self.factor > 0):
            raise ValueError(f"rope_scaling.factor={self.factor!r} must be a positive number for {self.kind}")

    def __repr__(self) -> str:
        fields = [f"kind={self.kind!r}"]
        fields += [
            f"{f.name}={getattr(self, f.name)!r}"
            for f in dataclasses.fields(self)[1:]
            if getattr(self, f.name) is not None
        ]
        return f"RopeScaling({', '.join(fields)})"

    def to_dict(self) -> dict:
        """The set fields as plain JSON values (``kind`` as ``rope_type``'s string)."""
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
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(
                f"rope_scaling: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        return cls(**fields)
