"""What one layer's pieces cost, by the config's choices: which attention implementation
runs it (per backend) and whether it holds the scores, the FLOPs of norms, soft caps and
attention, and the residuals each norm and activation keeps (``layer_graph`` reads them).
"""

import dataclasses
import functools
from types import MappingProxyType

from jaxckpt.attention import PALLAS_MAX_HEAD_DIM, implementations
from jaxckpt.nn import Activation, LayerKind, Norm, TransformerConfig
from jaxckpt.plan._targets import Target, compile_target


def materializes_scores(attention: str | None) -> bool:
    """Whether the ``flash_attention`` implementation ``attention`` builds the T x S scores
    (its registration's ``materializes_scores``; None, the automatic choice, is blockwise,
    Pallas or cuDNN, which do not).

    Raises:
        ValueError: for a name no implementation is registered under.

    Example:
        >>> materializes_scores("xla"), materializes_scores("blockwise"), materializes_scores(None)
        (True, False, False)
    """
    if attention is None:
        return False
    registered = implementations()
    if attention not in registered:
        raise ValueError(f"attention={attention!r} is not registered; known: {sorted(registered)}")
    return registered[attention].materializes_scores


def attention_implementation(
    config: TransformerConfig, target: "str | Target | None" = None, attention: "str | None" = None
) -> str:
    """The ``flash_attention`` implementation the layers of ``config`` run when compiled for
    ``target`` (None: XLA:CPU): ``attention`` (the run's, ``Workload.attention``) when set;
    else, as ``implementation=None`` resolves it: on a GPU, cuDNN where it takes the call (a
    16-bit compute dtype, a head dim of at most 128 and a multiple of 8, no logit soft cap, a
    causal or no window), else the Pallas kernel (a head dim up to 256), else blockwise; on
    a TPU the Splash kernel (it takes every feature a model uses: causal, windows, soft
    caps, segment ids); on XLA:CPU the blockwise kernel.

    Example:
        >>> from jaxckpt import nn
        >>> cfg = nn.TransformerConfig.preset("tiny", dtype="bfloat16")
        >>> attention_implementation(cfg), attention_implementation(cfg, "h100-80g")
        ('blockwise', 'cudnn')
        >>> attention_implementation(cfg.replace(dtype="float32"), "h100-80g")
        'pallas'
        >>> attention_implementation(cfg, "tpu-v5e")
        'splash'
    """
    if attention is not None:
        return attention
    if target is None:
        return "blockwise"
    if compile_target(target).platform == "tpu":
        return "splash"
    h, windowed = config.head_dim, config.sliding_window is not None and not config.causal
    fits = config.compute_dtype.itemsize == 2 and h <= 128 and h % 8 == 0 and config.attention_softcap is None
    if fits and not (windowed and any(k.sliding for k in config.layer_kinds)):
        return "cudnn"
    return "pallas" if h <= PALLAS_MAX_HEAD_DIM else "blockwise"


LANES = 128
"""XLA:TPU's lane width: an array's minor dimension is tiled by 128 (``T(8,128)``, bf16
``T(8,128)(2,1)``), so a minor dimension under it is padded to it (``lane_padded``)."""


def lane_padded(width: int) -> int:
    """``width`` rounded up to whole 128-lane tiles: what XLA:TPU allocates for a minor
    dimension of ``width`` (read off its buffer assignment: ``tiny``'s saved queries
    ``bf16[4,8,1024,4,32]{4,2,3,1,0:T(8,128)(2,1)}`` take 32 MiB for 8 MiB of values).

    Example:
        >>> lane_padded(32), lane_padded(128), lane_padded(200)
        (128, 128, 256)
    """
    return -(-width // LANES) * LANES


NORM_FLOPS = 5
"""Forward FLOPs per normalised element (square, mean, rsqrt, scale, product)."""

SOFTCAP_FLOPS = 3
"""Forward FLOPs per capped logit: ``cap * tanh(s / cap)``."""

MLP_TARGETS = ("gate", "up", "down")
"""The LoRA targets in the MLP (``nn.LORA_TARGETS``)."""


def mlp_rows(config: TransformerConfig, batch: int, seq: int) -> int:
    """The token rows whose MLP intermediates a layer's backward pass holds at once, for
    ``batch`` sequences of ``seq`` tokens: all ``batch * seq``, or under tiling
    (``config.mlp_chunk`` below ``seq``) one chunk's ``batch * mlp_chunk``, each chunk
    recomputed in turn (``nn.MLP``).

    Example:
        >>> from jaxckpt import nn
        >>> cfg = nn.TransformerConfig.preset("tiny")
        >>> mlp_rows(cfg, 2, 4096), mlp_rows(cfg.replace(mlp_chunk=512), 2, 4096)
        (8192, 1024)
        >>> mlp_rows(cfg.replace(mlp_chunk=512), 2, 300)  # one chunk: untiled
        600
    """
    chunk = config.mlp_chunk
    return batch * (seq if chunk is None else min(chunk, seq))


FULL = LayerKind()
"""A layer of full attention with RoPE (when the config has RoPE): every uniform stack's kind."""


def _rms_residuals(itemsize: int, rows: int, width: int, *, fp32_product: bool = False) -> tuple[int, bool]:
    """RMSNorm keeps two fp32 row statistics and the normalised input in fp32; in a 16-bit
    dtype also its cast (Gemma's ``(1 + w)``, ``fp32_product``: the fp32 product's input
    instead), and its own fp32 copy of the input instead of the input."""
    stats = 2 * rows * 4
    if itemsize == 4:
        return rows * width * 4 + stats, True
    return rows * width * (8 if fp32_product else 4 + itemsize) + stats, False


def _layer_norm_residuals(itemsize: int, rows: int, width: int) -> tuple[int, bool]:
    """LayerNorm keeps ``x - mean``, its square and the normalised x (fp32) and two row
    statistics, never its input."""
    return 3 * rows * width * 4 + 2 * rows * 4, False


NORM_RESIDUALS = MappingProxyType(
    {
        Norm.RMS: _rms_residuals,
        Norm.GEMMA_RMS: functools.partial(_rms_residuals, fp32_product=True),
        Norm.LAYER: _layer_norm_residuals,
    }
)
"""``nn.Norm`` -> ``(itemsize, rows, width) -> (bytes)`` autodiff keeps inside one norm over
``width`` features of ``rows`` rows, and whether it also keeps the norm's input."""


@dataclasses.dataclass(frozen=True)
class ActivationCost:
    """What an MLP activation costs, in ``[n, F]`` tensors of the compute dtype and FLOPs.

    Attributes:
        internals: tensors autodiff keeps inside the activation without remat.
        held: those a recomputed layer holds during its backward pass on XLA:CPU (XLA fuses
            the plain elementwise chain of an ungated GELU into the gradient, but keeps three
            tensors of a gated activation, the product's operands among them).
        flops: forward FLOPs per element, the gating product included.
        held_gpu: ``held`` on XLA:GPU, which fuses the gated activation's chain too and
            keeps one tensor of it (measured on ``small``, SwiGLU: the backward's working set
            was two ``[n, F]`` under three held).

    Example:
        >>> from jaxckpt import nn
        >>> costs = ACTIVATION_COSTS
        >>> costs[nn.Activation.GEGLU_TANH].internals > costs[nn.Activation.SWIGLU].internals
        True
    """

    internals: int
    held: int
    flops: int
    held_gpu: int = 0


ACTIVATION_COSTS = MappingProxyType(
    {
        Activation.SWIGLU: ActivationCost(internals=3, held=3, flops=6, held_gpu=1),
        # the tanh GELU's four (x^3 term, tanh, 1 - tanh^2, a product) and its output, for the
        # gate product; a recomputed layer holds three, as SwiGLU (measured, Gemma 2 shapes)
        Activation.GEGLU_TANH: ActivationCost(internals=5, held=3, flops=9, held_gpu=1),
        Activation.GELU_TANH: ActivationCost(internals=4, held=0, flops=8),
        Activation.GELU: ActivationCost(internals=2, held=0, flops=8),
    }
)
"""``nn.Activation`` -> its ``ActivationCost``."""


def visible_pairs(seq: int, window: int | None, causal: bool) -> int:
    """The (query, key) pairs attention computes over one sequence of ``seq`` tokens.

    Causal, query t sees ``min(window, t + 1)`` keys (every earlier one without a window);
    not causal, the window reaches ``window - 1`` keys to each side.

    Example:
        >>> visible_pairs(4, None, True), visible_pairs(4, 2, True), visible_pairs(4, None, False)
        (10, 7, 16)
    """
    reach = seq if window is None else min(window, seq)
    back = reach * (reach + 1) // 2 + (seq - reach) * reach  # sum over t of min(reach, t + 1)
    return back if causal else 2 * back - seq


def attention_flops(cfg: TransformerConfig, batch: int, seq: int, kind: LayerKind = FULL) -> int:
    """Forward FLOPs of one layer of ``kind``'s attention: QK^T and PV over the visible
    pairs (a sliding layer's window of W keys sees ``min(W, t)`` of them), and the logit
    soft cap's.

    Example:
        >>> from jaxckpt import nn
        >>> cfg = nn.TransformerConfig.preset("tiny", sliding_window=64)
        >>> attention_flops(cfg, 1, 512, nn.LAYER_KINDS["sliding"]) < attention_flops(cfg, 1, 512)
        True
    """
    window = cfg.sliding_window if kind.sliding else None
    pairs = batch * cfg.n_heads * visible_pairs(seq, window, cfg.causal)
    cap = SOFTCAP_FLOPS * pairs if cfg.attention_softcap is not None else 0
    return 4 * pairs * cfg.head_dim + cap
