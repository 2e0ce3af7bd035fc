"""Remat specs as the planner reports them: JSON-ready dicts, preset names, saved tags."""

from jaxckpt._tags import PROJECTIONS
from jaxckpt.remat import PRESETS, RematSpec


def spec_dict(spec: RematSpec) -> dict:
    """A ``RematSpec`` as JSON-ready lists (``RematSpec(**spec_dict(spec)) == spec``).

    Example:
        >>> from jaxckpt import plan, remat
        >>> list(map(str, plan.spec_dict(remat.get("save_attn"))["save"]))
        ['attn_lse', 'attn_out']
    """
    return {
        "save": sorted(spec.save),
        "offload": sorted(spec.offload),
        "layers_per_checkpoint": spec.layers_per_checkpoint,
        "save_dots": spec.save_dots,
        "enabled": spec.enabled,
    }


def spec_name(spec: RematSpec) -> str:
    """The preset name of ``spec``, or ``"solved"``.

    Example:
        >>> from jaxckpt import plan, remat
        >>> plan.spec_name(remat.get("full")), plan.spec_name(remat.RematSpec(save={remat.Tag.Q_PROJ}))
        ('full', 'solved')
    """
    return next((name for name, preset in PRESETS.items() if preset == spec), "solved")


def saved_tags(spec: RematSpec) -> frozenset:
    """The tags a per-layer spec keeps on device or host (``save_dots`` adds the projections)."""
    return spec.save | spec.offload | (PROJECTIONS if spec.save_dots else frozenset())
