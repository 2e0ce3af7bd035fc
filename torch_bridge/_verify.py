"""``verify=True``: the converted model's logits against transformers' own, on a fixed input.

The field classes of ``hf._fields`` decide, by name, which config fields can be ignored;
this is the check by numbers. transformers loads the same directory
(``AutoModelForCausalLM.from_pretrained``, eager attention, the jaxckpt model's dtype),
both models run on ``VERIFY_SHAPE`` fixed token ids, and the logits are compared in fp32.

Tolerances (``TOLERANCES``) are relative to the logits' scale: the check passes when
``max |ours - theirs| <= TOLERANCES[dtype] * max(1, max |theirs|)``. The two
implementations round differently (other op orders, fused kernels), by a few units in the
last place of the dtype, growing slowly with depth; a wrong conversion (a transposed or
swapped tensor, a missing scale or norm, the wrong RoPE) moves the logits by a sizeable
fraction of their scale. fp32: 1e-4 (tiny random models agree to about 1e-6, 1B models to
about 1e-5 of the scale); bf16: 5e-2 (its unit roundoff is 2**-8 = 3.9e-3); fp16: 1e-2
(2**-11 = 4.9e-4, with less range).
"""

import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from jaxckpt.nn import TransformerConfig
from torch_bridge.interop import torch

TOLERANCES = {"float32": 1e-4, "bfloat16": 5e-2, "float16": 1e-2}
"""Per dtype, the largest logit difference allowed, as a fraction of ``max(1, max |logit|)``."""

VERIFY_SHAPE = (2, 7)
"""``[B, T]`` of the token ids both models run on."""

TRANSFORMERS_HINT = 'verify=True needs transformers: pip install -e ".[torch]"'


def verify_tokens(config: TransformerConfig) -> np.ndarray:
    """The fixed token ids ``[2, 7]`` (fewer positions if ``max_len`` is shorter) below the vocab.

    Example:
        >>> verify_tokens(TransformerConfig(vocab_size=11, max_len=5)).shape
        (2, 5)
    """
    batch, length = VERIFY_SHAPE
    return np.random.default_rng(0).integers(0, config.vocab_size, (batch, min(length, config.max_len)))


def tolerance(config: TransformerConfig, reference: np.ndarray) -> float:
    """The largest logit difference ``verify`` allows for ``config``'s dtypes and these logits.

    Example:
        >>> tolerance(TransformerConfig(), np.array([[0.5, -20.0]]))
        0.002
    """
    base = max(TOLERANCES[config.dtype], TOLERANCES[config.param_dtype])
    return base * max(1.0, float(np.max(np.abs(reference))))


def transformers_logits(path: "str | os.PathLike", dtype: str, ids: np.ndarray) -> np.ndarray:
    """The fp32 logits of the transformers model in the directory ``path`` (loaded in ``dtype``).

    Raises:
        ImportError: when torch or transformers is missing, with the install command.
    """
    torch_module = torch()
    try:
        import transformers
    except ImportError as err:
        raise ImportError(f"{TRANSFORMERS_HINT} ({err})") from err
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=getattr(torch_module, dtype), attn_implementation="eager"
    ).eval()
    with torch_module.no_grad():
        out = model(input_ids=torch_module.as_tensor(ids)).logits
    return out.float().numpy()


def verify(path: "str | os.PathLike", model, config: TransformerConfig) -> tuple[float, float]:
    """Compares ``model`` (converted from the Hugging Face directory ``path``) with transformers.

    Returns:
        ``(max_abs_diff, tolerance)``.

    Raises:
        ValueError: naming ``path``, the difference and the tolerance when the logits
            disagree; or when ``path`` is not a directory transformers can load.

    Example:
        >>> import tempfile, transformers
        >>> import torch_bridge
        >>> d = tempfile.mkdtemp()
        >>> cfg = transformers.LlamaConfig(vocab_size=11, hidden_size=6, intermediate_size=10,
        ...     num_hidden_layers=1, num_attention_heads=3, num_key_value_heads=1)
        >>> transformers.LlamaForCausalLM(cfg).save_pretrained(d)
        >>> converted = torch_bridge.read_checkpoint(d)
        >>> diff, tol = verify(d, converted.model(), converted.config)
        >>> diff <= tol
        True
    """
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(
            f"{path}: verify=True compares with transformers, which loads a Hugging Face directory "
            "(config.json and weights); this is not one"
        )
    ids = verify_tokens(config)
    reference = transformers_logits(path, config.param_dtype, ids)
    ours = np.asarray(model(jnp.asarray(ids, dtype=jnp.int32)).astype(jnp.float32))
    if ours.shape != reference.shape:
        raise ValueError(
            f"{path}: verify=True: the converted model's logits have shape {ours.shape}, "
            f"transformers' {reference.shape}"
        )
    diff = float(np.max(np.abs(ours - reference)))
    limit = tolerance(config, reference)
    if not diff <= limit:  # NaN fails too
        raise ValueError(
            f"{path}: verify=True failed: the converted model's logits differ from transformers' by "
            f"max_abs_diff={diff:.3g}, above the {config.param_dtype} tolerance {limit:.3g} "
            f"(TOLERANCES[{config.param_dtype!r}]={TOLERANCES[config.param_dtype]:g} x the logits' scale); "
            "the conversion does not reproduce this model"
        )
    return diff, limit
