"""``resolve_auto``: a run's ``remat="auto"`` replaced by the spec ``plan_memory`` picks.

``jaxckpt.train`` never plans (the planner compiles train steps: it sits above
``train``). A caller that wants ``remat="auto"`` resolves it here first, then trains
the resolved run and hands the plan along (``train.train(model_config, run, plan=...)``).
"""

from jaxckpt.nn import TransformerConfig
from jaxckpt.plan._solver import MemoryPlan, plan_memory
from jaxckpt.plan._workload import Workload
from jaxckpt.remat import AUTO
from jaxckpt.train import RunConfig, resolve_mesh


def resolve_auto(model_config: TransformerConfig, run: RunConfig) -> tuple[RunConfig, MemoryPlan | None]:
    """``(run with remat=spec, MemoryPlan)`` for ``run.remat == "auto"``, else ``(run, None)``.

    The plan is for the step ``jaxckpt.train.train(model_config, run)`` runs
    (``Workload.from_run``): ``run.optimizer``, ``run.micro_batches x run.batch`` sequences
    of ``run.seq`` tokens on ``run.mesh``, under ``run.budget`` bytes per device. A LoRA
    model (``lora``, ``quantize_base``) is planned as it trains: the adapters alone have
    gradients and optimizer state. With ``run.compress`` every spec the planner considers
    keeps what it keeps compressed (``plan_memory(compress=)``, narrowed by
    ``run.compress_tags``); the resolved run's ``remat`` is the spec with its compression,
    and its ``compress`` fields are cleared (the spec carries them).

    Raises:
        ValueError: for a mesh with a data axis or too few devices (naming the argument).
        BudgetError: when no spec fits the budget.

    Example:
        >>> from jaxckpt import nn, plan, train
        >>> cfg = nn.TransformerConfig.preset("tiny", n_layers=1)
        >>> run = train.RunConfig(steps=10, batch=2, seq=32, remat="auto", budget="30MiB")
        >>> resolved, p = plan.resolve_auto(cfg, run)
        >>> resolved.remat == p.spec, p.measured.peak <= 30 * 2**20
        (True, True)
    """
    if run.remat != AUTO:
        return run, None
    resolve_mesh(run.mesh)  # as train.train resolves it (the same error for too few devices)
    workload = Workload.from_run(model_config, run)
    memory_plan = plan_memory(workload, run.budget, compress=run.compress, compress_tags=run.compress_tags)
    return run.replace(remat=memory_plan.spec, compress=None, compress_tags=None), memory_plan
