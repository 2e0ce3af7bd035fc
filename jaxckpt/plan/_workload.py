"""``Workload``: what the planner plans for, and every per-device quantity derived from it.

A workload is one train step: the model, the **global** batch ``B`` of ``[B, T]``
sequences, the micro-batches accumulated per step, the optimizer (its name, the dtype
of its moments, where its state lives), where the master weights live, and the FSDP
devices it is split over (``jaxckpt train --mesh fsdp=D``: every device holds a
``1/D`` share of the state and ``B / D`` sequences). LoRA and the base's quantization
are the model's (``config.lora``, ``config.quantize_base``): then only the adapters
have gradients and optimizer state. The remat spec is not part of it: it is what the
planner chooses (``measure(workload, remat)``).

This module is the bottom of ``jaxckpt.plan``; the other modules import it.
"""

import dataclasses
import functools
from collections.abc import Mapping
from types import MappingProxyType

import jax

from jaxckpt import train
from jaxckpt._checks import require_positive_int
from jaxckpt.nn import TransformerConfig
from jaxckpt.train import OptimizerConfig, has_master_weights, parse_mesh

OPTIMIZER_NAMES = tuple(train.OPTIMIZERS)
"""The optimizers ``jaxckpt train --optimizer`` trains with: the keys of the one registry,
``train.OPTIMIZERS``."""

MOMENTS_DTYPES = (None, *train.MOMENTS_DTYPES)
"""Storage dtypes of the optimizer's moments: ``train.MOMENTS_DTYPES``, or None (the trained
parameters' own, float32 for float16 ones)."""

PLACEMENTS = ("device", "host")
"""Where a part of the train state lives: device memory, or the host's (``pinned_host``)."""


def optimizer_config(
    name: str = "adamw",
    moments_dtype: "str | None" = None,
    offload: bool = False,
    offload_master: bool = False,
):
    """The ``train.OptimizerConfig`` that trains with ``name``: the planner sizes the state of
    exactly the transformation the trainer builds (``OptimizerConfig.transformation``).

    Example:
        >>> optimizer_config("sgd").name
        'sgd'
    """
    fields = {
        "name": name,
        "moments_dtype": moments_dtype,
        "offload": offload,
        "offload_master": offload_master,
    }
    known = {f.name for f in dataclasses.fields(OptimizerConfig)}
    given = {k: v for k, v in fields.items() if k in known}
    return OptimizerConfig(**given)


def _transformation(name: str):
    return optimizer_config(name).transformation()


OPTIMIZERS = MappingProxyType({name: functools.partial(_transformation, name) for name in OPTIMIZER_NAMES})
"""Optimizer name -> a factory of the optax transformation ``jaxckpt train`` builds for it."""

MESH_AXES = ("data", "fsdp")
"""The mesh axes ``jaxckpt.train`` splits over; the planner models ``data=1, fsdp=D``."""


CHOICES = MappingProxyType(
    {
        "optimizer": OPTIMIZER_NAMES,
        "moments_dtype": MOMENTS_DTYPES,
        "optimizer_placement": PLACEMENTS,
        "master_placement": PLACEMENTS,
    }
)
"""``Workload`` field -> its valid values."""


def require_workload(workload, where: str) -> None:
    """Raises a ``TypeError`` naming ``where`` unless ``workload`` is a ``Workload``."""
    if not isinstance(workload, Workload):
        raise TypeError(
            f"{where}: workload must be a plan.Workload, got {type(workload).__name__} "
            "(e.g. plan.Workload(config, batch=8, seq=512))"
        )


@dataclasses.dataclass(frozen=True)
class Workload:
    """One train step to plan for (frozen and hashable: the planner caches on it).

    Attributes:
        config: the model (its ``remat`` field is ignored: the planner is given the spec).
        batch: the **global** batch ``B``, summed over the devices (one micro-batch).
        seq: tokens per sequence ``T``.
        micro_batches: micro-batches accumulated per step (the input is ``[M, B, T + 1]``).
        optimizer: a key of ``OPTIMIZERS``.
        devices: FSDP devices (``fsdp=D``); every byte figure is then one device's.
        moments_dtype: storage dtype of the optimizer's moments (``MOMENTS_DTYPES``; None:
            the trained parameters' dtype, as ``jaxckpt train`` defaults).
        optimizer_placement: ``"device"``, or ``"host"``: the optimizer state lives in host
            memory (``pinned_host``) and the update streams it leaf by leaf.
        master_placement: ``"device"``, or ``"host"``: the fp32 master weights of a full
            fine-tuning (``param_dtype="float32"``, 16-bit compute) live in host memory
            and the device holds their copy in the compute dtype.

    A new field is one line here (with its default); ``to_dict``, ``from_dict`` and
    ``replace`` follow the dataclass fields.

    Raises:
        TypeError: when ``config`` is not a ``TransformerConfig``.
        ValueError: for a size that is not a positive int, a ``seq`` over the model's
            ``max_len``, an unknown optimizer, or a batch the devices do not divide (the
            message names the fields).

    Example:
        >>> from jaxckpt import nn, plan
        >>> w = plan.Workload(nn.TransformerConfig.preset("tiny"), batch=8, seq=64, devices=4)
        >>> w.local_batch, w.local_tokens
        (2, 128)
    """

    config: TransformerConfig
    batch: int
    seq: int
    micro_batches: int = 1
    optimizer: str = "adamw"
    devices: int = 1
    moments_dtype: str | None = None
    optimizer_placement: str = "device"
    master_placement: str = "device"

    def __post_init__(self):
        if not isinstance(self.config, TransformerConfig):
            raise TypeError(f"Workload: config must be a TransformerConfig, got {type(self.config).__name__}")
        for name in ("batch", "seq", "micro_batches", "devices"):
            require_positive_int(name, getattr(self, name), "Workload: ")
        if self.seq > self.config.max_len:  # as train.train refuses it, before anything is traced
            raise ValueError(
                f"Workload: seq={self.seq} exceeds the model's config.max_len={self.config.max_len}; "
                "plan for at most max_len tokens per sequence"
            )
        for name, valid in CHOICES.items():
            if getattr(self, name) not in valid:
                names = ", ".join(map(str, valid))
                raise ValueError(f"Workload: {name}={getattr(self, name)!r} is unknown; valid: {names}")
        if self.master_placement == "host" and not self.has_master_weights:
            raise ValueError(
                "Workload: master_placement='host' needs fp32 master weights of a full fine-tuning "
                "(param_dtype='float32', a 16-bit dtype, no lora); got "
                f"param_dtype={self.config.param_dtype!r}, "
                f"dtype={self.config.dtype!r}, lora={self.config.lora is not None}"
            )
        if self.batch % self.devices:
            raise ValueError(
                f"Workload: batch={self.batch} must be a multiple of devices={self.devices}: FSDP gives "
                "each device an equal share of the batch"
            )

    @classmethod
    def on_mesh(cls, config: TransformerConfig, batch: int, seq: int, mesh, **fields) -> "Workload":
        """The workload of a run on ``mesh`` (as ``jaxckpt.train.train`` takes it).

        Args:
            mesh: None (one device), a ``jax.sharding.Mesh``, axis sizes such as
                ``{"fsdp": 4}`` or ``"fsdp=4"``. The planner models FSDP meshes only.
            fields: the other fields (``micro_batches``, ``optimizer``).

        Raises:
            ValueError: for a mesh with a ``data`` axis.

        Example:
            >>> from jaxckpt import nn, plan
            >>> plan.Workload.on_mesh(nn.TransformerConfig.preset("tiny"), 8, 64, "fsdp=4").devices
            4
        """
        if mesh is None:
            return cls(config, batch, seq, **fields)
        if isinstance(mesh, jax.sharding.Mesh):
            shape = dict(mesh.shape)
        else:
            shape = parse_mesh(mesh) if isinstance(mesh, str) else dict(mesh)
        shape = {name: shape.get(name, 1) for name in MESH_AXES} | shape
        if shape["data"] != 1:
            raise ValueError(
                f"remat=auto plans per device for FSDP meshes (fsdp=N); mesh={shape} has a data axis: "
                "use mesh=fsdp=N, or pick remat= explicitly"
            )
        return cls(config, batch, seq, **fields, devices=shape["fsdp"])

    @property
    def has_master_weights(self) -> bool:
        """Whether the trained weights are fp32 masters of a 16-bit compute (full fine-tuning)."""
        return has_master_weights(self.config)

    @property
    def optimizer_config(self) -> OptimizerConfig:
        """The ``train.OptimizerConfig`` this workload trains with (name, moments, placement)."""
        return optimizer_config(
            self.optimizer,
            self.moments_dtype,
            self.optimizer_placement == "host",
            self.master_placement == "host",
        )

    @property
    def local_batch(self) -> int:
        """One device's share of ``batch`` (``B / D``)."""
        return self.batch // self.devices

    @property
    def local_tokens(self) -> int:
        """Tokens one device runs per micro-batch (``B / D x T``)."""
        return self.local_batch * self.seq

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """The step's global token input ``[M, B, T + 1]`` (int32)."""
        return (self.micro_batches, self.batch, self.seq + 1)

    @property
    def input_bytes(self) -> int:
        """Bytes of one device's share of the token input."""
        return self.micro_batches * self.local_batch * (self.seq + 1) * 4

    @property
    def mesh_shape(self) -> dict[str, int]:
        """The mesh planned for: every device in ``fsdp`` (ZeRO-3), ``data=1``."""
        return {"data": 1, "fsdp": self.devices}

    def replace(self, **changes) -> "Workload":
        """A copy with ``changes`` applied (and validated)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """The fields as JSON-ready values (``config`` through ``TransformerConfig.to_dict``)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {**fields, "config": self.config.to_dict()}

    @classmethod
    def from_dict(cls, fields: Mapping) -> "Workload":
        """The workload that ``to_dict`` wrote.

        Raises:
            ValueError: naming any field that ``Workload`` does not have.
        """
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(f"Workload.from_dict: unknown fields {unknown}; valid: {sorted(known)}")
        return cls(**{**fields, "config": TransformerConfig.from_dict(fields["config"])})
