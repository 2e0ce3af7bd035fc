"""Why no remat spec fits a budget, and what would: the planner's refusal, priced.

``held_bytes`` is what a step holds from start to end (a budget below it is answered
without compiling); ``infeasible_message`` names the smallest peak, then each change that
would fit (micro-batches, a shorter sequence, another optimizer, LoRA, QLoRA, more
devices) with its predicted peak under full remat. ``plan_memory`` raises it.
"""

import dataclasses

from jaxckpt._sizes import format_bytes
from jaxckpt.plan._state import state_bytes, trainable_bytes
from jaxckpt.plan._workload import Workload

SPLITS = (2, 4, 8, 16, 32, 64)
"""Micro-batch factors ``split_batch`` tries, in order."""
HINT_LORA_RANK = 16
"""The LoRA rank the "what would fit" hints price."""


def splits(workload: Workload) -> list[Workload]:
    """The workload's batch cut into ``k`` times the micro-batches, for each ``SPLITS`` factor
    whose share is still a whole multiple of the devices."""
    batch, micro, devices = workload.batch, workload.micro_batches, workload.devices
    return [
        workload.replace(batch=batch // k, micro_batches=micro * k)
        for k in SPLITS
        if batch % k == 0 and (batch // k) % devices == 0
    ]


def held_bytes(workload: Workload) -> int:
    """Bytes one device holds from the first instruction of the step to the last: its
    arguments, the parameters (unless their fp32 masters live on the host), the optimizer
    state (unless it lives on the host) and the input tokens. Every remat spec's peak is at
    least this (a ``MemoryReport.peak`` counts the arguments), so a budget below it is
    answered without compiling.

    Example:
        >>> from jaxckpt import nn, plan
        >>> from jaxckpt.plan._infeasible import held_bytes
        >>> w = plan.Workload(nn.TransformerConfig.preset("tiny"), batch=2, seq=64)
        >>> params, adamw = plan.state_bytes(w)
        >>> held_bytes(w) == params + adamw + w.input_bytes
        True
    """
    params, opt = state_bytes(workload)
    params = params if not workload.optimizer.offload_master else 0
    opt = opt if not workload.optimizer.offload else 0
    return params + opt + workload.input_bytes


def _budget_words(budget: int | None, limit: int) -> str:
    """``budget=1 B`` (the command line's ``--budget 1 B``), and what the headroom leaves of it."""
    budget = limit if budget is None else budget
    words = f"budget={format_bytes(budget)}"
    return words if limit == budget else f"{words} less the headroom ({format_bytes(limit)})"


def infeasible_message(
    workload: Workload,
    limit: int,
    smallest: int,
    compiler,
    *,
    budget: int | None = None,
    measured: bool = True,
) -> str:
    """Why nothing fits in ``limit`` (``budget`` less the headroom; None: ``limit``): the
    smallest peak ``measured`` by XLA, or (not ``measured``) the arguments alone; then what
    would fit instead, each with its predicted peak under full remat: micro-batches, a
    shorter sequence, another optimizer, LoRA, QLoRA, more devices; and what was tried of
    those and would not fit alone."""
    full = lambda w: compiler.predict(w, "full").total
    fits, short = [], []

    def offer(label: str, candidates: list[Workload]) -> None:
        """The first candidate that fits (or the last one tried, which does not)."""
        for name, w in candidates:
            if full(w) <= limit:
                fits.append(f"{name} at {format_bytes(full(w))}")
                return
        if candidates:
            name, w = candidates[-1]
            short.append(f"{name} at {format_bytes(full(w))}")

    batch, seq, devices, micro = workload.batch, workload.seq, workload.devices, workload.micro_batches
    offer(
        "micro-batches",
        [
            (f"batch={w.batch} micro_batches={w.micro_batches} (same tokens per step)", w)
            for w in splits(workload)
            if w.micro_batches // micro <= 32
        ],
    )
    offer("seq", [(f"seq={t}", workload.replace(seq=t)) for t in (seq // 2, seq // 4, seq // 8) if t >= 1])
    others = [opt for opt in ("adafactor", "sgd") if opt != workload.optimizer.name]
    offer(
        "optimizer",
        [
            (
                f"optimizer={opt}",
                workload.replace(optimizer=dataclasses.replace(workload.optimizer, name=opt)),
            )
            for opt in others
        ],
    )
    config = workload.config
    if config.lora is None:
        lora = _lora_workload(workload)
        offer("lora", [(f"lora={HINT_LORA_RANK}", lora)])
        offer("qlora", [(f"lora={HINT_LORA_RANK} quantize_base=nf4", _qlora_workload(lora))])
    elif config.quantize_base is None:
        offer("qlora", [("quantize_base=nf4", _qlora_workload(workload))])
    # FSDP splits the state, the update and the batch over the devices
    more = [d for d in (2, 4, 8, 16, 32, 64, 128, 256) if d > devices and batch % d == 0]
    offer("devices", [(f"devices={d} (FSDP: mesh=fsdp={d})", workload.replace(devices=d)) for d in more])
    hint = "; ".join(fits) if fits else "a larger device"
    if short:
        hint += ". Not enough alone: " + "; ".join(short)
    hint += " (peaks predicted under full remat)"
    params, opt_bytes = state_bytes(workload)
    grads = trainable_bytes(workload)
    where = "per device " if devices > 1 else ""
    if not measured:
        held = held_bytes(workload)
        on_device = (
            ("parameters", not workload.optimizer.offload_master),
            ("optimizer state", not workload.optimizer.offload),
        )
        kept = [name for name, on in on_device if on]
        parts = f"{', '.join(kept)} and input tokens" if kept else "input tokens"
        return (
            f"no remat spec fits {_budget_words(budget, limit)}: the {parts} "
            f"alone take {format_bytes(held)} {where}for the whole step (nothing compiled); "
            f"the smallest peak, under full remat, is predicted at {format_bytes(smallest)} "
            f"(params {format_bytes(params)}, gradients {format_bytes(grads)}, optimizer "
            f"{format_bytes(opt_bytes)} before any activation). What would fit: {hint}"
        )
    return (
        f"no remat spec fits {_budget_words(budget, limit)}: the smallest peak is {format_bytes(smallest)} "
        f"{where}(params {format_bytes(params)}, gradients {format_bytes(grads)}, optimizer "
        f"{format_bytes(opt_bytes)} before any activation). What would fit: {hint}"
    )


def _lora_workload(workload: Workload) -> Workload:
    """The workload with rank-``HINT_LORA_RANK`` adapters on q, k, v, o and the frozen base in
    the 16-bit compute dtype (bfloat16 for a float32 model), as ``jaxckpt train --lora``."""
    config = workload.config
    half = config.dtype if config.compute_dtype.itemsize == 2 else "bfloat16"
    return workload.replace(config=config.replace(lora=HINT_LORA_RANK, param_dtype=half))


def _qlora_workload(workload: Workload) -> Workload:
    return workload.replace(config=workload.config.replace(quantize_base="nf4"))
