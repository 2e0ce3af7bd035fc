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
from collections.abc import Mapping

import jax

from jaxckpt import train
from jaxckpt._checks import known_fields, require_positive_int
from jaxckpt.attention import check_strategy
from jaxckpt.nn import TransformerConfig
from jaxckpt.train import OptimizerConfig, has_master_weights, parse_mesh

OPTIMIZERS = train.OPTIMIZERS
"""The optimizers ``jaxckpt train --optimizer`` trains with: the one registry, ``train.OPTIMIZERS``."""

MOMENTS_DTYPES = (None, *train.MOMENTS_DTYPES)
"""Storage dtypes of the optimizer's moments: ``train.MOMENTS_DTYPES``, or None (the trained
parameters' own, float32 for float16 ones)."""

PLACEMENTS = ("device", "host")
"""Where a part of the train state lives: device memory, or the host's (``pinned_host``)."""


def placement(offloaded: bool) -> str:
    """``"host"`` for state offloaded to ``pinned_host`` memory, else ``"device"`` (how a
    plan's report names where a part of the train state lives)."""
    return PLACEMENTS[bool(offloaded)]


MESH_AXES = ("data", "fsdp")
"""The mesh axes ``jaxckpt.train`` splits the batch over; the planner models ``data=1, fsdp=D``
(and a ``seq`` axis: ``Workload.seq_shards``)."""


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

    ``Workload.from_run(model_config, run)`` is the step ``train.train(model_config, run)``
    runs: built from the same two values, with nothing translated in between.

    Attributes:
        config: the model.
        batch: the **global** batch ``B``, summed over the devices (one micro-batch).
        seq: tokens per sequence ``T``.
        micro_batches: micro-batches accumulated per step (the input is ``[M, B, T + 1]``).
        optimizer: the ``train.OptimizerConfig`` the step trains with: its name, the dtype
            of its moments, whether its state (``offload``) and the fp32 master weights of a
            full fine-tuning (``offload_master``, ``param_dtype="float32"`` with a 16-bit
            compute) live in host memory (``pinned_host``), and the in-step skip of
            non-finite steps.
        devices: all the devices (``fsdp=D``, or ``fsdp=D/S,seq=S``); every byte figure is
            then one device's.
        attention: the ``flash_attention`` implementation the step runs (None: automatic).
        seq_shards: of the devices, how many split each sequence (the mesh's ``seq`` axis,
            context parallelism): the batch is split over the other ``fsdp = devices /
            seq_shards``, every activation over these along T, and the state over all.
        context_parallel: the attention's strategy across the sequence's shards
            (``"all_gather"`` or ``"ring"``; ``jaxckpt train --context-parallel``).

    A new field is one line here (with its default); ``to_dict``, ``from_dict`` and
    ``replace`` follow the dataclass fields.

    Raises:
        TypeError: when ``config`` is not a ``TransformerConfig`` or ``optimizer`` not an
            ``OptimizerConfig``.
        ValueError: for a size that is not a positive int, a ``seq`` over the model's
            ``max_len``, host master weights without fp32 masters, or a batch the devices
            do not divide (the message names the fields).

    Example:
        >>> from jaxckpt import nn, plan
        >>> w = plan.Workload(nn.TransformerConfig.preset("tiny"), batch=8, seq=64, devices=4)
        >>> w.local_batch, w.local_tokens, w.optimizer.name
        (2, 128, 'adamw')
    """

    config: TransformerConfig
    batch: int
    seq: int
    micro_batches: int = 1
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    devices: int = 1
    attention: "str | None" = None
    seq_shards: int = 1
    context_parallel: str = "all_gather"

    def __post_init__(self):
        if not isinstance(self.config, TransformerConfig):
            raise TypeError(f"Workload: config must be a TransformerConfig, got {type(self.config).__name__}")
        if not isinstance(self.optimizer, OptimizerConfig):
            raise TypeError(
                f"Workload: optimizer must be a train.OptimizerConfig, got {self.optimizer!r} "
                "(e.g. train.OptimizerConfig(name='sgd'))"
            )
        for name in ("batch", "seq", "micro_batches", "devices", "seq_shards"):
            require_positive_int(name, getattr(self, name), "Workload: ")
        if self.seq > self.config.max_len:  # as train.train refuses it, before anything is traced
            raise ValueError(
                f"Workload: seq={self.seq} exceeds the model's config.max_len={self.config.max_len}; "
                "plan for at most max_len tokens per sequence"
            )
        if self.optimizer.offload_master and not self.has_master_weights:
            raise ValueError(
                "Workload: optimizer.offload_master=True needs fp32 master weights of a full fine-tuning "
                "(param_dtype='float32', a 16-bit dtype, no lora); got "
                f"param_dtype={self.config.param_dtype!r}, "
                f"dtype={self.config.dtype!r}, lora={self.config.lora is not None}"
            )
        if self.devices % self.seq_shards:
            raise ValueError(
                f"Workload: seq_shards={self.seq_shards} must divide devices={self.devices}: the mesh is "
                f"fsdp=devices/seq_shards, seq=seq_shards"
            )
        if self.batch % self.fsdp:
            raise ValueError(
                f"Workload: batch={self.batch} must be a multiple of devices={self.devices}"
                + (f" / seq_shards={self.seq_shards}" if self.seq_shards > 1 else "")
                + ": FSDP gives each device an equal share of the batch"
            )
        if self.seq_shards > 1 and self.seq % (2 * self.seq_shards):
            raise ValueError(
                f"Workload: seq={self.seq} must be a multiple of 2 x seq_shards={self.seq_shards}: each "
                "device of the seq axis holds two chunks of every row (the load-balanced order)"
            )
        check_strategy(self.context_parallel, "Workload: context_parallel")

    @classmethod
    def from_run(cls, model_config: TransformerConfig, run: train.RunConfig) -> "Workload":
        """The step ``train.train(model_config, run)`` runs: ``run``'s sizes, mesh, optimizer
        (with the skip of ``on_nonfinite="skip"``, whose select costs memory), attention and
        the MLP's tiling (``run.model_config(model_config)``: ``run.mlp_chunk`` when set).

        Raises:
            TypeError: when ``run`` is not a ``train.RunConfig``.
            ValueError: for a mesh with a ``data`` axis (the planner models FSDP meshes).

        Example:
            >>> from jaxckpt import nn, plan, train
            >>> run = train.RunConfig(steps=10, batch=8, seq=64, mesh="fsdp=4",
            ...                       optimizer=train.OptimizerConfig(name="sgd", offload=True))
            >>> w = plan.Workload.from_run(nn.TransformerConfig.preset("tiny"), run)
            >>> w.devices, w.optimizer is run.optimizer
            (4, True)
        """
        if not isinstance(run, train.RunConfig):
            raise TypeError(f"Workload.from_run: run must be a train.RunConfig, got {type(run).__name__}")
        return cls.on_mesh(
            run.model_config(model_config),
            run.batch,
            run.seq,
            run.mesh,
            micro_batches=run.micro_batches,
            optimizer=run.step_optimizer,
            attention=run.attention,
            context_parallel=run.context_parallel,
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
        seq_shards = shape.get("seq", 1)
        return cls(config, batch, seq, **fields, devices=shape["fsdp"] * seq_shards, seq_shards=seq_shards)

    @property
    def has_master_weights(self) -> bool:
        """Whether the trained weights are fp32 masters of a 16-bit compute (full fine-tuning)."""
        return has_master_weights(self.config)

    @property
    def fsdp(self) -> int:
        """The devices the batch is split over (``devices / seq_shards``; the state is split
        over every device, ``jaxckpt.train.leaf_spec``)."""
        return self.devices // self.seq_shards

    @property
    def local_batch(self) -> int:
        """One device's share of ``batch`` (``B / fsdp``)."""
        return self.batch // self.fsdp

    @property
    def local_seq(self) -> int:
        """One device's share of each sequence (``T / seq_shards``)."""
        return self.seq // self.seq_shards

    @property
    def local_tokens(self) -> int:
        """Tokens one device runs per micro-batch (``B / fsdp x T / seq_shards``)."""
        return self.local_batch * self.local_seq

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
        """The mesh planned for: ``data=1``, the devices in ``fsdp`` (ZeRO-3), and a ``seq``
        axis of ``seq_shards`` when the sequence is split (context parallelism)."""
        seq = {"seq": self.seq_shards} if self.seq_shards > 1 else {}
        return {"data": 1, "fsdp": self.fsdp, **seq}

    def replace(self, **changes) -> "Workload":
        """A copy with ``changes`` applied (and validated)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """The fields as JSON-ready values (``config`` and ``optimizer`` through their ``to_dict``)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {**fields, "config": self.config.to_dict(), "optimizer": self.optimizer.to_dict()}

    @classmethod
    def from_dict(cls, fields: Mapping) -> "Workload":
        """The workload that ``to_dict`` wrote.

        Raises:
            ValueError: naming any field that ``Workload`` does not have.
        """
        fields = known_fields(cls, fields, "Workload")
        parts = {"config": TransformerConfig.from_dict(fields["config"])}
        if "optimizer" in fields:
            parts["optimizer"] = OptimizerConfig.from_dict(fields["optimizer"])
        return cls(**{**fields, **parts})
