"""What a remat spec costs per train step: its predicted bytes, recompute FLOPs, offload
traffic and, for compressed residuals, the (de)quantization's FLOPs and memory traffic."""

import dataclasses

from jaxckpt.plan._analytic import Prediction, predict
from jaxckpt.plan._compression import compress_cost
from jaxckpt.plan._devices import DevicePreset
from jaxckpt.plan._layer_costs import attention_implementation
from jaxckpt.plan._layer_graph import layer_graph
from jaxckpt.plan._specs import saved_tags
from jaxckpt.plan._targets import Target
from jaxckpt.plan._workload import Workload, require_workload
from jaxckpt.remat import RematSpec
from jaxckpt.remat import get as get_remat


@dataclasses.dataclass(frozen=True)
class Choice:
    """One remat spec with its predicted bytes and its costs per train step (one device's).

    ``compress_flops`` and ``compress_bytes``: what quantizing the compressed residuals in the
    forward pass and dequantizing them in the backward pass compute and move through device
    memory per step (``RematSpec.compress``; 0 without it).

    Example:
        >>> from jaxckpt import nn, plan
        >>> c = plan.choice(plan.Workload(nn.TransformerConfig.preset("tiny"), batch=2, seq=64), "full")
        >>> c.spec.enabled, c.seconds(plan.DEVICES["a100-80g"]) > 0, c.compress_flops
        (True, True, 0)
    """

    spec: RematSpec
    predicted: Prediction
    recompute_flops: int
    transfer_bytes: int
    compress_flops: int = 0
    compress_bytes: int = 0

    def compress_seconds(self, device: DevicePreset) -> float:
        """The (de)quantization's time: its FLOPs at the device's rate plus its traffic at its
        HBM bandwidth (0 without compression)."""
        return self.compress_flops / device.flops + self.compress_bytes / device.hbm_bandwidth

    def seconds(self, device: DevicePreset) -> float:
        """Recompute time at the device's matmul rate plus offload traffic at its host bandwidth,
        plus the compressed residuals' (de)quantization (``compress_seconds``)."""
        transfer = self.transfer_bytes / device.host_bandwidth
        return self.recompute_flops / device.flops + transfer + self.compress_seconds(device)

    def step_seconds(self, device: DevicePreset, step_flops: int) -> float:
        """An estimate of the whole step's time: its FLOPs (``step_flops`` plus the
        recompute) at the device's peak matmul rate, plus the offload traffic at its host
        link and the (de)quantization of compressed residuals (``compress_seconds``).
        Compute-bound and at peak: a floor to compare specs by, not a forecast.

        Example:
            >>> from jaxckpt import nn, plan
            >>> w = plan.Workload(nn.TransformerConfig.preset("tiny"), batch=2, seq=64)
            >>> v5e, step = plan.DEVICES["tpu-v5e"], plan.step_flops(w)
            >>> full, none = plan.choice(w, "full"), plan.choice(w, "none")
            >>> full.step_seconds(v5e, step) > none.step_seconds(v5e, step)
            True
        """
        flops = step_flops + self.recompute_flops
        transfer = self.transfer_bytes / device.host_bandwidth
        return flops / device.flops + transfer + self.compress_seconds(device)


KERNEL_CALLS = frozenset({"splash", "pallas", "cudnn"})
"""Attention implementations compiled as custom calls (Mosaic, Triton, cuDNN): XLA's cost
analysis counts nothing inside one."""


def _attention_kernel_flops(workload: Workload, spec: RematSpec, target) -> int:
    """FLOPs the step's attention kernels run when they are custom calls (else 0): three
    times the forward per layer, as ``step_flops`` counts, and once more where the backward
    pass recomputes the attention."""
    if attention_implementation(workload.config, target, workload.attention) not in KERNEL_CALLS:
        return 0
    graph = layer_graph(workload, target=target)
    forward = sum(op.flops for op in graph.ops if op.name == "attention")
    recomputed = spec.enabled and any(
        op.name == "attention" for op in graph.recompute(graph.tagged(saved_tags(spec)) | {"x"})
    )
    return workload.micro_batches * workload.config.n_layers * forward * (4 if recomputed else 3)


def xla_step_cost(
    flops: float,
    bytes_accessed: float,
    workload: Workload,
    remat: "str | RematSpec",
    *,
    target: "str | Target | None" = None,
) -> tuple[float, float]:
    """A compiled step's FLOPs and bytes accessed, from its ``cost_analysis()`` figures
    (``MemoryReport.flops``, ``bytes_accessed``) made whole. XLA's cost analysis

    * counts the body of a loop once, whatever its trip count, and jaxckpt's layers are one
      ``lax.scan`` (measured on XLA:TPU: a scan of 4 matmuls costs the FLOPs of one): the
      figures are scaled by the step's analytic FLOPs over those of the same step with one
      layer (attention kernels left out of both);
    * counts nothing inside a custom call: the attention kernels' FLOPs (Splash on a TPU,
      cuDNN or Triton on a GPU) are added from the layer graph.

    An estimate, as the roofline it feeds (``roofline_seconds``).

    Example:
        >>> from jaxckpt import nn, plan
        >>> w = plan.Workload(nn.TransformerConfig.preset("tiny", n_layers=4), batch=2, seq=64)
        >>> flops, moved = plan.xla_step_cost(1e9, 1e8, w, "full")
        >>> 1e9 < flops < 4e9 and moved / flops == 0.1  # XLA:CPU: blockwise attention, no kernel
        True
    """
    require_workload(workload, "xla_step_cost")
    spec = get_remat(remat)
    one_layer = workload.replace(config=workload.config.replace(n_layers=1))
    costs = ((w, choice(w, spec)) for w in (workload, one_layer))
    whole, once = (
        step_flops(w) + c.recompute_flops + c.compress_flops - _attention_kernel_flops(w, spec, target)
        for w, c in costs
    )
    scale = whole / max(once, 1)
    return flops * scale + _attention_kernel_flops(workload, spec, target), bytes_accessed * scale


def roofline_seconds(flops: float, bytes_accessed: float, device: DevicePreset) -> float:
    """The roofline time of a program: the longer of its FLOPs at the device's peak matmul
    rate and its memory traffic at the device's HBM bandwidth (``DevicePreset.flops``,
    ``hbm_bandwidth``). Fed with a compiler's ``cost_analysis()`` (``MemoryReport.flops``,
    ``bytes_accessed``, made whole by ``xla_step_cost``) it is an estimate of a step that
    never ran: a lower bound that ignores overlap, launch and collective time.

    Example:
        >>> from jaxckpt import plan
        >>> v5e = plan.DEVICES["tpu-v5e"]
        >>> plan.roofline_seconds(197e12, 0, v5e), plan.roofline_seconds(1e9, 819e9, v5e)
        (1.0, 1.0)
    """
    return max(flops / device.flops, bytes_accessed / device.hbm_bandwidth)


def step_flops(workload: Workload) -> int:
    """FLOPs of one device's share of a train step without remat: forward + backward (twice
    the forward; once for a frozen matmul, which has no weight gradient).

    Example:
        >>> from jaxckpt import nn, plan
        >>> w = plan.Workload(nn.TransformerConfig.preset("tiny"), batch=4, seq=64)
        >>> plan.step_flops(w) == 2 * plan.step_flops(w.replace(devices=2))
        True
    """
    require_workload(workload, "step_flops")
    config = workload.config
    graph = layer_graph(workload)
    head = 2 * workload.local_tokens * config.d_model * config.vocab_size
    # a frozen weight (LoRA's base, its head) gets its input gradient, not its own
    layer = 3 * graph.forward_flops() - graph.frozen_flops
    return workload.micro_batches * (config.n_layers * layer + (2 if config.lora else 3) * head)


def choice(workload: Workload, remat: "str | RematSpec", *, target: "str | Target | None" = None) -> Choice:
    """``remat`` with its prediction and per-step recompute FLOPs and offload bytes.

    ``target``: the compiler predicted for (``predict(target=)``; None: XLA:CPU).

    ``layers_per_checkpoint = k`` recomputes each layer twice except the last of a segment.
    Over ``workload.devices`` (FSDP) the bytes and costs are one device's. The transfer
    bytes are the offloaded residuals' round trips (``Prediction.host_activations`` out
    and back for each micro-batch: under ``offload_full`` two layer inputs a layer; a
    compressed one at its compressed size) and, with optimizer state (or master weights)
    in host memory, that state read and written back once a step (``Choice.seconds``
    prices them at the device's host link). Compressed residuals (``RematSpec.compress``)
    add their (de)quantization per micro-batch (``Choice.compress_flops``, ``compress_bytes``).

    Example:
        >>> from jaxckpt import nn, plan, remat
        >>> w = plan.Workload(nn.TransformerConfig.preset("tiny"), batch=2, seq=64)
        >>> plan.choice(w, "none").recompute_flops, plan.choice(w, "full").recompute_flops > 0
        (0, True)
        >>> off = plan.choice(w, "offload_full")  # full's recompute, the layer inputs over the link
        >>> off.recompute_flops == plan.choice(w, "full").recompute_flops
        True
        >>> off.transfer_bytes == 2 * off.predicted.host  # out and back once a step
        True
        >>> small = plan.choice(w, remat.compressed("offload_full", "int8"))  # fp32: a quarter, and scales
        >>> small.transfer_bytes < off.transfer_bytes / 3 and small.compress_flops > 0
        True
    """
    spec = get_remat(remat)
    pred = predict(workload, spec, target=target)
    graph = layer_graph(workload, target=target)
    # host-resident state comes in and goes back once a step
    streamed = 2 * (pred.host - pred.host_activations)
    if not spec.enabled:
        return Choice(spec, pred, 0, streamed)
    n_layers, micro = workload.config.n_layers, workload.micro_batches
    tags = saved_tags(spec)
    per_layer = graph.recompute_flops(tags)
    k = min(spec.layers_per_checkpoint, n_layers)
    extra = graph.forward_flops() * (k - 1) / k if k > 1 else 0  # the segment's re-forward
    flops, moved = compress_cost(graph, spec, workload.config)
    return Choice(
        spec,
        pred,
        int(micro * n_layers * (per_layer + extra)),
        2 * micro * pred.host_activations + streamed,  # offloaded residuals: out and back
        micro * flops,
        micro * moved,
    )
