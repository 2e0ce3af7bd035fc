"""Remat specs as the planner reports them: JSON-ready dicts, preset names, saved tags."""

import dataclasses

from jaxckpt._tags import PROJECTIONS
from jaxckpt.remat import DEFAULT_GROUP, PRESETS, Layered, RematSpec, compressed


def spec_dict(spec: "RematSpec | Layered") -> dict:
    """A ``RematSpec`` as JSON-ready lists (``RematSpec(**spec_dict(spec)) == spec``); a
    ``remat.Layered`` one as its ``groups``, each its spec's dict with its ``layers``.

    Example:
        >>> from jaxckpt import plan, remat
        >>> list(map(str, plan.spec_dict(remat.get("save_attn"))["save"]))
        ['attn_lse', 'attn_out']
        >>> plan.spec_dict(remat.compressed("full", "int8"))["compress"]  # only when it compresses
        {'layer_input': 'int8'}
        >>> [g["layers"] for g in plan.spec_dict(remat.Layered(((2, "save_attn"), (3, "full"))))["groups"]]
        [2, 3]
    """
    if isinstance(spec, Layered):
        return {"groups": [{"layers": count, **spec_dict(group)} for count, group in spec.groups]}
    out = {
        "save": sorted(spec.save),
        "offload": sorted(spec.offload),
        "layers_per_checkpoint": spec.layers_per_checkpoint,
        "save_dots": spec.save_dots,
        "enabled": spec.enabled,
    }
    if spec.compress:
        out["compress"] = {str(tag): fmt for tag, fmt in spec.compress.items()}
    if spec.compress_group != DEFAULT_GROUP:
        out["compress_group"] = spec.compress_group
    return out


def spec_name(spec: RematSpec) -> str:
    """The preset name of ``spec``; ``"<preset>+<format>"`` for a preset whose kept tags are
    all compressed in one format (``remat.compressed(preset, fmt)``, what ``--compress``
    trains); else ``"solved"``.

    Example:
        >>> from jaxckpt import plan, remat
        >>> plan.spec_name(remat.get("full")), plan.spec_name(remat.RematSpec(save={remat.Tag.Q_PROJ}))
        ('full', 'solved')
        >>> plan.spec_name(remat.compressed("save_attn", "fp8"))
        'save_attn+fp8'
    """
    name = next((name for name, preset in PRESETS.items() if preset == spec), None)
    if name is not None:
        return name
    formats = set(spec.compress.values())
    if len(formats) == 1:
        (fmt,) = formats
        plain = dataclasses.replace(spec, compress={})
        for name, preset in PRESETS.items():
            if preset == plain and compressed(preset, fmt) == spec:
                return f"{name}+{fmt}"
    return "solved"


def saved_tags(spec: RematSpec) -> frozenset:
    """The tags a per-layer spec keeps on device or host (``save_dots`` adds the projections)."""
    return spec.save | spec.offload | (PROJECTIONS if spec.save_dots else frozenset())
