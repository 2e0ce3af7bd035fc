"""``compare``: the seed's experiment. Memory, speed and numbers of attention x remat."""

import dataclasses
import functools
import statistics
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from rich.progress import Progress

from jaxckpt._checks import require_positive_int
from jaxckpt.nn import Transformer, TransformerConfig, trainable
from jaxckpt.remat import FORMATS, RematSpec, compressed
from jaxckpt.remat import get as get_remat
from jaxckpt.train import (
    ByteBatches,
    Trainer,
    load_tokens,
    loss_and_grads,
    memory_report,
    offload_saves_memory,
)
from jaxckpt.train._step import check_seq

ATTENTION = {"reference": "reference", "flash": "blockwise"}
"""Row label -> ``flash_attention`` implementation. ``reference`` materialises T x S."""
REMAT = ("none", "full", "dots", "save_attn", "minimal", "ratio_0.25")
OFFLOAD_REMAT = ("offload_qkv", "offload_minimal")
BASELINE = ("reference", "none")


def default_rows(compress: str | None = None) -> list[tuple[str, str]]:
    """``reference`` and ``flash`` x ``REMAT`` (+ offload presets where they save memory); with
    ``compress`` (``"int8"``, ``"fp8"``) also ``flash`` x each of those presets but ``none``
    with what it keeps compressed, named ``<preset>+<format>`` (``remat_spec``).

    Example:
        >>> [r for r in default_rows("int8") if r[1].endswith("+int8")][:2]
        [('flash', 'full+int8'), ('flash', 'dots+int8')]
    """
    remats = REMAT + (OFFLOAD_REMAT if offload_saves_memory() else ())
    rows = [(attention, remat) for attention in ATTENTION for remat in remats]
    if compress is not None:
        rows += [("flash", f"{remat}+{compress}") for remat in remats if get_remat(remat).enabled]
    return rows


def remat_spec(remat: "str | RematSpec") -> RematSpec:
    """A row's remat: a preset name, ``"<preset>+<format>"`` (the preset with what it keeps
    compressed, ``remat.compressed``) or a ``RematSpec``.

    Raises:
        ValueError: for an unknown preset or format.

    Example:
        >>> remat_spec("save_attn+fp8").compress
        {'attn_out': 'fp8', 'layer_input': 'fp8'}
    """
    if isinstance(remat, str) and "+" in remat:
        preset, _, fmt = remat.partition("+")
        if fmt not in FORMATS:
            raise ValueError(
                f"remat {remat!r}: unknown compression format {fmt!r}; valid: {', '.join(FORMATS)}"
            )
        return compressed(preset, fmt)
    return get_remat(remat)


@dataclasses.dataclass
class _Row:
    attention: str
    remat: str
    trainer: Trainer
    temp_bytes: int
    max_grad_diff: float = 0.0
    seconds: list[float] = dataclasses.field(default_factory=list)
    loss: float = float("nan")


@functools.partial(jax.jit, static_argnums=(0, 4))
def _grads(graphdef, params, rest, batch, spec):
    return loss_and_grads(graphdef, params, rest, batch, spec)[1]


def _initial_grads(trainer: Trainer, batch: jax.Array):
    graphdef, params, rest = nnx.split(trainer.model, trainable(trainer.config), ...)
    return _grads(graphdef, params, rest, batch, trainer.spec)


def _max_diff(a, b) -> float:
    return max(
        float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def compare(
    config: TransformerConfig,
    *,
    batch: int,
    seq: int,
    steps: int,
    rows: Sequence[tuple[str, str]] | None = None,
    seed: int = 0,
    progress: bool = True,
    compress: str | None = None,
) -> dict:
    """Trains the same model, from the same init on the same batches, once per row.

    Every row is compiled first; then the steps run round-robin over the rows, so
    machine noise hits all rows alike. The first row is the baseline (standard
    attention, no remat) that memory, speed and gradients are compared against.

    Args:
        config: the model; each row runs it with its own attention and remat.
        batch, seq: tokens per step are ``batch x seq``.
        steps: timed steps per row (step time is the median).
        rows: ``(attention, remat)`` pairs; attention is ``"reference"`` (materialises
            T x S) or ``"flash"`` (blockwise). Default: both, under each of ``none``,
            ``full``, ``dots``, ``save_attn``, ``minimal`` and ``ratio_0.25`` (and the
            offload presets where host memory is separate). The baseline
            ``("reference", "none")`` is added first when missing. A remat is a preset
            name, ``"<preset>+<format>"`` (``"full+int8"``: its kept activations stored
            compressed) or a ``RematSpec``.
        seed: parameter init and data order.
        progress: draw a progress bar.
        compress: ``"int8"`` or ``"fp8"``: the default rows gain one ``flash`` row per
            enabled preset with what it keeps compressed (``default_rows``); with ``rows``
            given it changes nothing.

    Returns:
        ``{"config": {...}, "rows": [{"attention", "remat", "temp_bytes", "memory_saved",
        "step_seconds", "tokens_per_second", "speed_ratio", "loss", "max_grad_diff"}]}``.

    Raises:
        ValueError: for ``steps`` < 1, ``seq`` over ``config.max_len``, or an unknown
            attention or remat name.

    Example:
        >>> from jaxckpt import compare, nn
        >>> cfg = nn.TransformerConfig.preset("tiny", n_layers=1)
        >>> out = compare.compare(cfg, batch=1, seq=16, steps=1, rows=[("flash", "full")], progress=False)
        >>> [(r["attention"], r["remat"]) for r in out["rows"]]
        [('reference', 'none'), ('flash', 'full')]
    """
    require_positive_int("steps", steps)
    check_seq(config, seq)
    if compress is not None and compress not in FORMATS:
        raise ValueError(f"compress={compress!r} must be one of {', '.join(FORMATS)}")
    pairs = [BASELINE] + [r for r in (rows or default_rows(compress)) if tuple(r) != BASELINE]
    for attention, remat in pairs:
        if attention not in ATTENTION:
            raise ValueError(f"unknown attention {attention!r}; valid: {', '.join(ATTENTION)}")
        remat_spec(remat)
    data = ByteBatches(load_tokens(None), batch, seq, seed=seed)
    built = _build_rows(config, pairs, data, seed, progress)
    _run_round_robin(built, data, steps, progress)
    base = built[0]
    base_seconds = statistics.median(base.seconds)
    out_rows = []
    for row in built:
        seconds = statistics.median(row.seconds)
        out_rows.append(
            {
                "attention": row.attention,
                "remat": row.remat,
                "temp_bytes": row.temp_bytes,
                "memory_saved": 1.0 - row.temp_bytes / base.temp_bytes,
                "step_seconds": seconds,
                "tokens_per_second": batch * seq / seconds,
                "speed_ratio": seconds / base_seconds,
                "loss": row.loss,
                "max_grad_diff": row.max_grad_diff,
            }
        )
    setup = {**config.to_dict(), "batch": batch, "seq": seq, "steps": steps, "backend": jax.default_backend()}
    return {"config": setup, "rows": out_rows}


def _build_rows(config, pairs, data, seed, progress) -> list[_Row]:
    first = jnp.asarray(data.batch_at(0))
    rows: list[_Row] = []
    base_grads = None
    with Progress(disable=not progress, transient=True) as bar:
        task = bar.add_task("compiling rows", total=len(pairs))
        for attention, remat in pairs:
            model = Transformer(config, rngs=nnx.Rngs(seed), attention=ATTENTION[attention])
            trainer = Trainer(model, remat=remat_spec(remat))
            grads = _initial_grads(trainer, first)
            base_grads = grads if base_grads is None else base_grads
            temp = memory_report(trainer.compile(first.shape)).temp
            label = remat if isinstance(remat, str) else repr(remat)  # a RematSpec: keep JSON-able
            rows.append(_Row(attention, label, trainer, temp, _max_diff(grads, base_grads)))
            bar.advance(task)
    return rows


def _run_round_robin(rows: list[_Row], data: ByteBatches, steps: int, progress: bool) -> None:
    with Progress(disable=not progress, transient=True) as bar:
        task = bar.add_task("training rows", total=steps * len(rows))
        for step in range(steps):
            tokens = jnp.asarray(data.batch_at(step))
            for row in rows:
                t0 = time.perf_counter()
                row.loss = float(jax.block_until_ready(row.trainer.step(tokens)))
                row.seconds.append(time.perf_counter() - t0)
                bar.advance(task)
