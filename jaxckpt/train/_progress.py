"""A rich progress bar for training: step, loss, tokens/s, memory and skipped steps."""

import contextlib

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from jaxckpt.train._memory import MemoryReport, device_memory_stats


def memory_text(report: MemoryReport) -> str:
    """``"temp 12.3 MiB"``, plus the device's bytes in use where it reports them."""
    text = f"temp {report.temp / 2**20:.1f} MiB"
    stats = device_memory_stats()
    if stats and "bytes_in_use" in stats:
        text += f", in use {stats['bytes_in_use'] / 2**20:.1f} MiB"
    return text


def _eval_text(evaluation: dict) -> str:
    """``"  eval 2.3456 (ppl 10.4, step 100)"``."""
    return f"  eval {evaluation['loss']:.4f} (ppl {evaluation['perplexity']:.1f}, step {evaluation['step']})"


@contextlib.contextmanager
def train_progress(total: int, start: int, enabled: bool = True):
    """Yields ``update(step, loss, tokens_per_second, memory, evaluation=None, skips="")``
    (``evaluation``: the latest ``{"step", "loss", "perplexity"}``, shown until the next;
    ``skips``: the loss scale and skipped-step count, e.g. ``"scale 32768, skipped 2"``);
    draws nothing when disabled."""
    if not enabled:
        yield lambda *args: None
        return
    columns = (
        TextColumn("[bold]train"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn(
            "loss {task.fields[loss]}{task.fields[eval]}  {task.fields[speed]} tok/s  {task.fields[memory]}"
            "{task.fields[skips]}"
        ),
        TimeRemainingColumn(),
    )
    with Progress(*columns, transient=False) as progress:
        fields = dict(loss="-", speed="-", memory="", eval="", skips="")
        task = progress.add_task("train", total=total, completed=start, **fields)

        def update(
            step: int, loss: float, tokens_per_second: float, memory: str, evaluation=None, skips: str = ""
        ) -> None:
            extra = {} if evaluation is None else {"eval": _eval_text(evaluation)}
            speed, skips = f"{tokens_per_second:,.0f}", skips and f"  {skips}"
            progress.update(
                task, completed=step, loss=f"{loss:.4f}", speed=speed, memory=memory, skips=skips, **extra
            )

        yield update


class SkipCounter:
    """Each step's ``{"skipped", "loss_scale"}`` and the progress bar's text, read from a
    ``Trainer``'s loss scaler (no device read without loss scaling or a non-finite skip)."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.reads = trainer.loss_scale_mode != "none" or trainer.skips_nonfinite
        self.state = trainer.loss_scale() if self.reads else {"skipped_steps": 0, "scale": None}

    def after_step(self) -> dict:
        if not self.reads:
            return {"skipped": False, "loss_scale": None}
        before, self.state = self.state["skipped_steps"], self.trainer.loss_scale()
        return {"skipped": self.state["skipped_steps"] > before, "loss_scale": self.state["scale"]}

    def text(self) -> str:
        """``"scale 32768, skipped 2"`` for the progress bar ('' without loss scaling)."""
        if not self.reads:
            return ""
        scale = self.state["scale"]
        return ("" if scale is None else f"scale {scale:g}, ") + f"skipped {self.state['skipped_steps']}"
