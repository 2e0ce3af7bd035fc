"""``train``: data, trainer, checkpoints and progress put together."""

import os
import shutil
from pathlib import Path

import jax

from jaxckpt._checks import require_positive_int
from jaxckpt.data import ByteTokenizer, tokenizer_for, tokenizer_name
from jaxckpt.nn import TransformerConfig
from jaxckpt.remat import AUTO
from jaxckpt.train._checkpoint import latest_step, read_meta, restore_checkpoint
from jaxckpt.train._distributed import is_primary, resolve_mesh
from jaxckpt.train._eval import Evaluator
from jaxckpt.train._init import check_init_from, initial_model, source_hf_fields
from jaxckpt.train._memory import memory_report
from jaxckpt.train._nonfinite import check_on_nonfinite, optimizer_for
from jaxckpt.train._run import TrainRun
from jaxckpt.train._run_data import DataOptions, run_data
from jaxckpt.train._run_steps import Run
from jaxckpt.train._sharding import check_batch_split
from jaxckpt.train._step import OptimizerConfig, Trainer, check_seq, check_step_tokens
from jaxckpt.train._stop import stop_requests


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

OPTIMIZER_FREE_ON_RESUME = ("offload", "skip_nonfinite")
"""``OptimizerConfig`` fields a resumed run may change (the state's layout is the same)."""

RESULTS = ("eval", "data_states", "data_stats", "hf_fields", "checkpoints")
"""``jaxckpt.json`` keys that record what a run did, not how it was set up."""


def _check_resumable(saved: dict, meta: dict, directory: Path) -> None:
    """Raises a ValueError naming every setting that differs from the checkpointed run's."""

    def comparable(m: dict) -> dict:
        config = {k: v for k, v in m.get("config", {}).items() if k not in FREE_ON_RESUME}
        # a field added since the checkpoint was written had its default then
        settings = {**OptimizerConfig().to_dict(), **m["optimizer"]} if "optimizer" in m else {}
        optimizer = {k: v for k, v in settings.items() if k not in OPTIMIZER_FREE_ON_RESUME}
        return {
            **{k: v for k, v in m.items() if k not in ("config", "optimizer") and k not in RESULTS},
            **{f"config.{k}": v for k, v in config.items()},
            **{f"optimizer.{k}": v for k, v in optimizer.items()},
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
    tokenizer: str | os.PathLike | None = None,
    text_per_line: bool = False,
    eval_data: str | os.PathLike | None = None,
    eval_split: float | None = None,
    eval_every: int | None = None,
    on_nonfinite: str = "stop",
) -> TrainRun:
    """Trains a ``Transformer``, from scratch or from ``init_from``, on byte-level text or
    on a data file tokenized by the model's tokenizer; the remat spec is ``config.remat``.

    ``config.remat == "auto"`` is answered by the planner before training (the planner
    compiles train steps, so it sits above ``train``): ``config, plan =
    jaxckpt.plan.resolve_auto(config, batch=..., seq=..., micro_batches=..., mesh=...)``,
    then ``train(config, ..., plan=plan)``.

    Byte-level text (the built-in corpus, or a ``.txt`` file with the byte tokenizer) is
    cut into random windows: step ``s`` trains on a pure function of ``seed`` and ``s``.
    Any other data (``.jsonl``, ``.json``, ``.parquet``, or text read with a checkpoint's
    tokenizer) is streamed, shuffled by ``seed``, and packed into rows of ``seq`` with
    segment ids (``jaxckpt.data.PackedBatches``); the stream's state is saved with each
    checkpoint. Either way, resuming reproduces the uninterrupted run's batches exactly.

    Args:
        config: the model (including ``remat`` and ``attention``).
        steps: total number of steps; a resumed run continues up to it.
        batch, seq, micro_batches: each step sees ``micro_batches x batch`` windows of ``seq``.
        data: a data file or directory (``.txt``, ``.jsonl``, ``.json``, ``.parquet``; None:
            the built-in corpus). Records are ``{"text"}``, ``{"messages"}`` (loss on the
            assistant's turns) or ``{"prompt", "completion"}`` (loss on the completion).
        tokenizer: ``"bytes"``, or a directory holding ``tokenizer.json`` (or that file);
            None: ``init_from``'s own tokenizer, or bytes without ``init_from``.
        text_per_line: ``.txt`` data holds one document per non-empty line.
        eval_data, eval_split: held-out data: a separate file, or the fraction of ``data``'s
            records (of its bytes, for byte windows) held out of training.
        eval_every: evaluate after every ``eval_every`` steps, and after the last (with
            held-out data and no ``eval_every``: after the last only).
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
        on_nonfinite: ``"stop"`` raises ``NonFiniteError`` at the first step whose loss
            is not finite, naming it, and never checkpoints non-finite params (the last
            checkpoint is the last good state); ``"skip"`` skips each step whose loss or
            gradients are not finite (params and optimizer state unchanged: the step
            carries a select, which costs memory) and counts it
            (``TrainRun.skipped_steps``). Under dynamic loss
            scaling (float16) an overflow of the scaled gradients is the scaler's to
            answer: it skips, halves the scale and goes on, whichever the policy.

    Crashes and preemption: a checkpoint is the latest only once it is complete (a
    killed save is never resumed from), and SIGTERM (a preempted job) finishes the
    current step, saves a checkpoint (with ``checkpoint_dir``) and returns, with
    ``TrainRun.stopped`` saying so. ``resume=True`` on a directory with no checkpoint
    yet starts at step 0 (``TrainRun.resumed_from`` is None then).

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
        CheckpointWriteError: a checkpoint could not be written (a full disk); the
            previous one is intact.
        NonFiniteError: a step was not finite and ``on_nonfinite="stop"``.

    Example:
        >>> from jaxckpt import nn, train
        >>> cfg = nn.TransformerConfig.preset("tiny", n_layers=1, d_model=32, n_heads=2, ffn_dim=48)
        >>> run = train.train(cfg, steps=2, batch=2, seq=16, progress=False)
        >>> [s["step"] for s in run.steps]
        [0, 1]
    """
    require_positive_int("steps", steps)
    check_on_nonfinite(on_nonfinite)
    check_seq(config, seq)
    check_step_tokens(batch, seq, micro_batches)
    mesh = resolve_mesh(mesh)
    check_batch_split(batch, mesh)  # before any data is read or model built
    _check_remat(config, plan)
    if resume and checkpoint_dir is None:
        raise ValueError("resume=True needs checkpoint_dir=")
    options = DataOptions(data, text_per_line, eval_data, eval_split)
    if eval_every is not None:
        require_positive_int("eval_every", eval_every)
        if eval_data is None and eval_split is None:
            raise ValueError("eval_every needs held-out data: give eval_data or eval_split")
    directory = None if checkpoint_dir is None else Path(checkpoint_dir)
    if init_from is not None:
        check_init_from(config, init_from)  # the model's own errors come first
    tok = tokenizer_for(init_from, tokenizer)
    _check_vocab(tok, config)
    feed = run_data(options, tok, batch=batch, seq=seq, micro_batches=micro_batches, seed=seed)
    optimizer = optimizer_for(optimizer, on_nonfinite)
    trainer = Trainer(
        initial_model(config, seed, init_from, optimizer), optimizer=optimizer, mesh=mesh, seed=seed
    )
    # Compiling checks the sequence against max_len: fail before --force deletes anything.
    memory = memory_report(trainer.compile(feed.first))
    _prepare_checkpoint_dir(directory, resume, force)
    meta = {
        "config": config.to_dict(),
        "batch": batch,
        "seq": seq,
        "seed": seed,
        "micro_batches": micro_batches,
        "data": {"kind": feed.kind, **options.to_dict()},
        "tokenizer": tokenizer_name(tok),
        "optimizer": trainer.optimizer.to_dict(),
    }
    run = Run(trainer, feed, directory, meta, Evaluator(trainer.model, mesh) if _evaluates(options) else None)
    run.results["hf_fields"] = source_hf_fields(init_from)
    start, state, resumed_from = 0, None, None
    if resume and latest_step(directory) is not None:
        saved = read_meta(directory)
        _check_resumable(saved, meta, directory)
        # orbax restores into trainer.state's shardings, memory kinds (offload) included
        start, trainer.state = restore_checkpoint(directory, trainer.state)
        state, resumed_from = run.resume(saved, start), start
    run.sources = _tokenizer_sources(tokenizer, init_from, tok)
    run.on_nonfinite = on_nonfinite
    with stop_requests() as stop:
        records = run.steps(start, steps, state, progress, memory, checkpoint_every, eval_every, stop)
    scale = trainer.loss_scale()
    return TrainRun(
        records,
        memory,
        trainer,
        plan,
        run.results["eval"],
        run.data_report(),
        skipped_steps=scale["skipped_steps"],
        loss_scale=scale["scale"],
        resumed_from=resumed_from,
        stopped=None if stop.received is None else {"signal": stop.received, "step": start + len(records)},
    )


def _tokenizer_sources(tokenizer, init_from, tok) -> list:
    """Where the run's tokenizer files come from (none for bytes)."""
    if isinstance(tok, ByteTokenizer):
        return []
    return [tokenizer if tokenizer is not None else init_from]


def _evaluates(options: DataOptions) -> bool:
    return options.eval_data is not None or options.eval_split is not None


def _check_vocab(tokenizer, config: TransformerConfig) -> None:
    if tokenizer.vocab_size > config.vocab_size:
        raise ValueError(
            f"tokenizer: its {tokenizer.vocab_size} ids do not fit the model's "
            f"vocab_size={config.vocab_size}; use the model's own tokenizer (--tokenizer), "
            "or a model with a larger vocabulary"
        )


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
