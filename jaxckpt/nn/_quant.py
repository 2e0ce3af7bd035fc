"""QLoRA's quantized base: projection kernels stored as nf4 or int8 codes with per-block scales.

A kernel ``w [..., d_in, d_out]`` is cut into blocks of ``BLOCK`` (64) rows along ``d_in``
(the last block zero-padded), as bitsandbytes cuts a torch weight ``[d_out, d_in]``.
Each block of each output column keeps one fp32 scale, its absmax:

- ``"nf4"``: ``w / absmax`` rounded to the nearest of the 16 NormalFloat-4 values
  (``NF4_CODE``, QLoRA's), two 4-bit codes packed per uint8 (the even row in the high
  nibble, as bitsandbytes). The error per element is at most half the code book's largest
  gap times the block's absmax (``ERROR_PER_ABSMAX``: 0.1519). Storage: 0.5 byte per
  weight + 4 / 64 for the scales = 0.5625 byte. The scales are not double-quantized
  (QLoRA's 8-bit scales of the scales would save 0.047 byte per weight).
- ``"int8"``: symmetric, ``round(w / s)`` in ``[-127, 127]`` with ``s = absmax / 127``:
  error at most ``absmax / 254``; 1.0625 byte per weight.

On normal(0.02) kernels the relative RMS error is 0.092 (nf4) and 0.0059 (int8); the
logits of random tiny models move by 0.06 - 0.25 (nf4) and 0.004 - 0.017 (int8) of their
norm, growing with width and depth (``tests/nn/test_nn_quant.py``). Every block projection
is quantized, adapted or not; the embedding and the output head are not (as bitsandbytes
keeps ``lm_head``).

The codes and scales are ``QuantizedBase`` variables, not ``nnx.Param``: nothing
differentiates or optimises them, and ``nnx.state(model, nnx.Param)`` holds no copy of
them. ``quantized_matmul`` dequantizes inside the step (to the compute dtype) and
computes ``x @ w``; its backward pass keeps the codes, not the dequantized kernel, and
dequantizes again for ``dy @ w.T`` (the base has no gradient of its own), so a scanned
stack holds one layer's dequantized kernels at a time.

Qwix (``qwix.LoraProvider(weight_qtype="nf4")``) was tried first and does not fit this
model: its NNX path swaps each kernel for its quantized form during a first call, and
inside the stack's ``nnx.scan`` that raises ``TraceContextError: Cannot mutate 'Linear'
from different trace level``; on a lone block, ``nnx.grad`` over its adapters raised
``UnexpectedTracerError``; and its adapters are its own variables (``kernel_lora_a``),
not the ``nnx.LoRA`` that the rest of jaxckpt (PEFT export, sharding names) uses.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from jaxckpt._tags import Tag, tag
from jaxckpt.nn._lora import LoraConfig, adapter, add_adapter

BLOCK = 64
"""Rows of ``d_in`` that share one scale (bitsandbytes' and QLoRA's block size)."""

NF4_CODE = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)
"""The 16 NormalFloat-4 values (QLoRA, Dettmers et al. 2023, appendix E; bitsandbytes'
``get_4bit_type("nf4")``), ascending; a code is an index into them."""

_NF4_MIDPOINTS = tuple((a + b) / 2 for a, b in itertools.pairwise(NF4_CODE))
_INT8_MAX = 127

ERROR_PER_ABSMAX = {"nf4": max(np.diff(NF4_CODE)) / 2, "int8": 1 / (2 * _INT8_MAX)}
"""The largest ``|dequantize(quantize(w)) - w|`` of a kind, as a fraction of the block's absmax."""


_DEFAULT_INIT = jax.nn.initializers.lecun_normal()


class QuantizedBase(nnx.Variable):
    """A quantized base kernel's codes or scales: frozen, not an ``nnx.Param`` (no
    gradient, no optimizer state), with logical axes so FSDP shards it.

    Example:
        >>> from flax import nnx
        >>> from jaxckpt import nn
        >>> cfg = nn.TransformerConfig.preset("tiny", n_layers=1, lora=4, quantize_base="nf4")
        >>> model = nn.Transformer(cfg, rngs=nnx.Rngs(0))
        >>> sorted(nnx.state(model.blocks.attn.q_proj, QuantizedBase))  # the base kernel, stored
        ['kernel_codes', 'kernel_scales']
        >>> sorted(nnx.state(model.blocks.attn.q_proj, nnx.Param))  # what trains
        ['lora']
    """


def _blocks(w: jax.Array, block: int) -> jax.Array:
    """``w [..., d_in, d_out]`` zero-padded along d_in -> ``[..., n_blocks, block, d_out]``."""
    pad = -w.shape[-2] % block
    w = jnp.pad(w, [(0, 0)] * (w.ndim - 2) + [(0, pad), (0, 0)])
    return w.reshape((*w.shape[:-2], w.shape[-2] // block, block, w.shape[-1]))


def _nf4_encode(v: jax.Array) -> jax.Array:
    """``v`` in ``[-1, 1]`` -> the index of the nearest ``NF4_CODE`` value, packed in pairs of rows."""
    index = sum((v > m).astype(jnp.uint8) for m in _NF4_MIDPOINTS)
    index = index.reshape((*index.shape[:-3], -1, index.shape[-1]))
    return (index[..., 0::2, :] << 4) | index[..., 1::2, :]


def _nf4_decode(codes: jax.Array) -> jax.Array:
    """Packed codes ``[..., rows / 2, d_out]`` -> their NF4 values ``[..., rows, d_out]`` (fp32)."""
    index = jnp.stack([codes >> 4, codes & 15], axis=-2)
    index = index.reshape((*codes.shape[:-2], -1, codes.shape[-1]))
    return jnp.asarray(NF4_CODE, jnp.float32)[index]


def _int8_encode(v: jax.Array) -> jax.Array:
    v = jnp.clip(jnp.round(v * _INT8_MAX), -_INT8_MAX, _INT8_MAX).astype(jnp.int8)
    return v.reshape((*v.shape[:-3], -1, v.shape[-1]))


def _int8_decode(codes: jax.Array) -> jax.Array:
    return codes.astype(jnp.float32)


_KINDS = {"nf4": (_nf4_encode, _nf4_decode), "int8": (_int8_encode, _int8_decode)}
"""kind -> ``(encode(w / absmax) -> codes, decode(codes) -> w / scale)``."""


def _check_kind(kind: str, where: str) -> None:
    if kind not in _KINDS:
        raise ValueError(f"{where}: kind={kind!r} is not one of {', '.join(_KINDS)}")


@functools.partial(jax.jit, static_argnames=("kind", "block"))
def quantize(w: jax.Array, kind: str, block: int = BLOCK) -> tuple[jax.Array, jax.Array]:
    """``w [..., d_in, d_out]`` as ``(codes, scales)``: blocks of ``block`` rows along d_in.

    Args:
        w: a float kernel; leading axes (a layer stack) are quantized one slice at a time.
        kind: ``"nf4"`` or ``"int8"``.
        block: rows per scale (even).

    Returns:
        ``codes``: nf4 ``uint8 [..., n_blocks * block / 2, d_out]`` (two codes a byte), int8
        ``int8 [..., n_blocks * block, d_out]``; ``scales``: fp32 ``[..., n_blocks, d_out]``
        (nf4: the block's absmax; int8: absmax / 127), ``n_blocks = ceil(d_in / block)``.

    Raises:
        ValueError: for an unknown ``kind``, a ``w`` of fewer than 2 axes or an odd ``block``.

    Example:
        >>> import jax.numpy as jnp
        >>> codes, scales = quantize(jnp.linspace(-1.0, 2.0, 15).reshape(5, 3), "nf4")
        >>> codes.shape, codes.dtype, scales.shape
        ((32, 3), dtype('uint8'), (1, 3))
    """
    _check_kind(kind, "quantize")
    if w.ndim < 2 or block % 2:
        raise ValueError(f"quantize: needs w [..., d_in, d_out] and an even block, got {w.shape=}, {block=}")
    if w.ndim > 2:
        flat = w.reshape((-1, *w.shape[-2:]))
        codes, scales = lax.map(lambda v: quantize(v, kind, block), flat)
        return codes.reshape(w.shape[:-2] + codes.shape[1:]), scales.reshape(w.shape[:-2] + scales.shape[1:])
    blocks = _blocks(w.astype(jnp.float32), block)
    absmax = jnp.max(jnp.abs(blocks), axis=-2)
    encode = _KINDS[kind][0]
    codes = encode(blocks / jnp.where(absmax > 0, absmax, 1.0)[..., None, :])
    return codes, absmax / _INT8_MAX if kind == "int8" else absmax


@functools.partial(jax.jit, static_argnames=("kind", "d_in", "dtype"))
def dequantize(codes: jax.Array, scales: jax.Array, kind: str, d_in: int, dtype=jnp.float32) -> jax.Array:
    """The kernel ``[..., d_in, d_out]`` that ``quantize`` gave ``(codes, scales)`` for, in ``dtype``
    (computed in fp32 and cast once).

    Example:
        >>> import jax.numpy as jnp, numpy as np
        >>> w = jnp.array([[0.25, -2.0], [1.0, 4.0], [-1.0, 0.0]])
        >>> w2 = np.asarray(dequantize(*quantize(w, "nf4"), "nf4", d_in=3), np.float64)
        >>> np.round(w2, 3).tolist()  # +-absmax and 0 are exact
        [[0.246, -2.1], [1.0, 4.0], [-1.0, 0.0]]
    """
    _check_kind(kind, "dequantize")
    values = _KINDS[kind][1](codes)
    rows, n_blocks = values.shape[-2], scales.shape[-2]
    block = rows // max(n_blocks, 1)
    if rows != block * n_blocks or not rows - block < d_in <= rows:
        raise ValueError(f"dequantize: {codes.shape=} and {scales.shape=} do not hold d_in={d_in} rows")
    values = values.reshape((*values.shape[:-2], n_blocks, block, values.shape[-1]))
    w = (values * scales[..., None, :]).reshape((*values.shape[:-3], rows, values.shape[-1]))
    return w[..., :d_in, :].astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _matmul(x, codes, scales, kind, d_in):
    w = dequantize(codes, scales, kind, d_in, x.dtype)
    return lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())))


def _matmul_fwd(x, codes, scales, kind, d_in):
    return _matmul(x, codes, scales, kind, d_in), (codes, scales)


def _matmul_bwd(kind, d_in, residuals, dy):
    codes, scales = residuals
    w = dequantize(codes, scales, kind, d_in, dy.dtype)
    dx = lax.dot_general(dy, w, (((dy.ndim - 1,), (1,)), ((), ())))  # dy @ w.T
    return dx, np.zeros(codes.shape, jax.dtypes.float0), jnp.zeros_like(scales)


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def quantized_matmul(x: jax.Array, codes: jax.Array, scales: jax.Array, kind: str, d_in: int) -> jax.Array:
    """``x [..., d_in] @ dequantize(codes, scales)`` in ``x``'s dtype, tagged ``Tag.LINEAR_OUT``.

    Differentiable in ``x`` only: the backward pass dequantizes again rather than keeping
    the kernel, and gives the codes and scales zero cotangents (a frozen base).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> w = jnp.array([[-127.0, 1.0], [0.0, 127.0], [127.0, -3.0]])  # int8 holds it exactly
        >>> codes, scales = quantize(w, "int8")
        >>> x = jnp.ones((4, 3))
        >>> bool(jnp.array_equal(quantized_matmul(x, codes, scales, "int8", 3), x @ w))
        True
        >>> jax.grad(lambda x: quantized_matmul(x, codes, scales, "int8", 3).sum())(x)[0].tolist()  # w.sum(1)
        [-126.0, 127.0, 124.0]
    """
    return tag(_matmul(x, codes, scales, kind, d_in), Tag.LINEAR_OUT)


CODES, SCALES = "kernel_codes", "kernel_scales"
"""The names of a ``QuantizedLinear``'s codes and scales (where ``nnx.Linear`` has ``kernel``)."""


class QuantizedLinear(nnx.Module):
    """A frozen ``[d_in, d_out]`` projection stored quantized (``kind``), with an optional
    LoRA adapter: ``y = x @ dequantize(kernel) (+ bias) + scale * lora(dropout(x))``.

    Its state: ``kernel_codes``, ``kernel_scales`` (``QuantizedBase``, both with
    ``kernel_metadata``: the kernel's logical axes), ``bias`` (``nnx.Param``, frozen by
    ``trainable``) and, with ``lora``, ``lora.lora_a`` / ``lora.lora_b`` as ``LoraLinear``
    has them. The kernel is drawn from
    ``kernel_init`` (keys drawn in ``nnx.Linear``'s order) and quantized at once.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> layer = QuantizedLinear(5, 3, kind="nf4", lora=LoraConfig(rank=2), rngs=nnx.Rngs(0))
        >>> layer.kernel_codes.shape, layer(jnp.ones((1, 5))).shape  # 64 rows in a block, 2 a byte
        ((32, 3), (1, 3))
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        *,
        kind: str,
        rngs: nnx.Rngs,
        use_bias: bool = False,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        kernel_init=_DEFAULT_INIT,
        bias_init=jax.nn.initializers.zeros,
        kernel_metadata=None,
        bias_metadata=None,
        lora: "LoraConfig | None" = None,
        a_metadata=None,
        b_metadata=None,
    ):
        _check_kind(kind, "QuantizedLinear")
        codes, scales = quantize(kernel_init(rngs.params(), (d_in, d_out), jnp.float32), kind)
        self.kernel_codes = QuantizedBase(codes, **(kernel_metadata or {}))
        self.kernel_scales = QuantizedBase(scales, **(kernel_metadata or {}))
        self.bias = (
            nnx.Param(bias_init(rngs.params(), (d_out,), param_dtype), **(bias_metadata or {}))
            if use_bias
            else nnx.data(None)
        )
        self.lora = None if lora is None else adapter(d_in, d_out, lora, dtype, rngs, a_metadata, b_metadata)
        self.scale = None if lora is None else lora.scale
        self.rate = None if lora is None else lora.dropout
        self.kind, self.in_features, self.out_features, self.dtype = kind, d_in, d_out, dtype

    def kernel(self, dtype=jnp.float32) -> jax.Array:
        """The dequantized kernel ``[d_in, d_out]`` (with any leading stack axes), in ``dtype``."""
        return dequantize(self.kernel_codes[...], self.kernel_scales[...], self.kind, self.in_features, dtype)

    def __call__(self, x: jax.Array, *, dropout_key: jax.Array | None = None) -> jax.Array:
        """``x [..., d_in] -> [..., d_out]`` in the compute dtype; the adapter's dropout only
        with a ``dropout_key`` (training)."""
        x = x.astype(self.dtype)
        y = quantized_matmul(x, self.kernel_codes[...], self.kernel_scales[...], self.kind, self.in_features)
        if self.bias is not None:
            y = y + self.bias[...].astype(y.dtype).reshape((1,) * (y.ndim - 1) + (-1,))
        return y if self.lora is None else add_adapter(self, x, y, dropout_key)


def quantize_params(params: dict, like, kind: str) -> dict:
    """``params`` (a pure dict) with each float ``kernel`` whose place in ``like`` (the
    model's state or its pure dict, abstract or not) holds ``kernel_codes`` and
    ``kernel_scales`` replaced by them: an unquantized base (a Hugging Face or converted
    one) read into a model of ``quantize_base=kind``. Anything else passes as it is.

    Raises:
        ValueError: when a quantized kernel's shapes differ from ``like``'s (the path named).

    Example:
        >>> import numpy as np
        >>> like = {"proj": {CODES: np.zeros((32, 2), np.uint8), SCALES: np.zeros((1, 2), np.float32)}}
        >>> out = quantize_params({"proj": {"kernel": np.ones((3, 2))}}, like, "nf4")
        >>> sorted(out["proj"]), out["proj"][SCALES].tolist()
        (['kernel_codes', 'kernel_scales'], [[1.0, 1.0]])
    """
    _check_kind(kind, "quantize_params")
    like = nnx.to_pure_dict(like) if isinstance(like, nnx.State) else like
    return _quantized(params, like, kind, "")


def _quantized(params: dict, like: dict, kind: str, path: str) -> dict:
    out = dict(params)
    if "kernel" in params and CODES in like and "kernel" not in like:
        codes, scales = quantize(jnp.asarray(out.pop("kernel")), kind)
        for name, value in ((CODES, codes), (SCALES, scales)):
            if value.shape != like[name].shape:
                raise ValueError(
                    f"quantize_params: {path}kernel quantizes to {name} {value.shape}, "
                    f"the model has {like[name].shape}"
                )
            out[name] = value
    for name, node in params.items():
        if isinstance(node, dict) and isinstance(like.get(name), dict):
            out[name] = _quantized(node, like[name], kind, f"{path}{name}.")
    return out
