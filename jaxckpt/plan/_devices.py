"""Device presets (memory, matmul rate, host link, 16-bit float type)."""

import dataclasses
from types import MappingProxyType

from jaxckpt._sizes import GB, host_memory
from jaxckpt.nn import TransformerConfig


@dataclasses.dataclass(frozen=True)
class DevicePreset:
    """One accelerator as the planner sees it.

    Attributes:
        name: the preset's key in ``DEVICES``.
        memory: bytes of device memory (the vendor's figure).
        flops: dense 16-bit matmul FLOP/s (converts recompute FLOPs to seconds).
        host_bandwidth: bytes/s of the host link one way (prices an offload).
        half: the 16-bit float type it computes in: ``"float16"`` for the original Ascend
            910, which has no bfloat16 (``in_half``).

    Example:
        >>> from jaxckpt import plan
        >>> fast_link = plan.DevicePreset("fast-link", memory=2**40, flops=1e9, host_bandwidth=1e12)
        >>> fast_link.memory // 2**30
        1024
    """

    name: str
    memory: int
    flops: float
    host_bandwidth: float
    half: str = "bfloat16"

    def in_half(self, config: TransformerConfig) -> TransformerConfig:
        """``config`` with every bfloat16 dtype (compute, storage, LoRA adapters) in this
        device's 16-bit type: the model as it trains here (``jaxckpt train --dtype float16``
        on an Ascend 910). Unchanged on a device with bfloat16.

        Example:
            >>> from jaxckpt import nn, plan
            >>> cfg = plan.DEVICES["ascend-910"].in_half(nn.TransformerConfig.preset("llama2-7b"))
            >>> cfg.dtype, cfg.param_dtype
            ('float16', 'float32')
        """
        if self.half == "bfloat16":
            return config
        swap = lambda dtype: self.half if dtype == "bfloat16" else dtype
        changes = {"dtype": swap(config.dtype), "param_dtype": swap(config.param_dtype)}
        if config.lora is not None and config.lora.dtype == "bfloat16":
            changes["lora"] = dataclasses.replace(config.lora, dtype=self.half)
        return config.replace(**changes)


DEVICES: MappingProxyType[str, DevicePreset] = MappingProxyType(
    {
        "ascend-910": DevicePreset("ascend-910", 32 * GB, 256e12, 25e9, half="float16"),
        "ascend-910b": DevicePreset("ascend-910b", 64 * GB, 313e12, 25e9),
        "a100-40g": DevicePreset("a100-40g", 40 * GB, 312e12, 25e9),
        "a100-80g": DevicePreset("a100-80g", 80 * GB, 312e12, 25e9),
        "h100-80g": DevicePreset("h100-80g", 80 * GB, 989e12, 50e9),
        "h200-141g": DevicePreset("h200-141g", 141 * GB, 989e12, 50e9),
        "cpu": DevicePreset("cpu", host_memory(), 1e11, 10e9),
    }
)
"""Device name -> ``DevicePreset`` (``cpu`` is this machine's RAM)."""


def device_preset(name: str) -> DevicePreset:
    """The preset called ``name``; the error lists the valid names.

    Example:
        >>> from jaxckpt import plan
        >>> plan.device_preset("ascend-910").memory
        32000000000
    """
    if name not in DEVICES:
        raise ValueError(f"device={name!r} is unknown; valid devices: {', '.join(DEVICES)}")
    return DEVICES[name]
