"""Memory planning: what a train step needs, predicted from shapes, measured by XLA, solved for a budget.

Every entry point takes a ``Workload`` (the model, with its LoRA adapters and quantized
base if any; the global batch, the sequence length, micro-batches, the optimizer, its
moments' dtype and where its state lives, where the master weights live, and FSDP
devices) and, where it asks about one, a remat spec:

* ``measure``: XLA's own figures for the compiled step (abstract inputs, nothing allocated);
  ``measure_fn`` the same for any function of abstract inputs, ``explain`` where its peak comes from.
* ``predict`` / ``choice``: the analytic model (``layer_graph``: per-tag bytes and FLOPs of one layer).
* ``plan_memory``: the cheapest remat spec under a budget, verified by ``measure`` (and,
  with ``split_batch``, the fewest micro-batches that fit); ``preset_table`` puts it next
  to every preset; ``resolve_auto`` answers ``remat="auto"``.
* ``max_seq``: the longest sequence that fits a budget, searched on the analytic model and
  confirmed by a compile.

Modules, bottom to top (each imports only those before it): ``_workload``,
``_devices``, ``_tpu_targets``, ``_targets``, ``_compilers``, ``_specs``, ``_state``, ``_layer_costs``,
``_graph``, ``_layer_graph``, ``_compression``, ``_compile``, ``_sharded``, ``_measure``,
``_buffer_assignment``, ``_program_graph``, ``_tag_sites``, ``_explain``, ``_explain_plot``,
``_working_set``, ``_analytic``, ``_cost``, ``_by_cost``, ``_milp``, ``_per_layer``, ``_solver``,
``_plan_fn``, ``_table``, ``_auto``, ``_max_seq``.

Compressed residuals (``RematSpec.compress``, int8 / fp8) are priced throughout: their stored
bytes, their dequantized copy in a layer's backward pass, their (de)quantization's FLOPs and
traffic (``_compression``); the solver stores a tag compressed only with ``allow_compress``.

Example:
    >>> from jaxckpt import nn, plan
    >>> workload = plan.Workload(nn.TransformerConfig.preset("tiny", n_layers=1), batch=1, seq=32)
    >>> plan.measure(workload, remat="full").alias > 0  # the state is donated
    True
"""

from jaxckpt._sizes import format_bytes, parse_size
from jaxckpt.plan._analytic import Prediction, korthikanti_bytes, predict
from jaxckpt.plan._auto import resolve_auto
from jaxckpt.plan._buffer_categories import KINDS
from jaxckpt.plan._by_cost import by_cost, tag_flops_per_byte
from jaxckpt.plan._compile import compile_step
from jaxckpt.plan._compression import COMPRESS_FLOPS, compressed_tag_bytes, compressible_tags
from jaxckpt.plan._cost import Choice, choice, roofline_seconds, step_flops, xla_step_cost
from jaxckpt.plan._devices import DEVICES, DevicePreset, device_preset
from jaxckpt.plan._explain import Buffer, Explanation, explain, explain_workload
from jaxckpt.plan._explain_plot import PLOT_SUFFIXES, save_timeline
from jaxckpt.plan._layer_graph import LayerGraph, layer_graph
from jaxckpt.plan._max_seq import MaxSeqAnswer, SeqPlan, describe_max_seq, max_seq
from jaxckpt.plan._measure import CPU_CAVEAT, measure, measure_fn
from jaxckpt.plan._milp import solve
from jaxckpt.plan._per_layer import choice_layered, layered_choices, predict_layered, uniform_candidates
from jaxckpt.plan._plan_fn import FnPlan, FnPrediction, ProgramModel, plan_fn, program_model
from jaxckpt.plan._program_graph import Block, ProgramGraph, program_graph
from jaxckpt.plan._solver import BudgetError, MemoryPlan, plan_memory
from jaxckpt.plan._specs import spec_dict, spec_name
from jaxckpt.plan._state import state_bytes, trainable_bytes, tree_bytes, widened_bytes
from jaxckpt.plan._table import PresetRow, PresetTable, preset_table
from jaxckpt.plan._targets import (
    AUTOTUNE_CAVEAT,
    GEMM_BACKENDS,
    TARGETS,
    GpuTarget,
    Target,
    aot_unavailable,
    compile_target,
    deviceless,
    gpu_aot_unavailable,
    gpu_target,
    quiet_plugins_without_devices,
    target_devices,
)
from jaxckpt.plan._tpu_targets import TPU_CAVEAT, TpuTarget, tpu_aot_unavailable
from jaxckpt.plan._workload import MOMENTS_DTYPES, OPTIMIZERS, PLACEMENTS, Workload

__all__ = [
    "AUTOTUNE_CAVEAT",
    "COMPRESS_FLOPS",
    "CPU_CAVEAT",
    "DEVICES",
    "GEMM_BACKENDS",
    "KINDS",
    "MOMENTS_DTYPES",
    "OPTIMIZERS",
    "PLACEMENTS",
    "PLOT_SUFFIXES",
    "TARGETS",
    "TPU_CAVEAT",
    "Block",
    "BudgetError",
    "Buffer",
    "Choice",
    "DevicePreset",
    "Explanation",
    "FnPlan",
    "FnPrediction",
    "GpuTarget",
    "LayerGraph",
    "MaxSeqAnswer",
    "MemoryPlan",
    "Prediction",
    "PresetRow",
    "PresetTable",
    "ProgramGraph",
    "ProgramModel",
    "SeqPlan",
    "Target",
    "TpuTarget",
    "Workload",
    "aot_unavailable",
    "by_cost",
    "choice",
    "choice_layered",
    "compile_step",
    "compile_target",
    "compressed_tag_bytes",
    "compressible_tags",
    "describe_max_seq",
    "device_preset",
    "deviceless",
    "explain",
    "explain_workload",
    "format_bytes",
    "gpu_aot_unavailable",
    "gpu_target",
    "korthikanti_bytes",
    "layer_graph",
    "layered_choices",
    "max_seq",
    "measure",
    "measure_fn",
    "parse_size",
    "plan_fn",
    "plan_memory",
    "predict",
    "predict_layered",
    "preset_table",
    "program_graph",
    "program_model",
    "quiet_plugins_without_devices",
    "resolve_auto",
    "roofline_seconds",
    "save_timeline",
    "solve",
    "spec_dict",
    "spec_name",
    "state_bytes",
    "step_flops",
    "tag_flops_per_byte",
    "target_devices",
    "tpu_aot_unavailable",
    "trainable_bytes",
    "tree_bytes",
    "uniform_candidates",
    "widened_bytes",
    "xla_step_cost",
]
