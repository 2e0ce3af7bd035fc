"""``train``: data, trainer, checkpoints and progress put together."""

import shutil
from pathlib import Path

import jax

from jaxckpt.data import ByteTokenizer, tokenizer_for, tokenizer_name
from jaxckpt.nn import TransformerConfig
from jaxckpt.remat import AUTO
from jaxckpt.train._checkpoint import latest_step, read_meta, restore_checkpoint
from jaxckpt.train._distributed import is_primary, resolve_mesh
from jaxckpt.train._eval import Evaluator
from jaxckpt.train._init import check_init_from, initial_model, source_hf_fields
from jaxckpt.train._memory import memory_report
from jaxckpt.train._run import TrainRun
from jaxckpt.train._run_config import RunConfig
from jaxckpt.train._run_data import run_data
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
            "pass checkpoint.resume=True to continue from it or checkpoint.force=True to replace it"
        )
    if is_primary():
        shutil.rmtree(directory)
    _barrier("jaxckpt_checkpoint_dir_cleared")


def _barrier(name: str) -> None:
    """Every process waits here for the others (nothing to do with one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


FREE_ON_RESUME = ("remat", "attention", "budget", "mlp_chunk")
"""Model-config fields a resumed run may differ in, since they do not change the numbers: the
memory choices that checkpoints written before they moved to ``RunConfig`` hold, and the MLP's
tile (``mlp_chunk``)."""

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


def train(model_config: TransformerConfig, run: RunConfig, *, plan=None) -> TrainRun:
    """Trains a ``Transformer`` described by ``model_config`` as ``run`` says: from scratch
    or from ``run.init_from``, on byte-level text or on a data file tokenized by the
    model's tokenizer, under the remat spec ``run.remat_spec`` (``run.remat``, compressed as
    ``run.compress`` says).

    ``run.remat == "auto"`` is answered by the planner before training (the planner
    compiles train steps, so it sits above ``train``): ``run, plan =
    jaxckpt.plan.resolve_auto(model_config, run)``, then ``train(model_config, run, plan=plan)``.

    Byte-level text (the built-in corpus, or a ``.txt`` file with the byte tokenizer) is
    cut into random windows: step ``s`` trains on a pure function of ``seed`` and ``s``.
    Any other data (``.jsonl``, ``.json``, ``.parquet``, or text read with a checkpoint's
    tokenizer) is streamed, shuffled by ``seed``, and packed into rows of ``seq`` with
    segment ids (``jaxckpt.data.PackedBatches``); the stream's state is saved with each
    checkpoint. Either way, resuming reproduces the uninterrupted run's batches exactly.

    Args:
        model_config: the model.
        run: the run (``RunConfig``): sizes, data, optimizer, checkpoints, mesh, the
            non-finite policy and the memory choices. Its own checks ran when it was built;
            here the model and the devices are checked against it.
        plan: the planner's ``MemoryPlan`` that chose ``run.remat``, kept in
            ``TrainRun.plan`` (its spec must be ``run.remat``).

    ``run.on_nonfinite``: ``"stop"`` raises ``NonFiniteError`` at the first step whose loss
    is not finite, naming it, and never checkpoints non-finite params (the last checkpoint
    is the last good state); ``"skip"`` skips each step whose loss or gradients are not
    finite (params and optimizer state unchanged: the step carries a select, which costs
    memory) and counts it (``TrainRun.skipped_steps``). Under dynamic loss scaling
    (float16) an overflow of the scaled gradients is the scaler's to answer: it skips,
    halves the scale and goes on, whichever the policy.

    Crashes and preemption: a checkpoint is the latest only once it is complete (a
    killed save is never resumed from), and SIGTERM (a preempted job) finishes the
    current step, saves a checkpoint (with ``run.checkpoint.dir``) and returns, with
    ``TrainRun.stopped`` saying so. ``run.checkpoint.resume`` on a directory with no
    checkpoint yet starts at step 0 (``TrainRun.resumed_from`` is None then).

    Multi-process runs: every process calls ``train`` with the same arguments (each
    builds the same model and global batches and places only its own shards); only
    process 0 draws the progress bar. Checkpoints work: every process writes its own
    shards through orbax into ``run.checkpoint.dir``, which must be one directory that
    all processes see (a shared file system across hosts); process 0 writes the metadata.

    Returns:
        A ``TrainRun``.

    Raises:
        ValueError / FileNotFoundError / FileExistsError: for a run that does not fit the
            model or the devices, a missing data file, or a checkpoint directory that would
            be overwritten without ``run.checkpoint.force``.
        CheckpointWriteError: a checkpoint could not be written (a full disk); the
            previous one is intact.
        NonFiniteError: a step was not finite and ``run.on_nonfinite="stop"``.

    Example:
        >>> from jaxckpt import nn, train
        >>> cfg = nn.TransformerConfig.preset("tiny", n_layers=1, d_model=32, n_heads=2, ffn_dim=48)
        >>> result = train.train(cfg, train.RunConfig(steps=2, batch=2, seq=16, progress=False))
        >>> [s["step"] for s in result.steps]
        [0, 1]
    """
    if not isinstance(model_config, TransformerConfig):
        raise TypeError(f"train: model_config must be a TransformerConfig, got {type(model_config).__name__}")
    if not isinstance(run, RunConfig):
        raise TypeError(f"train: run must be a train.RunConfig, got {type(run).__name__}")
    config, ckpt, options = run.model_config(model_config), run.checkpoint, run.data
    check_seq(config, run.seq)
    check_step_tokens(run.batch, run.seq, run.micro_batches)
    mesh = resolve_mesh(run.mesh)
    check_batch_split(run.batch, mesh)  # before any data is read or model built
    _check_remat(run, plan)
    directory = None if ckpt.dir is None else Path(ckpt.dir)
    if run.init_from is not None:
        check_init_from(config, run.init_from)  # the model's own errors come first
    tok = tokenizer_for(run.init_from, options.tokenizer)
    _check_vocab(tok, config)
    sizes = {"batch": run.batch, "seq": run.seq, "micro_batches": run.micro_batches}
    feed = run_data(options, tok, **sizes, seed=run.seed)
    optimizer = run.step_optimizer
    model = initial_model(config, run.seed, run.init_from, optimizer, attention=run.attention)
    parallel = {"mesh": mesh, "context_parallel": run.context_parallel}
    trainer = Trainer(model, optimizer=optimizer, seed=run.seed, remat=run.remat_spec, **parallel)
    # Compiling checks the sequence against max_len: fail before --force deletes anything.
    memory = memory_report(trainer.compile(feed.first))
    _prepare_checkpoint_dir(directory, ckpt.resume, ckpt.force)
    meta = {
        "config": config.to_dict(),
        **sizes,
        "seed": run.seed,
        "data": {"kind": feed.kind, **options.record()},
        "tokenizer": tokenizer_name(tok),
        "optimizer": trainer.optimizer.to_dict(),
    }
    loop = Run(trainer, feed, directory, meta, Evaluator(trainer.model, mesh) if options.holds_out else None)
    loop.results["hf_fields"] = source_hf_fields(run.init_from)
    start, state, resumed_from = 0, None, None
    if ckpt.resume and latest_step(directory) is not None:
        saved = read_meta(directory)
        _check_resumable(saved, meta, directory)
        # orbax restores into trainer.state's shardings, memory kinds (offload) included
        start, trainer.state = restore_checkpoint(directory, trainer.state)
        state, resumed_from = loop.resume(saved, start), start
    loop.sources = _tokenizer_sources(options.tokenizer, run.init_from, tok)
    loop.on_nonfinite = run.on_nonfinite
    with stop_requests() as stop:
        records = loop.steps(
            start, run.steps, state, run.progress, memory, ckpt.every, options.eval_every, stop
        )
    scale = trainer.loss_scale()
    return TrainRun(
        records,
        memory,
        trainer,
        plan,
        loop.results["eval"],
        loop.data_report(),
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


def _check_vocab(tokenizer, config: TransformerConfig) -> None:
    if tokenizer.vocab_size > config.vocab_size:
        raise ValueError(
            f"tokenizer: its {tokenizer.vocab_size} ids do not fit the model's "
            f"vocab_size={config.vocab_size}; use the model's own tokenizer (--tokenizer), "
            "or a model with a larger vocabulary"
        )


def _check_remat(run: RunConfig, plan) -> None:
    """``remat="auto"`` must be resolved before ``train``; a given plan must be the run's."""
    if run.remat == AUTO:
        raise ValueError(
            "train: run.remat='auto' is resolved by the planner before training: call "
            "run, plan = jaxckpt.plan.resolve_auto(model_config, run), then "
            "train.train(model_config, run, plan=plan)"
        )
    if plan is not None and plan.spec != run.remat_spec:
        raise ValueError(
            f"train: plan chose {plan.spec!r} but run.remat is {run.remat!r}: pass the run "
            "that jaxckpt.plan.resolve_auto returned with it"
        )
