"""``merge_lora``: LoRA adapters folded into their base kernels, for a full export.

An adapted projection computes ``x @ kernel + scale * (x @ a @ b)``, so the plain
projection with ``kernel + scale * a @ b`` computes the same. The sum is taken in fp32 and
cast back to the kernel's own dtype (a bf16 base is exported bf16), so that the adapter's
small update is not rounded away before it reaches the base.
"""

from collections.abc import Mapping

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


def merge_lora(params: "Mapping | nnx.State", config: TransformerConfig) -> tuple[dict, TransformerConfig]:
    """``(params, config)`` of the plain model that computes what the LoRA model does.

    Each adapted kernel becomes ``kernel + config.lora.scale * a @ b``, computed in fp32 and
    cast to the kernel's dtype; the adapters are dropped, and the config loses ``lora``.
    Every other parameter is passed through as it is (not copied). A config without
    ``lora`` is returned as it is, with its parameters.

    Args:
        params: the model's ``nnx.Param`` state or its pure dict (a stacked kernel
            ``[L, d_in, d_out]`` with ``lora.lora_a [L, d_in, r]``, ``lora.lora_b [L, r, d_out]``).
        config: its config.

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
    return _merged(params, config.lora.scale, ""), config.replace(lora=None, quantize_base=None)


def _merged(node: Mapping, scale: float, path: str) -> dict:
    """``node`` with every adapted projection under it merged."""
    if LORA not in node:
        return {k: _merged(v, scale, f"{path}{k}.") if isinstance(v, Mapping) else v for k, v in node.items()}
    if "kernel" not in node:
        raise ValueError(f"{path}{LORA}: an adapter without its base kernel ({path}kernel is missing)")
    adapter = node[LORA]
    kernel = np.asarray(node["kernel"])
    a, b = (np.asarray(adapter[name], np.float32) for name in ("lora_a", "lora_b"))
    merged = (kernel.astype(np.float32) + np.float32(scale) * np.matmul(a, b)).astype(kernel.dtype)
    return {k: merged if k == "kernel" else v for k, v in node.items() if k != LORA}
