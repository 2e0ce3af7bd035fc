"""``train``: data, trainer, checkpoints and progress put together."""

import dataclasses
import os
import shutil
import time
from pathlib import Path

import jax

from jaxckpt._checks import require_positive_int
from jaxckpt.nn import TransformerConfig
from jaxckpt.remat import AUTO
from jaxckpt.train._checkpoint import latest_step, read_meta, restore_checkpoint, save_checkpoint
from jaxckpt.train._data import ByteBatches, load_tokens
from jaxckpt.train._distributed import is_primary, resolve_mesh
from jaxckpt.train._init import initial_model
from jaxckpt.train._memory import MemoryReport, memory_report
from jaxckpt.train._progress import memory_text, train_progress
from jaxckpt.train._step import OptimizerConfig, Trainer, check_seq


@dataclasses.dataclass(frozen=True)
class TrainRun:
    """What ``train`` did: one record per step run, and the step's memory analysis.

    Example:
        >>> from jaxckpt import nn, train
        >>> cfg = nn.TransformerConfig.preset("tiny", n_layers=1, d_model=32, n_heads=2, ffn_dim=48)
        >>> run = train.train(cfg, steps=1, batch=2, seq=16, progress=False)
        >>> sorted(run.to_dict()), run.plan is None
        (['memory', 'plan', 'steps', 'temp_bytes'], True)
    """

    steps: list[dict]
    memory: MemoryReport
    trainer: Trainer = dataclasses.field(repr=False)
    plan: object = None
    """The planner's ``MemoryPlan`` that chose ``config.remat`` (``train(..., plan=)``), else None."""

    def to_dict(self) -> dict:
        """``{"steps": [{"step", "loss", "step_seconds"}], "temp_bytes", "memory", "plan"}``."""
        return {
            "steps": self.steps,
            "temp_bytes": self.memory.temp,
            "memory": self.memory.to_dict(),
            "plan": None if self.plan is None else self.plan.to_dict(),
        }


def _prepare_checkpoint_dir(directory: Path | None, resume: bool, force: bool) -> None:
    if directory is None or resume:
        return
    latest = latest_step(directory)
    if latest is None:
        return
    if not force:
        raise FileExistsError(
            f"{str(directory)!r} already holds checkpoints (latest step {latest}); "
            "pass resume=True to continue from it or force=True to replace it"
        )
    if is_primary():
        shutil.rmtree(directory)
    _barrier("jaxckpt_checkpoint_dir_cleared")


def _barrier(name: str) -> None:
    """Every process waits here for the others (nothing to do with one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


FREE_ON_RESUME = ("remat", "attention")
"""Config fields a resumed run may change: they do not change the numbers."""


def _check_resumable(saved: dict, meta: dict, directory: Path) -> None:
    """Raises a ValueError naming every setting that differs from the checkpointed run's."""

    def comparable(m: dict) -> dict:
        config = {k: v for k, v in m.get("config", {}).items() if k not in FREE_ON_RESUME}
        return {
            **{k: v for k, v in m.items() if k != "config"},
            **{f"config.{k}": v for k, v in config.items()},
        }

    old, new = comparable(saved), comparable(meta)
    changed = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
    if saved and changed:
        diffs = ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in changed)
        raise ValueError(f"resume=True: {str(directory)!r} was trained with different settings ({diffs})")


def train(
    config: TransformerConfig,
    *,
    steps: int,
    batch: int,
    seq: int,
    data: str | os.PathLike | None = None,
    seed: int = 0,
    micro_batches: int = 1,
    optimizer: OptimizerConfig | None = None,
    checkpoint_dir: str | os.PathLike | None = None,
    checkpoint_every: int | None = None,
    resume: bool = False,
    force: bool = False,
    init_from: str | os.PathLike | None = None,
    progress: bool = True,
    mesh=None,
    plan=None,
) -> TrainRun:
    """Trains a ``Transformer`` on byte-level text; the remat spec is ``config.remat``.

    ``config.remat == "auto"`` is answered by the planner before training (the planner
    compiles train steps, so it sits above ``train``): ``config, plan =
    jaxckpt.plan.resolve_auto(config, batch=..., seq=..., micro_batches=..., mesh=...)``,
    then ``train(config, ..., plan=plan)``.

    Step ``s`` always trains on the same batch (a pure function of ``seed`` and
    ``s``), so resuming from a checkpoint reproduces the uninterrupted run.

    Args:
        config: the model (including ``remat`` and ``attention``).
        steps: total number of steps; a resumed run continues up to it.
        batch, seq, micro_batches: each step sees ``micro_batches x batch`` windows of ``seq``.
        data: a text file (None: the built-in corpus).
        seed: parameter init and data order.
        checkpoint_dir: where to save (at the end, and every ``checkpoint_every`` steps).
        resume: continue from the latest checkpoint in ``checkpoint_dir``.
        force: replace existing checkpoints in ``checkpoint_dir``.
        init_from: take the parameters from a jaxckpt checkpoint directory (trained, or
            converted by ``jaxckpt convert``) or a Hugging Face directory (needs torch_bridge).
        progress: draw a progress bar.
        mesh: data parallel + FSDP: a ``jax.sharding.Mesh``, or axis sizes such as
            ``{"data": 2, "fsdp": 4}`` / ``"data=2,fsdp=4"`` over ``jax.devices()``.
            None: one device; in a multi-process run (after ``train.initialize``)
            ``data`` = the processes and ``fsdp`` = each process's devices.
        plan: the planner's ``MemoryPlan`` that chose ``config.remat``, kept in
            ``TrainRun.plan`` (its spec must be ``config.remat``).

    Multi-process runs: every process calls ``train`` with the same arguments (each
    builds the same model and global batches and places only its own shards); only
    process 0 draws the progress bar. Checkpoints work: every process writes its own
    shards through orbax into ``checkpoint_dir``, which must be one directory that all
    processes see (a shared file system across hosts); process 0 writes the metadata.

    Returns:
        A ``TrainRun``.

    Raises:
        ValueError / FileNotFoundError / FileExistsError: for bad arguments, a missing data
        file, or a checkpoint directory that would be overwritten without ``force``.

    Example:
        >>> from jaxckpt import nn, train
        >>> cfg = nn.TransformerConfig.preset("tiny", n_layers=1, d_model=32, n_heads=2, ffn_dim=48)
        >>> run = train.train(cfg, steps=2, batch=2, seq=16, progress=False)
        >>> [s["step"] for s in run.steps]
        [0, 1]
    """
    require_positive_int("steps", steps)
    check_seq(config, seq)
    _check_remat(config, plan)
    if resume and checkpoint_dir is None:
        raise ValueError("resume=True needs checkpoint_dir=")
    directory = None if checkpoint_dir is None else Path(checkpoint_dir)
    batches = ByteBatches(load_tokens(data, name="data"), batch, seq, seed=seed, micro_batches=micro_batches)
    mesh = resolve_mesh(mesh)
    trainer = Trainer(initial_model(config, seed, init_from, optimizer), optimizer=optimizer, mesh=mesh)
    # Compiling checks the sequence against max_len: fail before --force deletes anything.
    memory = memory_report(trainer.compile(batches.batch_at(0).shape))
    _prepare_checkpoint_dir(directory, resume, force)
    start = 0
    meta = {
        "config": config.to_dict(),
        "batch": batch,
        "seq": seq,
        "seed": seed,
        "micro_batches": micro_batches,
    }
    if resume:
        _check_resumable(read_meta(directory), meta, directory)
        step, trainer.state = restore_checkpoint(directory, trainer.state)
        start = step
    records = _run_steps(trainer, batches, start, steps, progress, memory, directory, checkpoint_every, meta)
    if directory is not None and records:
        _save(directory, steps, trainer.state, meta)
    return TrainRun(records, memory, trainer, plan)


def _check_remat(config: TransformerConfig, plan) -> None:
    """``remat="auto"`` must be resolved before ``train``; a given plan must be the config's."""
    if config.remat == AUTO:
        raise ValueError(
            "train: config.remat='auto' is resolved by the planner before training: call "
            "config, plan = jaxckpt.plan.resolve_auto(config, batch=..., seq=..., micro_batches=..., "
            "mesh=...), then train.train(config, ..., plan=plan)"
        )
    if plan is not None and plan.spec != config.remat_spec:
        raise ValueError(
            f"train: plan chose {plan.spec!r} but config.remat is {config.remat!r}: pass the config "
            "that jaxckpt.plan.resolve_auto returned with it"
        )


def _run_steps(trainer, batches, start, steps, progress, memory, directory, every, meta) -> list[dict]:
    records = []
    tokens_per_step = batches.micro_batches * batches.batch * batches.seq
    with train_progress(steps, start, progress and is_primary()) as update:
        for step in range(start, steps):
            tokens = batches.batch_at(step)
            t0 = time.perf_counter()
            loss = float(jax.block_until_ready(trainer.step(tokens)))
            seconds = time.perf_counter() - t0
            records.append({"step": step, "loss": loss, "step_seconds": seconds})
            update(step + 1, loss, tokens_per_step / seconds, memory_text(memory))
            if directory is not None and every and (step + 1) % every == 0 and step + 1 < steps:
                _save(directory, step + 1, trainer.state, meta)
    return records


def _save(directory: Path, step: int, state, meta: dict) -> None:
    """Every process saves its shards (orbax); only process 0 writes the metadata file."""
    save_checkpoint(directory, step, state, meta if is_primary() else None)
