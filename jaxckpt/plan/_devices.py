"""Device presets (memory, matmul rate, host link, 16-bit float type)."""

import dataclasses
from types import MappingProxyType

from jaxckpt._sizes import GB, GiB, host_memory
from jaxckpt.nn import TransformerConfig


@dataclasses.dataclass(frozen=True)
class DevicePreset:
    """One accelerator as the planner sees it.

    Attributes:
        name: the preset's key in ``DEVICES``.
        memory: bytes of device memory (the vendor's figure).
        flops: dense 16-bit matmul FLOP/s (converts recompute FLOPs to seconds).
        host_bandwidth: bytes/s of the host link one way (prices an offload).
        hbm_bandwidth: bytes/s of device memory (the roofline time of ``plan.roofline``).
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
    hbm_bandwidth: float = 1e12
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


# HBM bandwidths: NVIDIA's A100 (1,555 / 2,039 GB/s) and H100 SXM (3.35 TB/s) / H200 (4.8 TB/s)
# datasheets; Huawei's Ascend 910 (1.2 TB/s) and 910B (1.6 TB/s) as published for the chips.
#
# TPUs, per chip, from Google Cloud's TPU documentation (cloud.google.com/tpu/docs/v4, /v5e,
# /v5p, /v6e, "system architecture"): peak bf16 compute 275 (v4), 197 (v5e), 459 (v5p) and
# 918 (v6e) TFLOP/s; HBM bandwidth 1,200, 819, 2,765 and 1,640 GB/s; HBM 32, 16, 95 and 32 GiB.
# The memory here is what XLA:TPU lets one program use, as its out-of-memory error states it
# (compiled without a TPU, libtpu 0.0.42.1): 15.75 GiB of v5e's 16, 95.74 of v5p's 95 GiB (sic:
# Google's "95 GiB" is rounded), 31.25 of v6e's 32. A v4 device is one TensorCore (XLA:TPU's
# compile-only v4 topology has two per chip, not one megacore), so half the chip: 15.25 GiB of
# 16, 137.5 TFLOP/s, 600 GB/s. Google publishes no host link figure: a TPU host's PCIe Gen4 x16
# (32 GB/s one way, 16 on v4's Gen3) prices an offload, an estimate.
DEVICES: MappingProxyType[str, DevicePreset] = MappingProxyType(
    {
        "ascend-910": DevicePreset("ascend-910", 32 * GB, 256e12, 25e9, 1.2e12, half="float16"),
        "ascend-910b": DevicePreset("ascend-910b", 64 * GB, 313e12, 25e9, 1.6e12),
        "a100-40g": DevicePreset("a100-40g", 40 * GB, 312e12, 25e9, 1.555e12),
        "a100-80g": DevicePreset("a100-80g", 80 * GB, 312e12, 25e9, 2.039e12),
        "h100-80g": DevicePreset("h100-80g", 80 * GB, 989e12, 50e9, 3.35e12),
        "h200-141g": DevicePreset("h200-141g", 141 * GB, 989e12, 50e9, 4.8e12),
        "tpu-v5e": DevicePreset("tpu-v5e", int(15.75 * GiB), 197e12, 32e9, 819e9),
        "tpu-v5p": DevicePreset("tpu-v5p", int(95.74 * GiB), 459e12, 32e9, 2.765e12),
        "tpu-v6e": DevicePreset("tpu-v6e", int(31.25 * GiB), 918e12, 32e9, 1.64e12),
        "tpu-v4": DevicePreset("tpu-v4", int(15.25 * GiB), 137.5e12, 16e9, 600e9),
        "cpu": DevicePreset("cpu", host_memory(), 1e11, 10e9, 20e9),
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
