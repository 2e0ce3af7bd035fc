"""``TrainRun``: what ``train`` did, as a record and as JSON."""

import dataclasses

from jaxckpt.train._memory import MemoryReport
from jaxckpt.train._offload import offload_saves_memory
from jaxckpt.train._step import Trainer


@dataclasses.dataclass(frozen=True)
class TrainRun:
    """What ``train`` did: one record per step run, the step's memory analysis, the held-out
    evaluations and the data's counts.

    Example:
        >>> from jaxckpt import nn, train
        >>> cfg = nn.TransformerConfig.preset("tiny", n_layers=1, d_model=32, n_heads=2, ffn_dim=48)
        >>> run = train.train(cfg, train.RunConfig(steps=1, batch=2, seq=16, progress=False))
        >>> sorted(run.to_dict())  # doctest: +NORMALIZE_WHITESPACE
        ['data', 'eval', 'loss_scale', 'memory', 'optimizer', 'plan', 'resumed_from', 'skipped_steps',
         'steps', 'stopped', 'temp_bytes']
        >>> run.plan is None, run.skipped_steps
        (True, 0)
    """

    steps: list[dict]
    memory: MemoryReport
    trainer: Trainer = dataclasses.field(repr=False)
    plan: object = None
    """The planner's ``MemoryPlan`` that chose ``run.remat`` (``train(..., plan=)``), else None."""
    eval: list = dataclasses.field(default_factory=list)
    """``[{"step", "loss", "perplexity"}]``: every evaluation on held-out data, this run's and,
    after a resume, the earlier ones."""
    data: dict = dataclasses.field(default_factory=dict)
    """The data: ``{"kind": "windows" | "packed", "tokenizer", ...}`` and, for a packed
    stream, its counts (documents, split documents, packing efficiency, ...)."""
    skipped_steps: int = 0
    """Steps skipped for a non-finite loss or gradients (``on_nonfinite="skip"``, or the
    float16 loss scaler's overflows), this run's and, after a resume, the earlier ones."""
    loss_scale: "float | None" = None
    """The loss scale after the last step (None without loss scaling)."""
    resumed_from: "int | None" = None
    """The checkpoint step this run resumed from (None: it started at step 0)."""
    stopped: "dict | None" = None
    """``{"signal": "SIGTERM", "step": N}`` when a stop signal ended the run after ``N``
    steps (checkpointed there); None when it ran all its steps."""

    def to_dict(self) -> dict:
        """``{"steps": [{"step", "loss", "step_seconds", "skipped", "loss_scale"}], "temp_bytes",
        "memory", "plan", "eval", "data", "skipped_steps", "loss_scale", "optimizer",
        "resumed_from", "stopped"}``
        (``optimizer``: ``OptimizerConfig.to_dict()``, and with ``offload`` whether it saves
        device memory here, ``offload_saves_memory``: False on CPU)."""
        return {
            "steps": self.steps,
            "temp_bytes": self.memory.temp,
            "memory": self.memory.to_dict(),
            "plan": None if self.plan is None else self.plan.to_dict(),
            "eval": self.eval,
            "data": self.data,
            "skipped_steps": self.skipped_steps,
            "loss_scale": self.loss_scale,
            "optimizer": self.optimizer_report(),
            "resumed_from": self.resumed_from,
            "stopped": self.stopped,
        }

    def optimizer_report(self) -> dict:
        """The optimizer's settings, and with offload ``offload_saves_memory``."""
        settings = self.trainer.optimizer
        offloads = settings.offload or settings.offload_master
        extra = {"offload_saves_memory": offload_saves_memory()} if offloads else {}
        return {**settings.to_dict(), "loss_scale_mode": self.trainer.loss_scale_mode, **extra}
