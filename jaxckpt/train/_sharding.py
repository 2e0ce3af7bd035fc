"""Data parallelism and FSDP (ZeRO-3 style) on a JAX mesh: which array lives where.

Axis names: ``data`` (replicas of the state, the batch split across them),
``fsdp`` (parameters, gradients and optimizer state split across them, as is the
batch) and, when asked for, ``seq`` (context parallelism: every activation split along
the sequence, the attention computed across the shards by
``jaxckpt.attention.context_parallel_attention``). JAX's SPMD partitioner inserts the
all-gathers and reduce-scatters.

Where a leaf lives follows the logical axis names the NNX modules give every
parameter (``jaxckpt.nn.logical_axes``; the optimizer's moments inherit them) and
``LOGICAL_AXIS_RULES``: each leaf is split over ``fsdp`` along its largest axis whose
logical name may be split and whose size ``fsdp`` divides, and replicated when none
does (scalars, small vectors). The stacked-layer axis is never split: the scan
slices one layer at a time, and each layer's all-gather stays inside the loop.
Activations are pinned by ``activation_rules(mesh)``: the batch split over ``data`` and
``fsdp``, the sequence over ``seq``.
"""

import math

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxckpt.nn import logical_axes

AXES = ("data", "fsdp", "seq")
"""The mesh axes jaxckpt understands (``seq`` is in a mesh only when asked for)."""

BATCH_AXES = ("data", "fsdp")
"""The mesh axes the batch is split over."""

SEQ_AXIS = "seq"
"""The mesh axis the sequence is split over (context parallelism)."""

LOGICAL_AXIS_RULES = {
    "vocab": "fsdp",
    "positions": "fsdp",
    "embed": "fsdp",
    "heads": "fsdp",
    "kv_heads": "fsdp",
    "mlp": "fsdp",
    "head_dim": None,  # the q/k norms' scales: a few hundred numbers, kept whole
    "lora_rank": None,  # an adapter's rank axis: small; its other axis is split
    "layers": None,
    None: "fsdp",  # an axis without a name (a leaf the modules did not create)
}
"""Logical axis name -> the mesh axis it may be split over (None: never split)."""

ACTIVATION_RULES = {"batch": BATCH_AXES}
"""Activation logical axis -> mesh axes (``jaxckpt.nn.constrain``) on a mesh without ``seq``:
the batch over ``data`` and ``fsdp``, as the tokens are; the other activation axes stay whole."""


def activation_rules(mesh: Mesh) -> dict:
    """The activation rules of ``mesh``: ``ACTIVATION_RULES``, and ``seq -> "seq"`` when the
    mesh has a ``seq`` axis (every activation split along T).

    Example:
        >>> import jax
        >>> activation_rules(make_mesh({"fsdp": 1}, devices=jax.devices()[:1]))
        {'batch': ('data', 'fsdp')}
        >>> activation_rules(make_mesh({"seq": 1}, devices=jax.devices()[:1]))
        {'batch': ('data', 'fsdp'), 'seq': 'seq'}
    """
    rules = dict(ACTIVATION_RULES)
    if SEQ_AXIS in mesh.shape:
        rules["seq"] = SEQ_AXIS
    return rules


def seq_split(mesh: "Mesh | None") -> int:
    """How many devices the sequence is split over: the ``seq`` axis's size (1 without one).

    Example:
        >>> seq_split(None)
        1
    """
    return 1 if mesh is None else int(mesh.shape.get(SEQ_AXIS, 1))


def parse_mesh(text: str) -> dict[str, int]:
    """``"data=2,fsdp=4"`` -> ``{"data": 2, "fsdp": 4}`` (``"data=1,fsdp=2,seq=4"``: with a
    ``seq`` axis of 4, context parallelism).

    Raises:
        ValueError: for an unknown axis, a size that is not a positive integer, or a
            repeated axis, naming it (as ``mesh=``: the argument of ``train`` it comes from).

    Example:
        >>> parse_mesh("data=2,fsdp=4")
        {'data': 2, 'fsdp': 4}
        >>> parse_mesh("fsdp=2,seq=4")
        {'fsdp': 2, 'seq': 4}
    """
    axes: dict[str, int] = {}
    for part in str(text).split(","):
        name, _, size = part.strip().partition("=")
        if name not in AXES:
            raise ValueError(f"mesh={text!r}: unknown axis {name!r}; axes are {', '.join(AXES)}")
        if name in axes:
            raise ValueError(f"mesh={text!r}: axis {name!r} given twice")
        if not size.isdigit() or int(size) < 1:
            raise ValueError(
                f"mesh={text!r}: the size of {name!r} must be a positive integer, e.g. data=2,fsdp=4"
            )
        axes[name] = int(size)
    return axes


def make_mesh(axes: "dict[str, int] | str", devices=None) -> Mesh:
    """A mesh over ``devices`` (default: all of this process's) with the given axis sizes
    (missing ``data`` or ``fsdp``: 1; ``seq`` only when given).

    Raises:
        ValueError: when the sizes' product is not the number of devices (naming both).

    Example:
        >>> import jax
        >>> dict(make_mesh({"fsdp": 1}, devices=jax.devices()[:1]).shape)
        {'data': 1, 'fsdp': 1}
    """
    axes = parse_mesh(axes) if isinstance(axes, str) else dict(axes)
    names = BATCH_AXES + ((SEQ_AXIS,) if SEQ_AXIS in axes else ())
    shape = tuple(axes.get(name, 1) for name in names)
    devices = list(jax.devices() if devices is None else devices)
    if math.prod(shape) != len(devices):  # before any array is placed or step compiled
        text = ",".join(f"{name}={size}" for name, size in axes.items())
        spans = f": a mesh spans every device, e.g. fsdp={len(devices)}"
        spans = "" if math.prod(shape) > len(devices) else spans
        raise ValueError(
            f"mesh={text!r} needs {math.prod(shape)} devices; this process sees {len(devices)}{spans} "
            "(on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N simulates N)"
        )
    auto = (jax.sharding.AxisType.Auto,) * len(names)  # XLA's SPMD partitioner places collectives
    return jax.make_mesh(shape, names, axis_types=auto, devices=devices)


def check_batch_split(batch: int, mesh: "Mesh | None") -> None:
    """Raises a ValueError naming ``batch`` unless the mesh's batch axes split it evenly
    (data and fsdp both split the batch, ``seq`` splits the sequence; no mesh: one device,
    any batch).

    ``train.train`` calls it at entry, before the model is built.

    Example:
        >>> import jax
        >>> check_batch_split(3, make_mesh({"fsdp": 1}, devices=jax.devices()[:1]))
        >>> check_batch_split(3, None)
    """
    split = 1 if mesh is None else mesh.size // seq_split(mesh)
    if batch % split == 0:
        return
    axes = " x ".join(f"{name} {mesh.shape[name]}" for name in BATCH_AXES)  # not name=: a flag's
    fits = split * max(1, round(batch / split))
    raise ValueError(
        f"batch={batch} must be a multiple of the mesh's {split} devices ({axes}): each device "
        f"takes an equal share of the batch; e.g. batch={fits}"
    )


def leaf_spec(
    shape: tuple[int, ...], mesh: Mesh, names: "tuple[str | None, ...] | None" = None, axis: str = "fsdp"
) -> PartitionSpec:
    """The leaf split over ``axis`` along its largest dimension that ``mesh.shape[axis]``
    divides, among those whose logical name (``names``) ``LOGICAL_AXIS_RULES`` lets
    ``axis`` split. On a mesh with a ``seq`` axis, ``fsdp`` splits are over ``("fsdp", "seq")``:
    every device holds its own share of the state.

    Example:
        >>> import jax
        >>> mesh = make_mesh({"fsdp": 1}, devices=jax.devices()[:1])
        >>> tuple(leaf_spec((6, 4), mesh))
        ('fsdp', None)
        >>> tuple(leaf_spec((6, 4), mesh, names=("layers", "embed")))
        (None, 'fsdp')
        >>> tuple(leaf_spec((6, 4), make_mesh({"fsdp": 1, "seq": 1}, devices=jax.devices()[:1])))
        (('fsdp', 'seq'), None)
    """
    # on a mesh with a seq axis the state is split over it too (ZeRO-3 over every device, as
    # MaxText splits weights over its context axis): the seq devices would otherwise each hold
    # the fsdp share whole
    axes = (axis, SEQ_AXIS) if axis == "fsdp" and SEQ_AXIS in mesh.shape else (axis,)
    size = math.prod(mesh.shape[a] for a in axes)
    names = (None,) * len(shape) if names is None else names
    if len(names) != len(shape):
        raise ValueError(f"leaf_spec: {len(names)} logical names {names} for a shape {shape}")
    candidates = [
        d
        for d in range(len(shape))
        if LOGICAL_AXIS_RULES.get(names[d]) == axis and shape[d] % size == 0 and shape[d] >= size
    ]
    if not candidates:
        return PartitionSpec()
    best = max(candidates, key=lambda d: (shape[d], -d))
    split = axes if len(axes) > 1 else axis
    return PartitionSpec(*(split if d == best else None for d in range(len(shape))))


def state_shardings(state, mesh: Mesh):
    """A ``NamedSharding`` for every leaf of ``state`` (model + optimizer, ``nnx.State`` of
    arrays or of ``ShapeDtypeStruct``s), FSDP-split by the leaves' logical axis names.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from flax import nnx
        >>> mesh = make_mesh({"fsdp": 1}, devices=jax.devices()[:1])
        >>> shardings = state_shardings(nnx.State({"w": nnx.Param(jnp.ones((6, 4)))}), mesh)
        >>> tuple(shardings["w"].get_value().spec)  # split along the larger axis
        ('fsdp', None)
    """

    def sharding(leaf):
        if isinstance(leaf, nnx.Variable):
            value = leaf.get_value()
            return leaf.replace(NamedSharding(mesh, leaf_spec(np.shape(value), mesh, logical_axes(leaf))))
        return NamedSharding(mesh, leaf_spec(np.shape(leaf), mesh))

    return jax.tree.map(sharding, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Token batches ``[M, B, T + 1]``: B split over the batch axes (data and fsdp); the
    step itself splits T over ``seq`` (after putting it in the zigzag order)."""
    return NamedSharding(mesh, PartitionSpec(None, BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
    """The same value on every device (the loss)."""
    return NamedSharding(mesh, PartitionSpec())


def bytes_per_device(tree) -> dict[str, int]:
    """Bytes of ``tree``'s arrays held by each device: ``{str(device): bytes}``.

    Example:
        >>> import jax.numpy as jnp
        >>> list(bytes_per_device({"w": jnp.ones((4, 4))}).values())  # one device, 16 fp32
        [64]
    """
    out: dict[str, int] = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            out[str(shard.device)] = out.get(str(shard.device), 0) + shard.data.nbytes
    return out
