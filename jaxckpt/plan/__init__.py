"""Memory planning: what a train step needs, predicted from shapes, measured by XLA, solved for a budget.

* ``measure``: XLA's own figures for the compiled step (abstract inputs, nothing allocated).
* ``predict``: the analytic model (``layer_graph``: per-tag bytes and FLOPs of one layer).
* ``plan_memory``: the cheapest remat spec under a budget, verified by ``measure``.

Example:
    >>> from jaxckpt import nn, plan
    >>> report = plan.measure(nn.TransformerConfig.preset("tiny", n_layers=1), batch=1, seq=32, remat="full")
    >>> report.alias > 0  # the state is donated
    True
"""

from jaxckpt._sizes import format_bytes, parse_size
from jaxckpt.plan._analytic import Prediction, korthikanti_bytes, predict, state_bytes
from jaxckpt.plan._cost import Choice, choice, spec_dict, spec_name, step_flops
from jaxckpt.plan._devices import DEVICES, DevicePreset, device_preset
from jaxckpt.plan._layer_graph import LayerGraph, layer_graph
from jaxckpt.plan._measure import CPU_CAVEAT, OPTIMIZERS, abstract_train_state, measure, tree_bytes
from jaxckpt.plan._milp import solve
from jaxckpt.plan._solver import BudgetError, MemoryPlan, plan_memory

__all__ = [
    "CPU_CAVEAT",
    "DEVICES",
    "OPTIMIZERS",
    "BudgetError",
    "Choice",
    "DevicePreset",
    "LayerGraph",
    "MemoryPlan",
    "Prediction",
    "abstract_train_state",
    "choice",
    "device_preset",
    "format_bytes",
    "korthikanti_bytes",
    "layer_graph",
    "measure",
    "parse_size",
    "plan_memory",
    "predict",
    "solve",
    "spec_dict",
    "spec_name",
    "state_bytes",
    "step_flops",
    "tree_bytes",
]
