"""``merge_lora``: LoRA adapters folded into their base kernels, for a full export.

An adapted projection computes ``x @ kernel + scale * (x @ a @ b)``, so the plain
projection with ``kernel + scale * a @ b`` computes the same. The sum is taken in fp32 and
cast once, to the dtype the export asks for (``dtype``; by default the kernel's own: a bf16
base is exported bf16). A 16-bit merged kernel cannot hold all of a small update: a bf16
kernel has 8 bits of mantissa, and an update below half of its spacing is lost whole.
``delta_rounding`` measures that loss, so an export can say what it costs.
"""

import functools
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from flax import nnx

from jaxckpt.nn import TransformerConfig

LORA = "lora"
"""The name of an adapted projection's adapter child (``nn.LoraLinear.lora``)."""


def lora_paths(params: Mapping, prefix: str = "") -> list[str]:
    """The dotted paths of the projections in ``params`` (a pure dict) that hold an adapter.

    Example:
        >>> lora_paths({"attn": {"q": {"kernel": 0, "lora": {"lora_a": 0, "lora_b": 0}}, "k": {"kernel": 0}}})
        ['attn.q']
    """
    found = []
    for name, node in params.items():
        if not isinstance(node, Mapping):
            continue
        path = f"{prefix}{name}"
        found += [path] if LORA in node else lora_paths(node, path + ".")
    return found


def merge_lora(
    params: "Mapping | nnx.State", config: TransformerConfig, dtype: "str | np.dtype | None" = None
) -> tuple[dict, TransformerConfig]:
    """``(params, config)`` of the plain model that computes what the LoRA model does.

    Each adapted kernel becomes ``kernel + config.lora.scale * a @ b``, computed in fp32 and
    cast once, to ``dtype`` (default: the kernel's own); the adapters are dropped, and the
    config loses ``lora``. Pass the dtype the export writes: a bf16 kernel merged for a
    float32 file must not be rounded through bf16 first (``delta_rounding`` measures what a
    16-bit merge loses).
    Every other parameter is passed through as it is (not copied). A config without
    ``lora`` is returned as it is, with its parameters.

    Args:
        params: the model's ``nnx.Param`` state or its pure dict (a stacked kernel
            ``[L, d_in, d_out]`` with ``lora.lora_a [L, d_in, r]``, ``lora.lora_b [L, r, d_out]``).
        config: its config.
        dtype: the dtype of the merged kernels (``"float32"``, ``"bfloat16"``...); None
            keeps each kernel's own. Other parameters are not cast.

    Raises:
        ValueError: for adapters in ``params`` when ``config.lora`` is None (named), an
            adapted projection without its ``kernel``, or a quantized base
            (``config.quantize_base``): merging a dequantized nf4/int8 base into a full-precision
            export is not done here; export the adapter alone (``write_peft_adapter``) and
            apply it to the original base.

    Example:
        >>> from jaxckpt import nn
        >>> cfg = nn.TransformerConfig.preset("tiny", n_layers=1, d_model=16, n_heads=2, ffn_dim=24, lora=3)
        >>> model = nn.Transformer(cfg, rngs=nnx.Rngs(0))
        >>> merged, plain = merge_lora(nnx.state(model, nnx.Param), cfg)
        >>> plain.lora, "lora" in merged["blocks"]["attn"]["q_proj"]
        (None, False)
        >>> kernel = merged["blocks"]["attn"]["q_proj"]["kernel"]  # b = 0 at init: unchanged
        >>> bool(np.array_equal(kernel, model.blocks.attn.q_proj.kernel[...]))
        True
    """
    if isinstance(params, nnx.State):
        params = nnx.to_pure_dict(params)
    found = lora_paths(params)
    if config.lora is None:
        if found:
            raise ValueError(
                f"params hold LoRA adapters at {', '.join(found)} but config.lora is None; "
                "pass the config the model was built with"
            )
        return dict(params), config
    if config.quantize_base is not None:
        raise ValueError(
            f"config.quantize_base={config.quantize_base!r}: a quantized base is not merged into a full "
            "export; write the adapter alone (write_peft_adapter, or jaxckpt convert --to torch "
            "--adapter-only) and apply it to the original base"
        )
    merge = functools.partial(_merged_kernel, scale=config.lora.scale, dtype=dtype)
    return _merged(params, merge, ""), config.replace(lora=None, quantize_base=None)


def _merged(node: Mapping, merge: Callable[[Mapping, str], Any], path: str) -> dict:
    """``node`` with every adapted projection under it replaced by ``merge(projection, path)``."""
    if LORA not in node:
        return {k: _merged(v, merge, f"{path}{k}.") if isinstance(v, Mapping) else v for k, v in node.items()}
    if "kernel" not in node:
        raise ValueError(f"{path}{LORA}: an adapter without its base kernel ({path}kernel is missing)")
    return {k: merge(node, path) if k == "kernel" else v for k, v in node.items() if k != LORA}


def _kernel_and_delta(node: Mapping, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """An adapted projection's base kernel (as stored) and its update ``scale * a @ b`` in fp32."""
    a, b = (np.asarray(node[LORA][name], np.float32) for name in ("lora_a", "lora_b"))
    return np.asarray(node["kernel"]), np.float32(scale) * np.matmul(a, b)


def _merged_kernel(node: Mapping, path: str, scale: float, dtype) -> np.ndarray:
    kernel, delta = _kernel_and_delta(node, scale)
    return (kernel.astype(np.float32) + delta).astype(dtype or kernel.dtype)


def delta_rounding(
    params: "Mapping | nnx.State", config: TransformerConfig, dtype: "str | np.dtype | None" = None
) -> dict:
    """What a merge into ``dtype`` (default: each kernel's own) loses of the adapters' update.

    For each adapted kernel ``W`` with update ``D = scale * a @ b``, the update the merged
    kernel keeps is ``cast(W + D) - cast(W)`` (the base's own rounding set apart); its
    relative error is ``|kept - D| / |D|`` (Frobenius norms). 0 means the update is kept
    whole; 1 means it is lost (a bf16 kernel whose update is below half its spacing).

    Returns:
        ``{"dtype", "relative_delta_error", "worst", "worst_relative_delta_error"}``: the
        error over all adapted kernels together, and the kernel with the largest one (its
        dotted path). ``dtype`` is the merged kernels' dtype, or ``"kept"`` for their own.
        Kernels whose update is zero (``b = 0`` at init) are left out; with none left the
        errors are 0.0 and ``worst`` is None.

    Example:
        >>> from jaxckpt import nn
        >>> cfg = nn.TransformerConfig.preset("tiny", n_layers=1, d_model=16, n_heads=2, ffn_dim=24, lora=3)
        >>> kernel = np.full((1, 16, 24), 1.0, np.float32)
        >>> up = {"kernel": kernel, "lora": {"lora_a": np.full((1, 16, 3), 1e-2, np.float32),
        ...                                  "lora_b": np.full((1, 3, 24), 1e-2, np.float32)}}
        >>> params = {"blocks": {"mlp": {"up": up}}}
        >>> delta_rounding(params, cfg, "float32")["relative_delta_error"] < 1e-3  # fp32's own rounding
        True
        >>> delta_rounding(params, cfg, "bfloat16")["relative_delta_error"]  # 3e-4 below bf16's 2**-8 at 1.0
        1.0
    """
    if isinstance(params, nnx.State):
        params = nnx.to_pure_dict(params)
    scale = config.lora.scale if config.lora is not None else 1.0
    errors: dict[str, tuple[float, float]] = {}

    def measure(node: Mapping, path: str) -> None:
        kernel, delta = _kernel_and_delta(node, scale)
        out = dtype or kernel.dtype
        base = kernel.astype(out).astype(np.float32)
        kept = (kernel.astype(np.float32) + delta).astype(out).astype(np.float32) - base
        errors[path.rstrip(".")] = (float(np.sum((kept - delta) ** 2)), float(np.sum(delta**2)))

    _merged(params, measure, "")
    nonzero = {path: (err, norm) for path, (err, norm) in errors.items() if norm > 0}
    total = sum(norm for _, norm in nonzero.values())
    relative = {path: float(np.sqrt(err / norm)) for path, (err, norm) in nonzero.items()}
    worst = max(relative, key=relative.get, default=None)
    return {
        "dtype": str(np.dtype(dtype)) if dtype is not None else "kept",
        "relative_delta_error": float(np.sqrt(sum(e for e, _ in nonzero.values()) / total)) if total else 0.0,
        "worst": worst,
        "worst_relative_delta_error": relative.get(worst, 0.0),
    }


SIXTEEN_BIT = ("bfloat16", "float16")


def sixteen_bit_rounding(params: Mapping, config: TransformerConfig, dtype: "str | None") -> dict | None:
    """``delta_rounding`` when a merged kernel is written in 16 bits (``dtype`` bf16/fp16, or a
    16-bit kernel with ``dtype`` None: ``convert --to torch``'s ``lora_rounding``); None when
    every merged kernel is written in 32 bits.

    Example:
        >>> from jaxckpt import nn
        >>> cfg = nn.TransformerConfig.preset("tiny", n_layers=1, d_model=16, n_heads=2, ffn_dim=24, lora=3)
        >>> ones = lambda *shape: np.ones(shape, np.float32)
        >>> up = {"kernel": ones(1, 16, 24), "lora": {"lora_a": ones(1, 16, 3), "lora_b": ones(1, 3, 24)}}
        >>> params = {"blocks": {"mlp": {"up": up}}}
        >>> sixteen_bit_rounding(params, cfg, None) is None  # fp32 kernels, written as they are
        True
        >>> sixteen_bit_rounding(params, cfg, "bfloat16")["dtype"]
        'bfloat16'
    """
    kernels = []
    _merged(params, lambda node, path: kernels.append(np.asarray(node["kernel"]).dtype), "")
    if not any(str(dtype or kernel) in SIXTEEN_BIT for kernel in kernels):
        return None
    return delta_rounding(params, config, dtype)
