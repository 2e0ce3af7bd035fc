"""The analytic memory model: a train step's bytes from shapes alone, no compile.

``predict`` splits a step into the train state (params, optimizer state), the
gradients and the activations. The activations are

    n_layers x stored(spec) + max(layer working set, head working set) + widened

where ``stored`` is what one layer keeps for its backward pass (``LayerGraph.kept``;
one layer input per segment when ``layers_per_checkpoint > 1``, the segments cut as
``nn.segment_sizes`` cuts them; offloaded tags are not on the device, and under boundary
offload, ``offload_full``, neither are the layer inputs: ``offloaded_boundaries``; both are
``Prediction.host_activations``)
and the layer working set is the backward pass of one layer: its recomputed
residuals, its weight-gradient slice and the cotangents in flight. ``widened`` is
XLA:CPU's float32 copy of bfloat16 weight stacks (``widened_bytes``). The optimizer
update's own workspace (``update_workspace``: Adafactor's largest leaf) bounds the
activation term from below; a loss-scaled (float16) step adds its unscaled gradients.
``korthikanti_bytes`` is the published baseline the model is checked against.

Under LoRA (``config.lora``) the params are the frozen base (in its storage dtype, or
its quantized codes and scales) plus the adapters; the gradients and the optimizer
state are the adapters' alone, a layer's weight-gradient slice is its adapters', and
the layer graph reads a projection's input only where an adapter needs it
(``layer_graph``). Optimizer state or master weights placed in host memory are
``Prediction.host``, off the device's total.

Over ``workload.devices`` (FSDP, ``jaxckpt train --mesh fsdp=D``) each device holds its
shards of the state and of the update and runs ``batch / D`` sequences; the output
head's gathered weights and their gradient are added to the head's working set (a
layer's gathered parameters add nothing measurable: see ``layer_working_set``).

The compiler (``predict(target=)``). The terms above are XLA:CPU's, the default. For a
GPU target (``plan.TARGETS``; ``measure(target=)`` compiles the step with XLA:GPU for it)
the same structure holds with these mechanisms of XLA:GPU, each read off its buffer
assignment (``--xla_dump_to``) of bf16 ``small``, ``gpt2`` and FSDP ``llama2-7b`` steps:

* bfloat16 kernels: no float32 copy of the weight stacks (``widened_bytes`` is 0), and a
  bfloat16 dot's result stays bfloat16, the graph's own dtype (XLA:CPU runs every dot in
  float32).
* attention is cuDNN's where it takes the layer, else the Pallas kernel's
  (``attention_implementation``): the blockwise kernel's residuals, no score tile.
* fusion: a recomputed layer's backward holds a norm's row statistics, not its fp32
  normalised input, and one tensor of a gated activation (``layer_graph(target=)``).
* the layer's saved residuals are sliced out of their stacks as copies (the backward
  body's dynamic-slice fusions), so keeping a tag does not shrink the working set: under
  ``small``'s ``minimal`` it was within 6% of ``full``'s (on XLA:CPU it falls by the kept
  bytes).
* the head: ``4 + e`` bytes a logit, not ``8 + 2e`` (``head_working_set``), and the layer
  stacks' gradients are not yet allocated while it runs (``unwritten_grads``).
* FSDP: a stack split along a layer's minor axis keeps a transposed copy of its shard
  (``transposed_bytes``), live like ``widened``.
* one cuBLAS workspace (``GEMM_WORKSPACE``) in the working set: ``measure`` reports the
  larger of its Triton and cuBLAS compiles.

For a TPU target (``tpu-v5e``, ``tpu-v5p``, ``tpu-v6e``, ``tpu-v4``; ``on_tpu``) the figure
is the HBM XLA:TPU allocates, ``argument + output + temp - alias`` (``_tpu_targets``), and
the GPU's structure holds (bfloat16 kernels, fused norms and activations, the fused head,
the gradients written after the head), with these mechanisms of XLA:TPU, each read off its
buffer assignment (libtpu 0.0.42.1, ``--xla_dump_to``) or its figures, for v5e:

* the state as XLA:TPU allocates it (``state_bytes(target=)``, ``_state.tpu_padded_bytes``):
  of an array's two minor dimensions one is the 128 lanes and one the sublanes (16 rows
  in bf16), whichever pads less. A model of multiples of 128 pads nothing; the odd step
  of ``test_plan_tpu_model`` (d_model 144, F 392, V 301) has 4,508,160 bytes of
  parameter and optimizer allocations for 3,220,152 bytes of values, predicted to the byte.
  The optimizer update is in place (AdamW: no workspace, as on XLA:CPU): ``llama3.2-1b``
  under ``full`` is within 1% of ``measure`` without one.
* no 16-bit copies beside the stacks' own: no fp32 copy of a weight stack (the
  ``llama3.2-1b`` step's only fp32 ``[V, D]`` is the head's gradient sum below).
* the head, under the chunked loss (``head_chunks``): one chunk's logits, the gradient
  towards the hidden states of every chunk, and for a trained head two fp32 ``[V, D]``
  (``head_working_set``; ``llama3.2-1b``'s temp allocation holds ``f32[128256,2048]``).
* attention is the Splash kernel (``attention_implementation``): its blocks live in VMEM,
  no score tile in HBM (``tiny`` under ``dots``: no ``[B, H, T, block]`` buffer in memory
  space 0; the blockwise kernel's ``5 x bf16[8,8,1024,512]`` tiles were there).
* tiled layouts: a minor dimension is padded to 128 lanes (``lane_padded``). The
  kernel's per-head operands keep head_dim minor, so with a head_dim under 128 the saved
  queries, keys and output take ``128 / head_dim`` times their bytes (``tiny``, head_dim
  32: ``bf16[4,8,1024,4,32]{4,2,3,1,0:T(8,128)(2,1)}``, 32 MiB for 8 MiB of values); the
  values (``v``) are laid out with T minor, unpadded. A norm's row statistic
  ``f32[rows, 1]`` takes a whole lane tile (``f32[4,8,1024,128]`` for ``tiny``).
* VMEM: the memory-space assignment fills a scratch of ``VMEM_SCRATCH`` (``allocation:
  size 117440512, color 1, preallocated-temp``) with temporaries, which then take no HBM.
  A working set (the ``max`` of the layer's and the head's) within it is held there:
  ``predict`` counts none of it. ``tiny`` (B=8, T=1024, working set 66 MiB): ``full``
  measures 10.2 MiB of temp for 8 MiB of stored layer inputs and 1.5 MiB of gradients;
  the odd step at B=5, T=592: 4.8 MiB of temp where the compiler's live peak
  (``compiler_peak``, over HBM and VMEM) is 31.8 MiB. The HBM then holds long-lived
  buffers only, fragmented as a step without remat (``TPU_FRAGMENTATION[0]``: ``tiny``
  ``full``, 10.4 MiB predicted). A larger working set is counted whole (``small``'s 218
  MiB: its temp is above the model's, 22% under ``full``). Where even the stored
  residuals fit the scratch (the odd step at B=4, T=512, no remat: 42 MiB), they are in
  VMEM too; ``predict`` does not model that (11 MiB measured, 45 predicted).
* a quantized base (QLoRA): the layer's weights dequantized to the compute dtype, twice,
  in its working set (``layer_working_set``): the QLoRA ``llama3.1-8b`` step (B=1,
  T=8192, ``full``) had a live peak (``compiler_peak - argument``, 4,454 MiB) 1,094 MiB
  over the model without them, 2.5 layers' dequantized weights (436 MiB each). Inferred
  from the figures, not read off a dump.
* fragmentation: the temporaries' allocation is ``TPU_FRAGMENTATION`` times the bytes
  live at its peak (``hbm_temp``): 1.09 without remat, 1.54 with it, the medians of the
  rows named there. The buffer assignment XLA:TPU dumps does not account for it (its
  temp allocation is below ``temp_size_in_bytes``: 4,397,957,632 bytes for 6,290,617,344
  in ``llama3.2-1b``'s ``full`` step): a measured factor, not a mechanism.
* no cuBLAS workspace, and over FSDP no transposed shard copies (``compiler_extras`` is
  0): XLA:TPU gives a stack split along a minor axis a layout with that axis major in the
  step's own arguments (``small`` over 8 chips: ``parameter 6, shape |bf16[8,512,172]|``,
  ``bf16[8,512,172]{1,0,2:T(8,128)(2,1)}``, 1,409,024 bytes, its values' own), so no
  relaid-out copy is made (XLA:GPU copies it: ``transposed_bytes``). That step, ``full``,
  is 7.5% over ``measure`` (34.1 MiB predicted, 31.7 measured).
"""

import dataclasses

from jaxckpt.nn import TransformerConfig, segment_sizes
from jaxckpt.plan._layer_graph import LayerGraph, layer_graph
from jaxckpt.plan._specs import saved_tags
from jaxckpt.plan._state import (
    layer_param_bytes,
    layer_trainable_bytes,
    loss_scale_bytes,
    state_bytes,
    trainable_bytes,
    transposed_bytes,
    update_workspace,
    widened_bytes,
)
from jaxckpt.plan._targets import Target, compile_target
from jaxckpt.plan._workload import Workload, require_workload
from jaxckpt.remat import RematSpec
from jaxckpt.remat import get as get_remat
from jaxckpt.train._loss import chunk_count


@dataclasses.dataclass(frozen=True)
class Prediction:
    """Predicted bytes of one train step on one device (the same split as ``MemoryReport``).

    Example:
        >>> from jaxckpt import nn, plan
        >>> p = plan.predict(plan.Workload(nn.TransformerConfig.preset("tiny"), batch=2, seq=64), "full")
        >>> p.total == p.params + p.grads + p.optimizer + p.activations + p.inputs
        True
    """

    params: int
    grads: int
    optimizer: int
    activations: int
    inputs: int
    host: int = 0
    """Bytes in host memory (``pinned_host``): the optimizer state or master weights placed
    there, and the offloaded remat residuals (``host_activations``). Not part of ``total``,
    the device's peak."""
    host_activations: int = 0
    """Of ``host``: the remat residuals offloaded to host memory between the forward and the
    backward pass (``RematSpec.offload``; under ``offload_full`` the layer boundaries), one
    micro-batch's (``host_residual_bytes``)."""

    @property
    def total(self) -> int:
        """Params + gradients + optimizer state + activations + the token batch (on the device)."""
        return self.params + self.grads + self.optimizer + self.activations + self.inputs

    def to_dict(self) -> dict:
        """The fields, with ``total``."""
        return {**dataclasses.asdict(self), "total": self.total}


GEMM_WORKSPACE = 4 * 2**20
"""Bytes of the workspace XLA:GPU gives each cuBLAS matmul (``s8[4194304]`` in the custom
call's result on the sm_80 and sm_90 targets); the calls run one at a time, so a step
holds one. ``measure`` reports the larger peak of Triton's and cuBLAS's GEMMs, and on a
small step that is cuBLAS's, by this workspace."""


VMEM_SCRATCH = 112 * 2**20
"""Bytes of the VMEM scratch XLA:TPU's memory-space assignment fills with temporaries
(memory space 1: ``allocation: size 117440512, color 1, preallocated-temp`` in the buffer
assignment of ``tiny``, ``small`` and ``llama3.2-1b`` steps for v5e, of its 128 MiB of
VMEM): temporaries there take no HBM. ``predict`` holds a working set of at most this in
VMEM (the same bound for v5p and v6e: their dumps were not read)."""


TPU_FRAGMENTATION = (1.09, 1.54)
"""XLA:TPU's temporaries' allocation (``temp_size_in_bytes``) over the bytes live at its peak,
without remat and with it: the median of ``temp / (compiler_peak - argument)`` (the
compiler's own live-range peak, without fragmentation) over the v5e rows of
``bench_plan_tpu.py`` (libtpu 0.0.42.1). Without remat: ``tiny`` 1.06, ``small`` 1.11,
``gpt2`` 1.09 (B=8, T=1024). With remat (``full``, ``save_attn``): ``small`` 1.51, 1.56,
``gpt2`` 1.58, 1.55, ``llama3.2-1b`` (B=4, T=2048) ``full`` 1.54, QLoRA ``llama3.1-8b``
(B=1, T=8192) ``full`` 1.51, ``save_attn`` 1.35. The compiler's out-of-memory report names
it: "HLO temp 9.96G (Unpadded 7.85G, 21.1% fragmentation (2.10G))". The buffer assignment
it dumps does not show it: its temp allocation (``llama3.2-1b`` ``full``: 4,397,957,632
bytes) is below ``temp_size_in_bytes`` (6,290,617,344); what fills the difference is
not known, only that a remat'd step (a backward loop that allocates and frees a layer's
recomputed buffers) has more of it."""


def hbm_temp(live: int, target: "str | Target | None", remat: bool = True) -> int:
    """XLA:TPU's temporaries' allocation in HBM (``temp_size_in_bytes``) for ``live`` bytes of
    temporaries the model holds at the peak (activations and gradients), with or without
    ``remat``: ``live x TPU_FRAGMENTATION``; ``live`` itself for other compilers.

    Example:
        >>> hbm_temp(100, "tpu-v5e"), hbm_temp(100, "tpu-v5e", remat=False), hbm_temp(100, None)
        (154, 109, 100)
    """
    if not on_tpu(target):
        return live
    return round(live * TPU_FRAGMENTATION[bool(remat)])


def live_temp(allocation: int, target: "str | Target | None", remat: bool = True) -> int:
    """The inverse of ``hbm_temp``: the live bytes an allocation of ``allocation`` holds (the
    solver's budget rows).

    Example:
        >>> live_temp(154, "tpu-v5e"), live_temp(154, None)
        (100, 154)
    """
    if not on_tpu(target):
        return allocation
    return int(allocation / TPU_FRAGMENTATION[bool(remat)])


def _target(target: "str | Target | None") -> Target | None:
    return None if target is None else compile_target(target)


def on_tpu(target: "str | Target | None") -> bool:
    """Whether ``target`` is a TPU (``plan.TARGETS``' ``tpu-*``: XLA:TPU's mechanisms).

    Example:
        >>> on_tpu("tpu-v5e"), on_tpu("h100-80g"), on_tpu(None)
        (True, False, False)
    """
    return target is not None and compile_target(target).platform == "tpu"


def layer_working_set(workload: Workload, *, target: "str | Target | None" = None) -> int:
    """Bytes in flight while one layer runs its backward pass under full remat.

    Its recomputed residuals, its weight-gradient slice, one cotangent of width F and
    one of width D, and one attention tile, for one device's batch. (Before the dense
    projections took their weight gradient from a materialised ``x^T``
    (``nn._dense.dense_dot_general``), XLA:CPU held two of each: every family's measured
    peak fell by one ``[n, F + D]`` pair with it, at 3,072 tokens 9.9 MiB of 130 to 870.)
    Under FSDP nothing is added for the layer's gathered parameters: with it the
    prediction was one layer's parameters over XLA's peak (small, 8 devices); without
    it, ``tiny`` and ``small`` over 2-8 devices are within 6% of XLA.

    For a GPU ``target`` the residuals are XLA:GPU's (``layer_graph(target=)``: no score
    tile under cuDNN, fewer internals held).
    """
    config = workload.config
    graph = layer_graph(workload, target=target)
    n, e = workload.local_tokens, config.compute_dtype.itemsize
    cotangents = n * (config.ffn_dim + config.d_model) * e
    weight_grads = layer_trainable_bytes(config)
    # XLA:TPU, a quantized base: the layer's weights dequantized to the compute dtype, twice
    # (the QLoRA ``llama3.1-8b`` step's live peak is 2.5 layers' dequantized weights over
    # the model without them; see the module)
    dequantized = 2 * graph.weights if on_tpu(target) and config.quantize_base is not None else 0
    return graph.working_residual_bytes() + weight_grads + cotangents + graph.attention_tile + dequantized


def head_chunks(workload: Workload) -> int:
    """Chunks along T the step's loss cuts the head into (``train._loss.chunk_count``: 1 while
    a micro-batch's fp32 logits ``[B, T, V]`` fit ``CHUNK_LOGITS_BYTES``, 64 MiB).

    Example:
        >>> from jaxckpt import nn, plan
        >>> cfg = nn.TransformerConfig.preset("llama3.2-1b")
        >>> head_chunks(plan.Workload(cfg, 4, 2048)), head_chunks(plan.Workload(cfg, 1, 64))
        (64, 1)
    """
    return chunk_count(workload.batch, workload.seq, workload.config.vocab_size)


def head_working_set(workload: Workload, *, target: "str | Target | None" = None) -> int:
    """The output head: the fp32 logits the loss reads and their gradient, ``[B, T, V]``
    each; in a 16-bit compute dtype also the logits and their gradient in it. A logit soft
    cap (``config.logits_softcap``) adds the capped logits and their gradient in fp32
    (measured on XLA:CPU: 14.6 bytes per logit for 16 predicted); in 16 bits XLA fuses
    the cap into the conversion and it adds nothing (11.6 bytes measured, 12 predicted,
    with or without it). Over several devices, also the head's weights gathered whole
    and their full gradient.

    XLA:GPU (a GPU ``target``) fuses the log-softmax into the reductions that read the
    logits: of the four buffers it keeps the fp32 gradient and one 16-bit buffer, the
    logits and then (in the same place) their gradient cast to the compute dtype:
    ``4 + e`` bytes a logit (8 in fp32), 6 in 16 bits (measured on ``gpt2`` at 8,192
    tokens: ``f32[8,1024,50257]`` and ``bf16[8192,50257]`` at the peak, nothing else of
    that size). XLA:TPU does the same for a trained head; under LoRA (a frozen head) it
    held two fp32 buffers, the logits and a flattened copy the loss reads, 8 bytes a logit
    (QLoRA ``llama3.1-8b`` at B=1, T=8192 before the loss was chunked: ``f32[1,8192,128256]``
    and ``f32[1050673152]{0:T(1024)}``, 4,008 MiB each).

    The chunked loss (``head_chunks`` > 1, ``train._loss.chunked_loss_sum``) holds those
    per-logit bytes for one chunk of ``ceil(T / chunks)`` positions, beside what it keeps
    from every chunk: the gradient towards the hidden states (``[B, T, D]`` in the compute
    dtype) and, when the head trains, the fp32 sum of its weight gradient and the chunk's
    own (two ``[V, D]`` fp32; over FSDP each device sums its shard).

    Example:
        >>> from jaxckpt import nn, plan
        >>> cfg = nn.TransformerConfig.preset("tiny")
        >>> w = plan.Workload(cfg, batch=2, seq=64)
        >>> head_working_set(w) == 2 * 64 * cfg.vocab_size * 8  # fp32: the logits and their gradient
        True
        >>> head_working_set(w.replace(config=cfg.replace(logits_softcap=30.0))) == 2 * head_working_set(w)
        True
        >>> bf16 = w.replace(config=cfg.replace(dtype="bfloat16"))
        >>> head_working_set(bf16, target="h100-80g") == 2 * 64 * cfg.vocab_size * 6
        True
    """
    config = workload.config
    gathered = 2 * config.vocab_size * config.d_model * config.storage_dtype.itemsize
    e = config.compute_dtype.itemsize
    if on_tpu(target) and config.lora is not None and config.logits_softcap is None:
        per_logit = 8  # XLA:TPU, frozen head: two fp32 buffers (see the docstring)
    elif _target(target) is not None and config.logits_softcap is None:
        per_logit = 4 + e
    else:
        per_logit = 8 + (2 * e if e != 4 else 8 if config.logits_softcap is not None else 0)
    chunks = head_chunks(workload)
    if chunks == 1:
        head = workload.local_tokens * config.vocab_size * per_logit
    else:
        size = -(-workload.seq // chunks) // workload.seq_shards  # a chunk's share of T on one device
        head = workload.local_batch * size * config.vocab_size * per_logit
        head += workload.local_batch * chunks * size * config.d_model * e  # g_x, every chunk's
        if config.lora is None:  # the fp32 sum of the head's weight gradient, and the chunk's
            head += 2 * config.vocab_size * config.d_model * 4 // workload.devices
    return head + (gathered if workload.devices > 1 else 0)


def unwritten_grads(workload: Workload, *, target: "str | Target | None" = None) -> int:
    """Gradient bytes not yet allocated while the head runs its backward pass.

    XLA:CPU's peak holds every gradient with the head's working set (0 here). XLA:GPU
    allocates the layer stacks' gradients when the backward scan first writes them, after
    the head: the head's logits and the layers' gradients share addresses (``gpt2``: the
    gradient stacks lie inside the freed ``f32[B, T, V]``). Only the head's own weight
    gradient is live with it (under LoRA no gradient is: the head is frozen).

    Example:
        >>> from jaxckpt import nn, plan
        >>> w = plan.Workload(nn.TransformerConfig.preset("tiny"), batch=2, seq=64)
        >>> unwritten_grads(w), 0 < unwritten_grads(w, target="h100-80g") < plan.trainable_bytes(w)
        (0, True)
    """
    if _target(target) is None:
        return 0
    config = workload.config
    head = (
        0 if config.lora is not None else config.vocab_size * config.d_model * config.storage_dtype.itemsize
    )
    return max(0, trainable_bytes(workload, target=target) - head // workload.devices)


def head_branch(workload: Workload, *, target: "str | Target | None" = None) -> int:
    """The head's side of the activation model's ``max``: its working set, less the gradients
    not yet written while it runs (``predict`` and the solver's budget rows)."""
    return head_working_set(workload, target=target) - unwritten_grads(workload, target=target)


def compiler_extras(workload: Workload, *, target: "str | Target | None" = None) -> int:
    """What a GPU target's step holds beside the model's branches, whatever is saved: one
    cuBLAS workspace and FSDP's transposed shards (``transposed_bytes``); 0 on XLA:CPU and
    XLA:TPU."""
    if _target(target) is None:
        return 0
    if on_tpu(target):  # XLA:TPU lays the shards out split axis major: no copies (see the module)
        return 0
    return GEMM_WORKSPACE + transposed_bytes(workload, target=target)


def predict(
    workload: Workload, remat: "str | RematSpec", *, target: "str | Target | None" = None
) -> Prediction:
    """Predicts one device's memory for a train step from shapes (no compile; ``measure`` is the check).

    Args:
        workload: the step. ``micro_batches > 1`` adds one gradient accumulator; over
            ``devices`` the figures are one device's. Under LoRA the gradients are the
            adapters'. State placed in host memory (``optimizer.offload``,
            ``optimizer.offload_master``) is ``Prediction.host``, not part of the device's total;
            host master weights leave their compute-dtype copy (and its gradient) on the
            device, and the update streams leaf by leaf.
        remat: a preset name or ``RematSpec``. Its offloaded residuals (``offload``, the
            layer boundaries under ``offload_full``) are ``Prediction.host_activations``,
            in ``host`` and not in the device's total; the layer that runs its backward
            pass holds its input brought back, as any layer's working set does.
        target: the compiler the step is predicted for, as ``measure(target=)``: None for
            XLA:CPU, a GPU target (``plan.TARGETS``, e.g. ``"h100-80g"``) for XLA:GPU
            (see the module for what differs).

    Raises:
        TypeError: when ``workload`` is not a ``Workload``.
        ValueError: for an unknown remat preset (or ``"auto"``: that is what ``plan_memory``
            answers), or an unknown target.

    Example:
        >>> from jaxckpt import nn, plan
        >>> w = plan.Workload(nn.TransformerConfig.preset("tiny"), batch=2, seq=256)
        >>> plan.predict(w, "none").activations > plan.predict(w, "full").activations
        True
        >>> bf16 = w.replace(config=w.config.replace(dtype="bfloat16", param_dtype="bfloat16"))
        >>> plan.predict(bf16, "full", target="h100-80g").total < plan.predict(bf16, "full").total
        True
    """
    require_workload(workload, "predict")
    spec = get_remat(remat)
    target = _target(target)
    config = workload.config
    params, opt = state_bytes(workload, target=target)
    graph = layer_graph(workload, target=target)
    stored = stored_bytes(graph, spec, config)
    layer = layer_working_set(workload, target=target)
    if spec.enabled and target is None:  # what a layer keeps is not recomputed, so not held twice
        layer -= graph.stored_bytes(saved_tags(spec) - spec.offload) - graph.values["x"].nbytes
    if spec.enabled:
        k, _ = segments(config, spec)
        if config.n_layers > k > 1:
            # a segment's backward pass slices k layers' parameters and their gradients
            # out of the stacks (measured: XLA copies both)
            layer += k * (layer_param_bytes(config) + layer_trainable_bytes(config)) // workload.devices
    working = max(layer, head_branch(workload, target=target)) + compiler_extras(workload, target=target)
    in_vmem = on_tpu(target) and working <= VMEM_SCRATCH
    if in_vmem:  # held in VMEM, no HBM (see the module)
        working = 0
    widened = widened_bytes(workload, target=target)
    if not spec.enabled:  # the stored casts are those copies
        widened = max(0, widened - config.n_layers * weight_casts(graph, config))
    grads = trainable_bytes(workload, target=target) * (2 if workload.micro_batches > 1 else 1)
    offloaded = host_residual_bytes(graph, spec, config)
    host = 0
    if workload.optimizer.offload:
        host, opt = opt, 0
    if workload.optimizer.offload_master:  # the device holds a compute-dtype copy
        half = config.compute_dtype.itemsize
        host, params, grads = host + params, params * half // 4, grads * half // 4
    activations = max(stored + working + widened, update_workspace(workload)) + loss_scale_bytes(workload)
    if on_tpu(target):  # the HBM temporaries' allocation, gradients included (see the module)
        # the remat'd fragmentation is that of a working set in HBM (see TPU_FRAGMENTATION)
        activations = hbm_temp(activations + grads, target, spec.enabled and not in_vmem) - grads
    return Prediction(
        params=params,
        grads=grads,
        optimizer=opt,
        activations=max(0, activations),
        inputs=workload.input_bytes,
        host=host + offloaded,
        host_activations=offloaded,
    )


def segments(config: TransformerConfig, spec: RematSpec) -> tuple[int, int]:
    """``(k, count)``: the layers of one remat segment (1: every layer is its own) and the
    segments of the stack, as ``nn.segment_sizes`` cuts it (a shorter last segment when k
    does not divide ``n_layers``).

    Example:
        >>> from jaxckpt import nn, remat
        >>> cfg = nn.TransformerConfig.preset("tiny", n_layers=9)
        >>> segments(cfg, remat.get("ratio_0.25")), segments(cfg, remat.get("full")), segments(cfg, "none")
        ((4, 3), (1, 9), (1, 9))
    """
    spec = get_remat(spec)
    k, n_full = segment_sizes(spec, config.n_layers)
    return k, n_full + (config.n_layers > k * n_full)


def stored_bytes(graph: LayerGraph, spec: RematSpec, config: TransformerConfig) -> int:
    """Bytes the layers keep on the device from the forward pass for the backward pass.

    Without remat, every layer's residuals, and its weights cast to the compute dtype when
    that is not the storage dtype (the matmuls' input gradients read the cast).
    """
    n_layers = config.n_layers
    if not spec.enabled:
        return n_layers * (graph.residual_bytes() + weight_casts(graph, config))
    k, count = segments(config, spec)
    x = graph.values["x"].nbytes
    kept = graph.stored_bytes(saved_tags(spec) - spec.offload) - x  # offloaded tags live on the host
    # a segment of k layers keeps its input (unless it is offloaded); its backward pass holds
    # its k layer inputs
    boundaries = count - offloaded_boundaries(config, spec) + (k if k > 1 else 0)
    return n_layers * kept + x * boundaries


def offloaded_boundaries(config: TransformerConfig, spec: "str | RematSpec") -> int:
    """The remat boundaries (segment inputs) in host memory: under ``RematSpec.offloads_boundary``
    one per segment of the stack's scan (every layer's input when ``layers_per_checkpoint`` is
    1), else none. A shorter last segment runs outside the scan and its input stays on the
    device: its backward pass comes first, right after the forward, and XLA:GPU makes no round
    trip of it (measured: 5 layers in segments of 2, host memory of 2 boundaries).

    Example:
        >>> from jaxckpt import nn, remat
        >>> cfg = nn.TransformerConfig.preset("tiny", n_layers=5)
        >>> offloaded_boundaries(cfg, "offload_full"), offloaded_boundaries(cfg, "full")
        (5, 0)
        >>> segments_of_2 = remat.RematSpec(offload={remat.Tag.LAYER_INPUT}, layers_per_checkpoint=2)
        >>> offloaded_boundaries(cfg, segments_of_2)  # 2 + 2 scanned, the fifth layer on its own
        2
    """
    spec = get_remat(spec)
    if not spec.offloads_boundary:
        return 0
    return segment_sizes(spec, config.n_layers)[1]


def host_residual_bytes(graph: LayerGraph, spec: RematSpec, config: TransformerConfig) -> int:
    """Bytes of remat residuals in host memory between the forward and the backward pass, one
    micro-batch's: every layer's offloaded tags (``RematSpec.offload``; those the backward
    pass uses, ``LayerGraph.kept``) and the offloaded boundaries (``offloaded_boundaries``).
    What crosses the host link each step is twice this per micro-batch (``choice``).

    Example:
        >>> from jaxckpt import nn, plan, remat
        >>> w = plan.Workload(nn.TransformerConfig.preset("tiny", n_layers=3), batch=2, seq=64)
        >>> graph, cfg = plan.layer_graph(w), w.config
        >>> host_residual_bytes(graph, remat.get("offload_full"), cfg) == 3 * graph.values["x"].nbytes
        True
        >>> host_residual_bytes(graph, remat.get("full"), cfg)
        0
    """
    if not spec.enabled:
        return 0
    tags = saved_tags(spec)
    per_layer = graph.stored_bytes(tags) - graph.stored_bytes(tags - spec.offload)
    return config.n_layers * per_layer + graph.values["x"].nbytes * offloaded_boundaries(config, spec)


def weight_casts(graph: LayerGraph, config: TransformerConfig) -> int:
    """Bytes of one layer's weights cast to the compute dtype that autodiff keeps without
    remat: all of them when it is not the storage dtype, none for a quantized base (its
    matmul keeps the codes and dequantizes again in the backward pass).

    Example:
        >>> from jaxckpt import nn, plan
        >>> cfg = nn.TransformerConfig.preset("tiny", lora=4, param_dtype="bfloat16")
        >>> graph = plan.layer_graph(plan.Workload(cfg, 1, 8))
        >>> weight_casts(graph, cfg) == graph.weights, weight_casts(graph, cfg.replace(quantize_base="nf4"))
        (True, 0)
    """
    if config.quantize_base is not None or config.compute_dtype == config.storage_dtype:
        return 0
    return graph.weights


def korthikanti_bytes(config: TransformerConfig, batch: int, seq: int, *, flash: bool) -> int:
    """Per-layer activation bytes of Korthikanti et al. 2022 (Eq. 1), in 16-bit units.

    ``s b h (34 + 5 a s / h)`` bytes for a GPT layer with dropout and 16-bit activations;
    flash attention keeps no ``a s^2`` term, leaving ``34 s b h``. A published formula
    of its own arguments (``batch`` is the batch one device runs), not of a ``Workload``.

    Example:
        >>> from jaxckpt import nn, plan
        >>> cfg = nn.TransformerConfig.preset("gpt2")
        >>> plan.korthikanti_bytes(cfg, 1, 1024, flash=True) == 1024 * 768 * 34
        True
    """
    s, b, h, a = seq, batch, config.d_model, config.n_heads
    return s * b * h * 34 + (0 if flash else 5 * a * s * s * b)
