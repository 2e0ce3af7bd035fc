"""What a remat spec costs per train step: its predicted bytes, recompute FLOPs and offload traffic."""

import dataclasses

from jaxckpt.plan._analytic import Prediction, predict
from jaxckpt.plan._devices import DevicePreset
from jaxckpt.plan._layer_graph import layer_graph
from jaxckpt.plan._specs import saved_tags
from jaxckpt.plan._targets import Target
from jaxckpt.plan._workload import Workload, require_workload
from jaxckpt.remat import RematSpec
from jaxckpt.remat import get as get_remat


@dataclasses.dataclass(frozen=True)
class Choice:
    """One remat spec with its predicted bytes and its costs per train step (one device's).

    Example:
        >>> from jaxckpt import nn, plan
        >>> c = plan.choice(plan.Workload(nn.TransformerConfig.preset("tiny"), batch=2, seq=64), "full")
        >>> c.spec.enabled, c.seconds(plan.DEVICES["a100-80g"]) > 0
        (True, True)
    """

    spec: RematSpec
    predicted: Prediction
    recompute_flops: int
    transfer_bytes: int

    def seconds(self, device: DevicePreset) -> float:
        """Recompute time at the device's matmul rate plus offload traffic at its host bandwidth."""
        return self.recompute_flops / device.flops + self.transfer_bytes / device.host_bandwidth

    def step_seconds(self, device: DevicePreset, step_flops: int) -> float:
        """An estimate of the whole step's time: its FLOPs (``step_flops`` plus the
        recompute) at the device's peak matmul rate, plus the offload traffic at its host
        link. Compute-bound and at peak: a floor to compare specs by, not a forecast.

        Example:
            >>> from jaxckpt import nn, plan
            >>> w = plan.Workload(nn.TransformerConfig.preset("tiny"), batch=2, seq=64)
            >>> v5e, step = plan.DEVICES["tpu-v5e"], plan.step_flops(w)
            >>> full, none = plan.choice(w, "full"), plan.choice(w, "none")
            >>> full.step_seconds(v5e, step) > none.step_seconds(v5e, step)
            True
        """
        flops = step_flops + self.recompute_flops
        return flops / device.flops + self.transfer_bytes / device.host_bandwidth


def loop_counted_cost(
    flops: float, bytes_accessed: float, workload: Workload, remat: "str | RematSpec"
) -> tuple[float, float]:
    """A compiled step's ``cost_analysis()`` figures with its layers counted ``n_layers``
    times: XLA's cost analysis counts the body of a loop once, whatever its trip count, and
    jaxckpt's layers are one ``lax.scan`` (measured on XLA:TPU: a scan of 4 matmuls costs
    the FLOPs of one). Both figures are scaled by the step's analytic FLOPs over those of
    the same step with its layer loop counted once (one layer's forward, backward and
    recompute, plus the head): an estimate, as the roofline it feeds.

    Example:
        >>> from jaxckpt import nn, plan
        >>> w = plan.Workload(nn.TransformerConfig.preset("tiny", n_layers=4), batch=2, seq=64)
        >>> flops, moved = loop_counted_cost(1e9, 1e8, w, "full")
        >>> 1e9 < flops < 4e9 and moved / flops == 0.1
        True
    """
    require_workload(workload, "loop_counted_cost")
    one_layer = workload.replace(config=workload.config.replace(n_layers=1))
    whole, once = (step_flops(w) + choice(w, remat).recompute_flops for w in (workload, one_layer))
    return flops * whole / once, bytes_accessed * whole / once


def roofline_seconds(flops: float, bytes_accessed: float, device: DevicePreset) -> float:
    """The roofline time of a program: the longer of its FLOPs at the device's peak matmul
    rate and its memory traffic at the device's HBM bandwidth (``DevicePreset.flops``,
    ``hbm_bandwidth``). Fed with a compiler's ``cost_analysis()`` (``MemoryReport.flops``,
    ``bytes_accessed``, its layer loop counted as many times as it runs:
    ``loop_counted_cost``) it is an estimate of a step that never ran: a lower bound that
    ignores overlap, launch and collective time.

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
    bytes are the offloaded residuals' round trips and, with optimizer state (or master
    weights) in host memory, that state read and written back once a step (``Choice.seconds``
    prices them at the device's host link).

    Example:
        >>> from jaxckpt import nn, plan
        >>> w = plan.Workload(nn.TransformerConfig.preset("tiny"), batch=2, seq=64)
        >>> plan.choice(w, "none").recompute_flops, plan.choice(w, "full").recompute_flops > 0
        (0, True)
    """
    spec = get_remat(remat)
    pred = predict(workload, spec, target=target)
    graph = layer_graph(workload, target=target)
    streamed = 2 * pred.host  # host-resident state comes in and goes back once a step
    if not spec.enabled:
        return Choice(spec, pred, 0, streamed)
    n_layers, micro = workload.config.n_layers, workload.micro_batches
    tags = saved_tags(spec)
    per_layer = graph.recompute_flops(tags)
    k = min(spec.layers_per_checkpoint, n_layers)
    extra = graph.forward_flops() * (k - 1) / k if k > 1 else 0  # the segment's re-forward
    offloaded = graph.stored_bytes(tags) - graph.stored_bytes(tags - spec.offload)
    return Choice(
        spec,
        pred,
        int(micro * n_layers * (per_layer + extra)),
        2 * micro * n_layers * offloaded + streamed,
    )
