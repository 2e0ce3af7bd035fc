"""Named remat specs (``PRESETS``) and ``get``, which turns a name into a spec."""

from types import MappingProxyType

from jaxckpt._tags import ATTENTION_RESIDUALS, PROJECTIONS, QKV, Tag
from jaxckpt.remat._spec import RematSpec

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
