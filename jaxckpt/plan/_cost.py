"""What a remat spec costs per train step: its predicted bytes, recompute FLOPs and offload traffic."""

import dataclasses

from jaxckpt.nn import TransformerConfig
from jaxckpt.plan._analytic import Prediction, predict, saved_tags
from jaxckpt.plan._devices import DevicePreset
from jaxckpt.plan._layer_graph import layer_graph
from jaxckpt.plan._sharded import local_batch
from jaxckpt.remat import PRESETS, RematSpec
from jaxckpt.remat import get as get_remat


@dataclasses.dataclass(frozen=True)
class Choice:
    """One remat spec with its predicted bytes and its costs per train step."""

    spec: RematSpec
    predicted: Prediction
    recompute_flops: int
    transfer_bytes: int

    def seconds(self, device: DevicePreset) -> float:
        """Recompute time at the device's matmul rate plus offload traffic at its host bandwidth."""
        return self.recompute_flops / device.flops + self.transfer_bytes / device.host_bandwidth


def spec_dict(spec: RematSpec) -> dict:
    """A ``RematSpec`` as JSON-ready lists."""
    return {
        "save": sorted(spec.save),
        "offload": sorted(spec.offload),
        "layers_per_checkpoint": spec.layers_per_checkpoint,
        "save_dots": spec.save_dots,
        "enabled": spec.enabled,
    }


def spec_name(spec: RematSpec) -> str:
    """The preset name of ``spec``, or ``"solved"``."""
    return next((name for name, preset in PRESETS.items() if preset == spec), "solved")


def step_flops(config: TransformerConfig, batch: int, seq: int, micro_batches: int = 1) -> int:
    """FLOPs of one train step without remat: forward + backward (twice the forward)."""
    graph = layer_graph(config, batch, seq)
    head = 2 * batch * seq * config.d_model * config.vocab_size
    return 3 * micro_batches * (config.n_layers * graph.forward_flops() + head)


def choice(
    config: TransformerConfig,
    batch: int,
    seq: int,
    remat: "str | RematSpec",
    *,
    optimizer: str = "adamw",
    micro_batches: int = 1,
    devices: int = 1,
) -> Choice:
    """``remat`` with its prediction and per-step recompute FLOPs and offload bytes.

    ``layers_per_checkpoint = k`` recomputes each layer twice except the last of a segment.
    Over ``devices`` (FSDP) the bytes and costs are one device's.
    """
    spec = get_remat(remat)
    pred = predict(
        config, batch, seq, spec, optimizer=optimizer, micro_batches=micro_batches, devices=devices
    )
    batch = local_batch(batch, devices)
    graph = layer_graph(config, batch, seq)
    if not spec.enabled:
        return Choice(spec, pred, 0, 0)
    tags = saved_tags(spec)
    per_layer = graph.recompute_flops(tags)
    k = min(spec.layers_per_checkpoint, config.n_layers)
    extra = graph.forward_flops() * (k - 1) / k if k > 1 else 0  # the segment's re-forward
    offloaded = graph.stored_bytes(tags) - graph.stored_bytes(tags - spec.offload)
    return Choice(
        spec,
        pred,
        int(micro_batches * config.n_layers * (per_layer + extra)),
        2 * micro_batches * config.n_layers * offloaded,
    )
