"""A rich progress bar for training: step, loss, tokens/s and memory."""

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
    """Yields ``update(step, loss, tokens_per_second, memory, evaluation=None)`` (``evaluation``:
    the latest ``{"step", "loss", "perplexity"}``, shown until the next); draws nothing when disabled."""
    if not enabled:
        yield lambda *args: None
        return
    columns = (
        TextColumn("[bold]train"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn(
            "loss {task.fields[loss]}{task.fields[eval]}  {task.fields[speed]} tok/s  {task.fields[memory]}"
        ),
        TimeRemainingColumn(),
    )
    with Progress(*columns, transient=False) as progress:
        fields = dict(loss="-", speed="-", memory="", eval="")
        task = progress.add_task("train", total=total, completed=start, **fields)

        def update(step: int, loss: float, tokens_per_second: float, memory: str, evaluation=None) -> None:
            extra = {} if evaluation is None else {"eval": _eval_text(evaluation)}
            speed = f"{tokens_per_second:,.0f}"
            progress.update(task, completed=step, loss=f"{loss:.4f}", speed=speed, memory=memory, **extra)

        yield update
