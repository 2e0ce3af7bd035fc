"""Named remat specs (``PRESETS``), ``get``, which turns a name into a spec, and ``Layered``,
a spec that differs across the block stack."""

import dataclasses
from collections.abc import Iterable, Mapping
from types import MappingProxyType

from jaxckpt._tags import ATTENTION_RESIDUALS, PROJECTIONS, QKV, Tag
from jaxckpt.remat._spec import UNCOMPRESSIBLE, RematSpec, TagFormats

_MINIMAL = PROJECTIONS | ATTENTION_RESIDUALS
_BOUNDARY = frozenset({Tag.LAYER_INPUT})

PRESETS: MappingProxyType[str, RematSpec] = MappingProxyType(
    {
        "none": RematSpec(enabled=False),
        "full": RematSpec(),
        "dots": RematSpec(save_dots=True),
        "save_qkv": RematSpec(save=QKV),
        "save_attn": RematSpec(save=ATTENTION_RESIDUALS),
        "minimal": RematSpec(save=_MINIMAL),
        "offload_full": RematSpec(offload=_BOUNDARY),
        "offload_full_save_attn": RematSpec(save=ATTENTION_RESIDUALS, offload=_BOUNDARY),
        "offload_qkv": RematSpec(offload=QKV),
        "offload_minimal": RematSpec(offload=_MINIMAL),
        "ratio_0.5": RematSpec(layers_per_checkpoint=2),
        "ratio_0.25": RematSpec(layers_per_checkpoint=4),
    }
)
"""Preset name -> ``RematSpec``. ``ratio_r`` keeps one layer boundary in every ``1/r``.
``offload_full`` is ``full`` with each layer's input (``Tag.LAYER_INPUT``, the remat boundary)
in ``pinned_host`` memory between the forward and the backward pass, and
``offload_full_save_attn`` that with ``save_attn``'s attention residuals kept on device."""


AUTO = "auto"
"""The remat value that asks the planner (``jaxckpt.plan.plan_memory``) for a spec."""


def get(spec: "str | RematSpec | Layered") -> "RematSpec | Layered":
    """Returns the ``RematSpec`` for a preset name, or ``spec`` itself (a ``RematSpec``, or
    a ``Layered`` spec that differs across the stack).

    Args:
        spec: a key of ``PRESETS``, a ``RematSpec`` or a ``Layered``.

    Returns:
        The spec.

    Raises:
        ValueError: for a name that is not a preset (the message lists them).
        TypeError: for anything else.

    Example:
        >>> from jaxckpt import remat
        >>> remat.get("ratio_0.25").layers_per_checkpoint
        4
    """
    if isinstance(spec, RematSpec | Layered):
        return spec
    if isinstance(spec, str):
        if spec == AUTO:
            raise ValueError(
                "remat='auto' is chosen by the planner for a batch, a sequence length and a budget: "
                "resolve it with jaxckpt.plan.resolve_auto(model_config, run) before training "
                "(it uses run.budget), or call jaxckpt.plan.plan_memory"
            )
        if spec not in PRESETS:
            raise ValueError(f"unknown remat preset {spec!r}; valid presets: {', '.join(PRESETS)}, or 'auto'")
        return PRESETS[spec]
    raise TypeError(
        f"remat must be a preset name or a RematSpec (or a Layered of them), got "
        f"{type(spec).__name__}: {spec!r}"
    )


def compressed(
    spec: "str | RematSpec | Layered", fmt: str, tags: "Iterable[Tag | str] | None" = None
) -> "RematSpec | Layered":
    """``spec`` with the tags it keeps stored in ``fmt`` (what ``--compress`` asks for); for
    a ``Layered`` spec, each remat'd group's (a group without remat is left as it is).

    Args:
        spec: a preset name or a ``RematSpec``.
        fmt: ``"int8"`` or ``"fp8"``.
        tags: the tags to compress, each one ``spec`` keeps; None: every kept tag that can
            be compressed: not ``Tag.ATTN_LSE``, and with ``layers_per_checkpoint > 1`` only
            the segments' input (``Tag.LAYER_INPUT``), since the others are kept inside a
            segment. Tags ``spec`` compresses already keep their format unless named here.

    Returns:
        The spec with ``compress`` set.

    Raises:
        ValueError: for a disabled spec, an unknown format, or a tag in ``tags`` that
            ``spec`` does not keep or that cannot be compressed (the message names it).

    Example:
        >>> from jaxckpt import remat
        >>> remat.compressed("save_attn", "int8").compress  # the lse stays exact
        {'attn_out': 'int8', 'layer_input': 'int8'}
        >>> remat.compressed("minimal", "fp8", tags=["mlp_up"]).compress
        {'mlp_up': 'fp8'}
    """
    spec = get(spec)
    if isinstance(spec, Layered):  # each remat'd group keeps what it keeps compressed
        groups = [(n, s if not s.enabled else compressed(s, fmt, tags)) for n, s in spec.groups]
        if not spec.enabled:
            raise ValueError("remat.compressed: no group of the Layered spec is remat'd; nothing is kept")
        return Layered(tuple(groups))
    if not spec.enabled:
        raise ValueError(
            "remat.compressed: a disabled spec (the 'none' preset) keeps everything at full "
            "precision and compresses nothing; pick an enabled preset such as 'full'"
        )
    if tags is None:
        tags = spec.kept_tags - UNCOMPRESSIBLE.keys()
        if spec.save_dots:
            tags -= {Tag.LINEAR_OUT} - spec.save - spec.offload
        if spec.layers_per_checkpoint > 1:
            tags = {Tag.LAYER_INPUT}
    elif isinstance(tags, str):
        raise TypeError(f"remat.compressed: tags takes a collection of tags, got the string {tags!r}")
    new = {Tag(str(t)) if str(t) in Tag._value2member_map_ else t: fmt for t in tags}
    return dataclasses.replace(spec, compress={**spec.compress, **new})


@dataclasses.dataclass(frozen=True)
class Layered:
    """A remat spec that differs across the block stack: consecutive groups of layers, each
    under its own ``RematSpec``.

    The stack's scan is cut into one scan per group (each group's ``jax.checkpoint`` policy
    its spec's, its segments of ``layers_per_checkpoint`` layers cut inside the group), so a
    few layers may keep more than the rest and a memory budget between two presets' peaks
    is used instead of wasted. The numbers are those of the uniform specs: remat changes
    what is stored, not what is computed. ``Layered`` is accepted wherever a remat spec is
    (``Transformer.__call__``, ``Trainer``, ``plan.measure``); ``plan.predict_layered``
    prices it and ``plan.plan_memory(per_layer=True)`` chooses one.

    Attributes:
        groups: ``((count, spec), ...)`` in stack order: the first ``count`` layers under
            ``spec`` (a ``RematSpec`` or a preset name), the next group after them. The
            counts add up to the stack's ``n_layers`` (``run_blocks`` checks it).

    Example:
        >>> from jaxckpt import remat
        >>> spec = remat.Layered(((2, "save_attn"), (3, "full")))
        >>> spec.n_layers, spec.describe()
        (5, '2 x save_attn + 3 x full')
        >>> spec.layer_specs[1] == remat.get("save_attn"), spec.layer_specs[2] == remat.get("full")
        (True, True)
    """

    groups: tuple[tuple[int, RematSpec], ...]

    def __post_init__(self):
        given = self.groups
        if isinstance(given, str | Mapping) or not isinstance(given, Iterable):
            raise TypeError(f"Layered.groups takes ((count, spec), ...), got {given!r}")
        groups = []
        for i, group in enumerate(given):
            if not isinstance(group, tuple | list) or len(group) != 2:
                raise TypeError(f"Layered.groups[{i}] must be a (count, spec) pair, got {group!r}")
            count, spec = group
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise ValueError(f"Layered.groups[{i}]: count must be an int >= 1, got {count!r}")
            if isinstance(spec, Layered):
                raise TypeError(f"Layered.groups[{i}]: a group's spec is a RematSpec, not a Layered")
            groups.append((count, get(spec)))
        if not groups:
            raise ValueError("Layered.groups is empty: give at least one (count, spec) group")
        object.__setattr__(self, "groups", tuple(groups))

    @classmethod
    def of(cls, *groups: "tuple[int, RematSpec | str]") -> "RematSpec | Layered":
        """The spec of ``groups``, empty groups dropped and neighbours with the same spec
        merged: a plain ``RematSpec`` when one spec is left (the uniform stack).

        Example:
            >>> from jaxckpt import remat
            >>> remat.Layered.of((0, "minimal"), (4, "full")) == remat.get("full")
            True
            >>> remat.Layered.of((1, "full"), (2, "full"), (2, "dots")).describe()
            '3 x full + 2 x dots'
        """
        merged: list[list] = []
        for count, spec in groups:
            spec = get(spec)
            if count == 0:
                continue
            if merged and merged[-1][1] == spec:
                merged[-1][0] += count
            else:
                merged.append([count, spec])
        if not merged:
            raise ValueError("Layered.of: every group is empty")
        if len(merged) == 1:
            return merged[0][1]
        return cls(tuple((count, spec) for count, spec in merged))

    @property
    def n_layers(self) -> int:
        """Layers of the stack: the groups' counts added."""
        return sum(count for count, _ in self.groups)

    @property
    def specs(self) -> tuple[RematSpec, ...]:
        """Each group's spec, in stack order."""
        return tuple(spec for _, spec in self.groups)

    @property
    def layer_specs(self) -> tuple[RematSpec, ...]:
        """One spec per layer of the stack."""
        return tuple(spec for count, spec in self.groups for _ in range(count))

    @property
    def enabled(self) -> bool:
        """Whether any group is remat'd (a ``jax.checkpoint``)."""
        return any(spec.enabled for spec in self.specs)

    @property
    def offload(self) -> frozenset[Tag]:
        """The tags some group offloads to host memory."""
        return frozenset().union(*(spec.offload for spec in self.specs))

    @property
    def compress(self) -> TagFormats:
        """The tags some group stores compressed, with their format (one format per tag)."""
        formats = {}
        for spec in self.specs:
            for tag, fmt in spec.compress.items():
                if formats.setdefault(tag, fmt) != fmt:
                    raise ValueError(
                        f"Layered: tag {str(tag)!r} is compressed as both {formats[tag]} and {fmt}"
                    )
        return TagFormats(formats)

    @property
    def kept_tags(self) -> frozenset[Tag]:
        """Every tag some group keeps (``RematSpec.kept_tags``)."""
        return frozenset().union(*(spec.kept_tags for spec in self.specs))

    def describe(self) -> str:
        """The groups in stack order, ``"<count> x <spec>"`` joined by ``+``; a spec that is
        no preset is written as its fields (``RematSpec(save=..., ...)``).

        Example:
            >>> from jaxckpt import remat
            >>> remat.Layered(((1, remat.RematSpec(save={"q_proj"})), (2, "full"))).describe()
            "1 x RematSpec(save={'q_proj'}) + 2 x full"
        """
        return " + ".join(f"{count} x {spec_label(spec)}" for count, spec in self.groups)

    def __str__(self) -> str:
        return self.describe()


def spec_label(spec: RematSpec) -> str:
    """A spec's preset name, or its fields that differ from ``RematSpec()``'s.

    Example:
        >>> from jaxckpt.remat import RematSpec
        >>> spec_label(RematSpec()), spec_label(RematSpec(layers_per_checkpoint=3, save={"attn_out"}))
        ('full', "RematSpec(save={'attn_out'}, layers_per_checkpoint=3)")
    """
    name = next((name for name, preset in PRESETS.items() if preset == spec), None)
    if name is not None:
        return name
    default = RematSpec()
    fields = []
    for field in dataclasses.fields(spec):
        value = getattr(spec, field.name)
        if value == getattr(default, field.name):
            continue
        if isinstance(value, frozenset):
            value = "{" + ", ".join(repr(str(tag)) for tag in sorted(value)) + "}"
        else:
            value = repr(value)
        fields.append(f"{field.name}={value}")
    return f"RematSpec({', '.join(fields)})"
