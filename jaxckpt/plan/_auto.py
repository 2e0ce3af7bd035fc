"""``resolve_auto``: a config's ``remat="auto"`` replaced by the spec ``plan_memory`` picks.

``jaxckpt.train`` never plans (the planner compiles train steps: it sits above
``train``). A caller that wants ``remat="auto"`` resolves it here first, then trains
the resolved config and hands the plan along (``train.train(config, plan=...)``).
"""

from jaxckpt.nn import TransformerConfig
from jaxckpt.plan._solver import MemoryPlan, plan_memory
from jaxckpt.plan._workload import Workload
from jaxckpt.remat import AUTO
from jaxckpt.train import OptimizerConfig, resolve_mesh


def resolve_auto(
    config: TransformerConfig,
    *,
    batch: int,
    seq: int,
    micro_batches: int = 1,
    mesh=None,
    optimizer: OptimizerConfig | None = None,
) -> tuple[TransformerConfig, MemoryPlan | None]:
    """``(config with remat=spec, MemoryPlan)`` for ``config.remat == "auto"``, else ``(config, None)``.

    The plan is for the step ``jaxckpt.train.train`` runs with the same arguments:
    ``optimizer`` (AdamW by default), ``micro_batches x batch`` sequences of ``seq``
    tokens, under ``config.budget`` bytes per device. A LoRA config (``config.lora``,
    ``config.quantize_base``) is planned as it trains: the adapters alone have gradients
    and optimizer state.

    Args:
        config: the model; ``remat="auto"`` needs ``budget``.
        batch, seq, micro_batches: as given to ``train.train`` (``batch`` is global).
        mesh: as given to ``train.train``: None (one device; in a multi-process run
            ``data`` over the processes), a ``jax.sharding.Mesh``, or axis sizes such
            as ``"fsdp=4"``. The planner models FSDP meshes: a ``data`` axis is refused.
        optimizer: the ``train.OptimizerConfig`` given to ``train.train``: its name, its
            moments' dtype, its offload and where its master weights live are planned for.

    Raises:
        ValueError: for a mesh with a data axis or bad sizes (naming the argument).
        BudgetError: when no spec fits the budget.

    Example:
        >>> from jaxckpt import nn, plan
        >>> cfg = nn.TransformerConfig.preset("tiny", n_layers=1, remat="auto", budget="30MiB")
        >>> resolved, p = plan.resolve_auto(cfg, batch=2, seq=32)
        >>> resolved.remat == p.spec, p.measured.peak <= 30 * 2**20
        (True, True)
    """
    if config.remat != AUTO:
        return config, None
    mesh = resolve_mesh(mesh)  # as train.train resolves it (the same error for too few devices)
    fields = {"micro_batches": micro_batches}
    if optimizer is not None:
        placement = "host" if optimizer.offload else "device"
        fields |= {"optimizer": optimizer.name, "moments_dtype": optimizer.moments_dtype}
        fields["optimizer_placement"] = placement
        fields["master_placement"] = "host" if optimizer.offload_master else "device"
    workload = Workload.on_mesh(config, batch, seq, mesh, **fields)
    memory_plan = plan_memory(workload, config.budget)
    return config.replace(remat=memory_plan.spec), memory_plan
