"""Named remat specs (``PRESETS``) and ``get``, which turns a name into a spec."""

import dataclasses
from collections.abc import Iterable
from types import MappingProxyType

from jaxckpt._tags import ATTENTION_RESIDUALS, PROJECTIONS, QKV, Tag
from jaxckpt.remat._spec import UNCOMPRESSIBLE, RematSpec

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


def get(spec: "str | RematSpec") -> RematSpec:
    """Returns the ``RematSpec`` for a preset name, or ``spec`` itself.

    Args:
        spec: a key of ``PRESETS`` or a ``RematSpec``.

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
    if isinstance(spec, RematSpec):
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
    raise TypeError(f"remat must be a preset name or a RematSpec, got {type(spec).__name__}: {spec!r}")


def compressed(spec: "str | RematSpec", fmt: str, tags: "Iterable[Tag | str] | None" = None) -> RematSpec:
    """``spec`` with the tags it keeps stored in ``fmt`` (what ``--compress`` asks for).

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
