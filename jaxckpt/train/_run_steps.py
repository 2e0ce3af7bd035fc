"""``Run``: one training run's steps, evaluations and checkpoints (``train`` sets it up)."""

import time
from pathlib import Path

import jax

from jaxckpt.data import copy_tokenizer_files
from jaxckpt.train._checkpoint import MAX_TO_KEEP, save_checkpoint
from jaxckpt.train._distributed import is_primary
from jaxckpt.train._nonfinite import check_params_finite, guard_step
from jaxckpt.train._progress import SkipCounter, memory_text, train_progress
from jaxckpt.train._step import Trainer


class Run:
    """One run's steps, evaluations and checkpoints (the state ``train`` threads through)."""

    def __init__(self, trainer: Trainer, feed, directory: "Path | None", meta: dict, evaluator):
        self.trainer, self.feed, self.directory, self.meta = trainer, feed, directory, meta
        self.evaluator = evaluator
        self.results = {"eval": [], "data_states": {}, "hf_fields": {}}
        self.sources: list = []
        self.state = None  # the data stream's state after the latest batch (None: byte windows)
        self.on_nonfinite = "stop"
        self.saved = 0  # the latest step checkpointed, or resumed from (0: none)

    def resume(self, saved: dict, step: int):
        """The data state saved with checkpoint ``step`` (None for byte windows), and the
        evaluations up to it."""
        self.results["eval"] = [e for e in saved.get("eval", []) if e["step"] <= step]
        self.results["hf_fields"] = saved.get("hf_fields", self.results["hf_fields"])
        if self.feed.kind != "packed":
            return None
        states = saved.get("data_states", {})
        if str(step) not in states:
            raise ValueError(
                f"resume=True: {str(self.directory)!r} has no data state for its step {step}, so the "
                "packed stream cannot continue exactly where it stopped; train again without resume"
            )
        self.results["data_states"] = {k: v for k, v in states.items() if int(k) <= step}
        self.state = states[str(step)]
        return self.state

    def steps(self, start, steps, state, progress, memory, every, eval_every, stop) -> list[dict]:
        """Steps ``start..steps-1`` (fewer when ``stop`` is received: the step under way
        finishes), checkpointing every ``every`` steps and after the last one run."""
        records = []
        stream = self.feed.iterate(start, state)
        shape = jax.tree.leaves(self.feed.first)[0].shape
        tokens_per_step = shape[0] * shape[1] * (shape[2] - (self.feed.kind == "windows"))
        skips = SkipCounter(self.trainer)
        self.saved = start
        with train_progress(steps, start, progress and is_primary()) as update:
            for step in range(start, steps):
                if stop.received:
                    break
                batch, state = next(stream)
                t0 = time.perf_counter()
                loss = float(jax.block_until_ready(self.trainer.step(batch)))
                seconds = time.perf_counter() - t0
                record = {"step": step, "loss": loss, "step_seconds": seconds, **skips.after_step()}
                dynamic = self.trainer.loss_scale_mode == "dynamic"
                guard_step(self.on_nonfinite, step, loss, record["skipped"], dynamic, self._last_checkpoint())
                records.append(record)
                done = step + 1
                evaluation = self._evaluate(done) if self._due(done, steps, eval_every) else None
                update(done, loss, tokens_per_step / seconds, memory_text(memory), evaluation, skips.text())
                self.state = state
                if self.directory is not None and every and done % every == 0:
                    self.save(done)
        if self.directory is not None and start + len(records) > self.saved:
            self.save(start + len(records))
        return records

    def _last_checkpoint(self) -> str:
        """Where the last good state is, for a ``NonFiniteError``'s message."""
        if self.directory is None:
            return "and no checkpoint is written (no checkpoint_dir)"
        if self.saved == 0:
            return f"and {str(self.directory)!r} holds no checkpoint of this run yet"
        return f"the last good checkpoint is step {self.saved} in {str(self.directory)!r}"

    def _due(self, done: int, steps: int, eval_every) -> bool:
        if self.evaluator is None:
            return False
        return done == steps or (eval_every is not None and done % eval_every == 0)

    def _evaluate(self, step: int) -> dict:
        batches = self.feed.eval_batches()
        result = self.evaluator(self.trainer.model, batches)
        entry = {"step": step, "loss": result["loss"], "perplexity": result["perplexity"]}
        self.results["eval"] = [e for e in self.results["eval"] if e["step"] != step] + [entry]
        return entry

    def save(self, step: int) -> None:
        """Every process saves its shards (orbax); process 0 writes the metadata (with the
        data states of the checkpoints kept, the newest ``MAX_TO_KEEP``) and, at the first
        save, copies the tokenizer files."""
        if self.on_nonfinite == "stop" and not self.trainer.skips_nonfinite:
            check_params_finite(self.trainer.model, step - 1, self._last_checkpoint())
        meta = None
        if is_primary():
            if self.state is not None:
                states = {**self.results["data_states"], str(step): self.state}
                newest = sorted(states, key=int)[-MAX_TO_KEEP:]
                self.results["data_states"] = {k: states[k] for k in newest}
            meta = {**self.meta, **self.results, "data_stats": self.feed.stats}
        save_checkpoint(self.directory, step, self.trainer.state, meta)
        self.saved = step
        if is_primary():
            for source in self.sources:
                _copy_tokenizer(Path(source), self.directory)
            self.sources = []  # copied once: they do not change during the run

    def data_report(self) -> dict:
        """``{"kind", "tokenizer", **counts}`` of the run's data."""
        return {"kind": self.feed.kind, "tokenizer": self.meta["tokenizer"], **self.feed.stats}


def _copy_tokenizer(source: Path, directory: Path) -> None:
    """The tokenizer files of ``source`` (a model or tokenizer directory, or a tokenizer.json)
    next to the checkpoints, so that generate, eval and export find them there."""
    if source.is_file():
        if source.name == "tokenizer.json":
            tmp = directory / ".tokenizer.json.tmp"
            tmp.write_bytes(source.read_bytes())
            tmp.replace(directory / "tokenizer.json")
        return
    copy_tokenizer_files(source, directory)
