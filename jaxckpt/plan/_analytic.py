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
* LoRA: a recomputed layer holds one adapter's ``[n, d_out]`` output at a time, the largest,
  not every adapter's (``layer_graph``; the backward runs the adapted projections one after
  another and reuses the buffer): with the sum the 8B QLoRA long-context rows were predicted
  13.9-17.9% over XLA:GPU, with the largest within 5.3% (``bench_long_context.py``, compiled
  again at the lengths XLA:GPU confirms).

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
* VMEM: the memory-space assignment fills a scratch of VMEM with temporaries, which then
  take no HBM (memory space 1: ``allocation: size 117440512, color 1, preallocated-temp``
  on v5e). Its size is the chip's: the core's VMEM less the scoped VMEM XLA:TPU keeps for
  each fusion and kernel (``vmem_scratch``, ``TpuTarget.vmem_scratch``): 112 MiB of v5e's
  128, 96 of v6e's 128, 48 of v5p's 64, the VMEM sizes being JAX's own TPU target
  description (``pltpu.get_tpu_info_for_chip``). The dumps of the bf16 ``small`` step
  (B=8, T=1024, ``full``) fill 112.0, 94.6 and 46.8 MiB of it. The rule, read off the
  buffer assignments:

  - a working set (the ``max`` of the layer's and the head's) within the scratch is held
    there: ``predict`` counts none of it;
  - the layer inputs' stack (``boundary_bytes``, compressed or not) is in VMEM too where it
    fits beside that working set and the gradients. The HBM's temporaries are then the
    gradients and the Splash kernel's scratch, which it allocates per sequence
    (``kernel_hbm_scratch``; fragmented as a remat'd working set). In ``tiny`` (B=8,
    T=1024, v5e) the stacked inputs are ``bf16[4,8,1024,128]...S(1)`` under ``full`` and
    ``s8[4,8,1024,128]...S(1)`` with their scales ``f32[4,1,8192]...S(1)`` under ``full``
    with int8 layer inputs. Under both, the HBM temporaries at their live peak are
    ``f32[8,512,128]`` twice and ``f32[8,512,32]``, 6.1 MiB: measured 15.44 and 15.57 MB,
    predicted 16.30 (+5.6%, +4.7%). Counted in HBM, the inputs gave +2.1% for ``full``
    (their 8 MiB stood in for the kernel's scratch) and -27.2% for int8, which halves
    them. The odd step of ``test_plan_tpu_model`` at B=8, T=1024 (working set 65 MiB) went
    from -25% to +5% on v5e; on v6e, whose scratch (96 MiB) holds it too, it is +4.9%
    (15.13 MB measured, 15.87 predicted);
  - kept attention outputs stay in HBM (``tiny`` under ``save_attn``: 47.9 MiB of temp
    for the model's 40.5 MiB stored);
  - a larger working set fills the scratch, and the HBM holds the rest: ``predict`` takes
    the scratch off it. At ``small``'s live peak (B=8, T=1024, ``full``) all of v5e's 112
    MiB are the working set's (fp32 RoPE buffers ``f32[8,1024,8,32]{3,1,2,0:T(8,128)S(1)}``
    and bf16 ``[8,1024,512]`` activations), and the HBM's live peak falls as the chip's
    scratch grows: 320.2 MiB on v5p, 281.1 on v6e, 257.1 on v5e (367.0, 375.7 and 369.1
    with the scratch added back). The model's live bytes are 368.8 MiB (the stored layer
    inputs 64, the working set 256, the RoPE backward's: ``rope_backward_bytes``, the
    gradients 48.8), so 256.8, 272.8 and 320.8 in HBM. The fragmentation
    (``TPU_FRAGMENTATION``) is the allocation's over the HBM's live bytes, so it applies
    after the scratch is taken off. Tried before and not kept, each alone: the scratch taken
    off a working set that lacked the RoPE phase (worst 16.2%, ``small`` -14% to -16% on
    v6e), and the RoPE buffers added to the sum without the scratch (1B rows 10% over).
    Nor does the assignment always fill the scratch: the odd step at B=8, T=1024 on v5p
    (working set 65 MiB, scratch 48) measures 81.85 MiB, its HBM's live peak 50.4 MiB, so
    about 20 MiB of the working set are in VMEM, not 48: ``predict`` gives 39.87 MiB (-51%;
    counted whole it was 113.79, +39%). How much of a scratch a working set a little larger
    than it fills depends on how its buffers pack, which is not modelled.
  - Where even the stored residuals of a step without remat fit the scratch (the odd step
    at B=4, T=512: 42 MiB), they are in VMEM too; ``predict`` does not model that (11 MiB
    measured, 45 predicted).
* the RoPE backward (``rope_backward_bytes``), a phase of a layer's backward of its own:
  ``nn.apply_rope`` rotates in float32, and its backward holds the fp32 cotangent of the
  rotated q and k and their two halves, each padded to 128 lanes (``f32[8,1024,8,32]
  {3,1,2,0:T(8,128)}``, 32 MiB for 8 MiB of values), beside the kernel's q and k and four
  ``[B, T, D]`` activations: 256 MiB in ``small`` (B=8, T=1024) at the step's live peak
  (369.1 MiB with the stacked layer inputs and the gradients), where the model's sum over
  the rest of the layer's backward is 217.8 (the dump's peak outside the RoPE buffers'
  lifetimes: 301.6 MiB in all, ``fusion.378``, the MLP's backward). The layer's working
  set is the larger of the two (``layer_working_set``); in the 1B and 8B steps the rest is
  larger.
* a quantized base (QLoRA): the layer's weights dequantized to the compute dtype, twice,
  in its working set (``layer_working_set``): the QLoRA ``llama3.1-8b`` step (B=1,
  T=8192, ``full``) had a live peak (``compiler_peak - argument``, 4,454 MiB) 1,094 MiB
  over the model without them, 2.5 layers' dequantized weights (436 MiB each). Inferred
  from the figures, not read off a dump.
* fragmentation: the temporaries' allocation is ``TPU_FRAGMENTATION`` times the bytes
  live in HBM at its peak (``hbm_temp``; the VMEM scratch taken off, as the factor was
  measured over ``compiler_peak - argument``, the HBM's live peak): 1.09 without remat,
  1.54 with it, the medians of the rows named there. The buffer assignment XLA:TPU dumps
  does not account for it (its temp allocation is below ``temp_size_in_bytes``:
  4,397,957,632 bytes for 6,290,617,344 in ``llama3.2-1b``'s ``full`` step): a measured
  factor, not a mechanism. It differs by chip for the same program (``small`` under
  ``full``: 1.51 on v5e, 1.57 on v6e, 1.38 on v5p), so even the compiler's own live bytes
  would put ``small`` ``full`` on v5p at +8.9%.
* the fp32 sums of a trained head's weight gradient, which the chunked loss keeps from its
  forward, die when the head's backward converts them, before the layers' backward
  (``train._loss.chunked_loss_sum`` pins that order with an optimization barrier). Left to
  itself XLA:TPU's scheduler kept ``gpt2``'s ``f32[50257,768]`` (147.3 MiB) through every
  layer's backward under ``save_attn`` (on v5e and on v5p, at B=8 and at B=40, and with a
  128,256-entry vocabulary) but not under ``full``, nor ``llama3.2-1b``'s under either,
  whatever its vocabulary: a scheduling choice no shape predicts, so the step no longer
  leaves it to the scheduler. With the barrier ``gpt2`` ``save_attn`` measures 2,126.3 MiB
  instead of 2,291.4 (-3.3% predicted; it was the grid's worst row, -10.3%).
* not modelled, read off the dump of ``gpt2`` under ``save_attn`` (v5e, before the
  barrier): transposed copies of the q, k and v weight stacks (``bf16[12,768,768]{1,2,0}``
  three times, 40.5 MiB, live over the whole step; ``small``'s dump has none), the chunks'
  hidden-state gradients (``bf16[31,8,32,768]``, 11.6 MiB) kept through the layers'
  backward, and VMEM holding 85.4 MiB of the working set, not the scratch's 112.
* no cuBLAS workspace, and over FSDP no transposed shard copies (``compiler_extras`` is
  0): XLA:TPU gives a stack split along a minor axis a layout with that axis major in the
  step's own arguments (``small`` over 8 chips: ``parameter 6, shape |bf16[8,512,172]|``,
  ``bf16[8,512,172]{1,0,2:T(8,128)(2,1)}``, 1,409,024 bytes, its values' own), so no
  relaid-out copy is made (XLA:GPU copies it: ``transposed_bytes``). That step, ``full``,
  is 7.5% over ``measure`` (34.1 MiB predicted, 31.7 measured).
"""

import dataclasses

from jaxckpt.nn import TransformerConfig, segment_sizes
from jaxckpt.plan._compilers import compiled_by, hbm_temp, on_tpu, vmem_scratch
from jaxckpt.plan._compression import boundary_format, dequantize_bytes
from jaxckpt.plan._layer_graph import LayerGraph, layer_graph
from jaxckpt.plan._specs import saved_tags
from jaxckpt.plan._state import (
    layer_param_bytes,
    layer_trainable_bytes,
    loss_scale_bytes,
    state_bytes,
    trainable_bytes,
    update_workspace,
    widened_bytes,
)
from jaxckpt.plan._targets import Target
from jaxckpt.plan._working_set import compiler_extras, head_branch, kernel_hbm_scratch, layer_working_set
from jaxckpt.plan._workload import Workload, require_workload
from jaxckpt.remat import RematSpec
from jaxckpt.remat import get as get_remat


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
    target = compiled_by(target)
    config = workload.config
    params, opt = state_bytes(workload, target=target)
    graph = layer_graph(workload, target=target)
    stored = stored_bytes(graph, spec, config)
    layer = layer_working_set(workload, target=target)
    if spec.enabled and target is None:  # what a layer keeps is not recomputed, so not held twice
        # (a compressed value is: the backward holds it dequantized, as an offloaded one brought back)
        layer -= (
            graph.stored_bytes(saved_tags(spec) - spec.offload - spec.compress.keys())
            - graph.values["x"].nbytes
        )
    layer += dequantize_bytes(graph, spec, target)
    if spec.enabled:
        k, _ = segments(config, spec)
        if config.n_layers > k > 1:
            # a segment's backward pass slices k layers' parameters and their gradients
            # out of the stacks (measured: XLA copies both)
            layer += k * (layer_param_bytes(config) + layer_trainable_bytes(config)) // workload.devices
    working = max(layer, head_branch(workload, target=target)) + compiler_extras(workload, target=target)
    grads = trainable_bytes(workload, target=target) * (2 if workload.micro_batches > 1 else 1)
    scratch = vmem_scratch(target)  # XLA:TPU: the chip's VMEM for temporaries (0 elsewhere)
    in_vmem = on_tpu(target) and working <= scratch
    kernel_scratch = 0  # XLA:TPU: short-lived temporaries in HBM beside a working set in VMEM
    if in_vmem:  # held in VMEM, no HBM (see the module)
        stack = boundary_bytes(graph, spec, config)
        if spec.enabled and stack <= scratch - working - grads:
            # the layer inputs' stack fits beside it: in VMEM too, and the HBM holds the kernel's
            # scratch alone
            stored -= stack
            kernel_scratch = kernel_hbm_scratch(workload, target=target)
        working = 0
    else:  # a larger working set fills the scratch, and the HBM holds the rest (see the module)
        working -= scratch
    widened = widened_bytes(workload, target=target)
    if not spec.enabled:  # the stored casts are those copies
        widened = max(0, widened - config.n_layers * weight_casts(graph, config))
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
        activations += hbm_temp(kernel_scratch, target)  # allocated and freed by each layer: remat'd
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
    that is not the storage dtype (the matmuls' input gradients read the cast). The values of
    the tags ``spec`` compresses, the layer inputs among them, at their compressed size
    (``LayerGraph.stored_value_bytes``).
    """
    n_layers = config.n_layers
    if not spec.enabled:
        return n_layers * (graph.residual_bytes() + weight_casts(graph, config))
    k = segments(config, spec)[0]
    x = graph.values["x"].nbytes
    stored_x = graph.stored_value_bytes("x", boundary_format(spec), spec.compress_group)
    # offloaded tags live on the host
    kept = graph.stored_bytes(saved_tags(spec) - spec.offload, spec.compress, spec.compress_group) - stored_x
    # a segment of k layers keeps its input (unless it is offloaded); its backward pass holds
    # its k layer inputs
    return n_layers * kept + boundary_bytes(graph, spec, config) + x * (k if k > 1 else 0)


def boundary_bytes(graph: LayerGraph, spec: RematSpec, config: TransformerConfig) -> int:
    """Bytes of the stored layer inputs on the device: one per remat segment, at their
    compressed size under a compressed boundary (``stored_bytes``' boundaries; 0 without remat).

    Example:
        >>> from jaxckpt import nn, plan, remat
        >>> w = plan.Workload(nn.TransformerConfig.preset("tiny", n_layers=3), batch=2, seq=64)
        >>> graph, cfg = plan.layer_graph(w), w.config
        >>> boundary_bytes(graph, remat.get("full"), cfg) == 3 * graph.values["x"].nbytes
        True
        >>> [boundary_bytes(graph, remat.get(p), cfg) for p in ("offload_full", "none")]
        [0, 0]
    """
    if not spec.enabled:
        return 0
    count = segments(config, spec)[1] - offloaded_boundaries(config, spec)
    return graph.stored_value_bytes("x", boundary_format(spec), spec.compress_group) * count


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
    What crosses the host link each step is twice this per micro-batch (``choice``). A tag
    both offloaded and compressed crosses at its compressed size (about half of a bf16 one).

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
    tags, formats, group = saved_tags(spec), spec.compress, spec.compress_group
    per_layer = graph.stored_bytes(tags, formats, group) - graph.stored_bytes(
        tags - spec.offload, formats, group
    )
    stored_x = graph.stored_value_bytes("x", boundary_format(spec), group)
    return config.n_layers * per_layer + stored_x * offloaded_boundaries(config, spec)


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
