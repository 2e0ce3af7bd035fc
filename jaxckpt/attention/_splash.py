"""``implementation="splash"``: JAX's Splash attention Pallas kernel, Mosaic on a TPU.

The kernel (``jax.experimental.pallas.ops.tpu.splash_attention``) works on one batch
element at a time, ``q [N, T, H]`` and ``k``/``v`` ``[K, S, H]`` (``[S, H]`` for MQA),
with a static block-sparse mask, segment ids and a logit soft cap. Here its forward and
backward (``_splash_attention_forward`` with ``save_residuals=True``, and
``_splash_attention_bwd``) are wrapped in jaxckpt's own ``flash_vjp``, vmapped over the
batch, so the output and the log-sum-exp are the ``Tag.ATTN_OUT`` / ``Tag.ATTN_LSE``
residuals that the remat presets name, as for the other flash kernels.

How the contract maps onto the kernel:

- scale: the kernel does not scale; ``q * scale`` goes in, and ``dq`` comes out times ``scale``.
- causal and windows: one static mask computed in the kernel (``_Visible``), top-left
  aligned as the contract's: causal is the window ``(left or None, 0)``.
- T and S are padded to whole blocks (multiples of 128, the lane width); padded keys
  are masked by the same static mask (``k < S``), padded rows are cut.
- segment ids and lengths: kernel segment ids. Lengths become ids no real key or row
  shares (rows past ``q_len`` and keys past ``kv_len`` match nothing), exactly.
- rows that see no key: the kernel gives them a mean of V, or NaN where every block was
  skipped, with an lse at or below its mask value; they are found from the lse and given
  0, ``lse = -inf`` and zero gradients (the backward sees ``d_out = 0`` and ``lse = +inf``).
- GQA: the kernel's MHA variant takes K < N heads directly; K == 1 runs its MQA variant.

Off a TPU (``platform() != "tpu"``) the same kernels run in the Pallas interpreter.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask_lib
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask_info as info_lib

from jaxckpt.attention._block_sizes import BlockSizes
from jaxckpt.attention._flash_vjp import Residuals, flash_vjp
from jaxckpt.attention._platform import platform
from jaxckpt.attention._registry import features_used
from jaxckpt.attention._validate import AttentionInputs, MaskArrays
from jaxckpt.attention._vma import varying_axes

SPLASH_FEATURES = frozenset({"causal", "window", "segments", "lengths", "softcap"})
"""The features ``implementation="splash"`` supports (GQA/MQA always); bias, a boolean
mask and dropout have no counterpart in the kernel."""

LANES = 128
"""Blocks are multiples of this (the TPU lane width the kernel's tiles need)."""
MAX_BLOCK = 512
MASK_VALUE = sk.DEFAULT_MASK_VALUE
KERNEL_PREFIX = "splash_"
"""Every Splash kernel's ``pallas_call`` name starts so (``splash_mha_fwd_residuals``, ...)."""


class _Visible(mask_lib._ComputableMask):
    """The static mask: ``q - left <= k <= q + right`` (either side may be None) and
    ``k < s_valid`` (the padded keys), evaluated inside the kernel."""

    def __init__(self, shape: tuple[int, int], left, right, s_valid: int):
        self.left, self.right, self.s_valid = left, right, s_valid
        padded = s_valid < shape[1]

        def visible(q_ids, kv_ids):
            ok = None
            for cond in (
                None if left is None else q_ids - left <= kv_ids,
                None if right is None else kv_ids <= q_ids + right,
                (kv_ids + 0 * q_ids) < s_valid if padded else None,
            ):
                if cond is not None:
                    ok = cond if ok is None else ok & cond
            return ok

        super().__init__(shape=shape, mask_function=visible)

    def _key(self):
        return (self.shape, self.left, self.right, self.s_valid)

    def __eq__(self, other):
        return isinstance(other, _Visible) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())


@dataclasses.dataclass(frozen=True)
class _Config:
    """The static configuration (hashable: ``flash_vjp``'s ``cfg``)."""

    t: int
    s: int
    tp: int  # padded lengths
    sp: int
    block_q: int
    block_k: int
    window: tuple | None  # (left | None, right | None), causal folded in; None: no window
    scale: float
    soft_cap: float | None
    mqa: bool
    interpret: bool

    @property
    def block_sizes(self) -> sk.BlockSizes:
        bq, bk = self.block_q, self.block_k
        return sk.BlockSizes(
            block_q=bq, block_kv=bk, block_q_dkv=bq, block_kv_dkv=bk, block_q_dq=bq, block_kv_dq=bk
        )


@functools.lru_cache(maxsize=64)
def _mask_infos(cfg: _Config, heads: int):
    """``(fwd, dq, dkv)`` MaskInfos (NumPy) and the in-kernel mask function of ``cfg``."""
    left, right = cfg.window or (None, None)
    if left is None and right is None and cfg.sp == cfg.s:
        head_mask = mask_lib.FullMask((cfg.tp, cfg.sp))
    else:
        head_mask = _Visible((cfg.tp, cfg.sp), left, right, cfg.s)
    mask = mask_lib.MultiHeadMask([head_mask] * heads)
    shape = (cfg.block_q, cfg.block_k)
    kw = dict(head_shards=1, q_seq_shards=1)
    fwd, fn = info_lib.process_mask(mask, shape, **kw)
    dq, _ = info_lib.process_mask(mask, shape, **kw)
    dkv, _ = info_lib.process_mask_dkv(mask, shape, shrink_grid=True, **kw)
    return fwd, dq, dkv, fn


def _heads_first(x: jax.Array, length: int, mqa: bool = False) -> jax.Array:
    """``[B, L, heads, H]`` -> ``[B, heads, Lp, H]`` (``[B, Lp, H]`` for MQA), zero-padded."""
    x = jnp.pad(x, ((0, 0), (0, length - x.shape[1]), (0, 0), (0, 0)))
    return x[:, :, 0] if mqa else x.transpose(0, 2, 1, 3)


def _pad_ids(ids: jax.Array, length: int) -> jax.Array:
    return jnp.pad(ids, ((0, 0), (0, length - ids.shape[1])))


def _segment_ids(cfg: _Config, arrays: MaskArrays) -> sk.SegmentIds | None:
    """The kernel's ``[B, Tp]`` / ``[B, Sp]`` ids: the user's segments, with rows past
    ``q_len`` and keys past ``kv_len`` given ids nothing else has (-1 and -2). With
    segment ids too, the user's ids are first renumbered to their ranks in ``[0, T + S)``
    (equal stays equal), so the two markers cannot collide with any of them."""
    q_ids, kv_ids = arrays.q_segments, arrays.kv_segments
    lengths = arrays.q_lengths is not None or arrays.kv_lengths is not None
    if q_ids is None and not lengths:
        return None
    if q_ids is None:
        b = next(x for x in (arrays.q_lengths, arrays.kv_lengths) if x is not None).shape[0]
        q_ids = jnp.zeros((b, cfg.t), jnp.int32)
        kv_ids = jnp.zeros((b, cfg.s), jnp.int32)
    elif lengths:
        ranks = jnp.sort(jnp.concatenate([q_ids, kv_ids], axis=1), axis=1)
        rank = jax.vmap(jnp.searchsorted)
        q_ids, kv_ids = rank(ranks, q_ids).astype(jnp.int32), rank(ranks, kv_ids).astype(jnp.int32)
    if arrays.q_lengths is not None:
        q_ids = jnp.where(jnp.arange(cfg.t)[None, :] < arrays.q_lengths[:, None], q_ids, -1)
    if arrays.kv_lengths is not None:
        kv_ids = jnp.where(jnp.arange(cfg.s)[None, :] < arrays.kv_lengths[:, None], kv_ids, -2)
    # padding: padded keys are masked statically, padded rows are cut, so any id does
    return sk.SegmentIds(q=_pad_ids(q_ids, cfg.tp), kv=_pad_ids(kv_ids, cfg.sp))


def _inputs(cfg: _Config, q, k, v, arrays):
    qs = _heads_first((q * jnp.asarray(cfg.scale, q.dtype)).astype(q.dtype), cfg.tp)
    ks, vs = (_heads_first(x, cfg.sp, cfg.mqa) for x in (k, v))
    return qs, ks, vs, _segment_ids(cfg, arrays)


def _forward(cfg: _Config, q, k, v, bias, arrays, seed):
    del bias, seed  # refused by the registry (SPLASH_FEATURES)
    qs, ks, vs, seg = _inputs(cfg, q, k, v, arrays)
    fwd_info, _, _, fn = _mask_infos(cfg, q.shape[2])
    fwd_info = jax.tree.map(jnp.asarray, fwd_info)

    def one(q1, k1, v1, seg1):
        return sk._splash_attention_forward(
            fwd_info,
            q1,
            k1,
            v1,
            seg1,
            None,  # attention sinks
            mask_value=MASK_VALUE,
            is_mqa=cfg.mqa,
            block_sizes=cfg.block_sizes,
            residual_checkpoint_name=None,
            save_residuals=True,
            mask_function=fn,
            attn_logits_soft_cap=cfg.soft_cap,
            interpret=cfg.interpret,
        )

    out, (lse,) = jax.vmap(one)(qs, ks, vs, seg)  # [B, N, Tp, H], [B, N, Tp]
    out, lse = out[:, :, : cfg.t].transpose(0, 2, 1, 3), lse[:, :, : cfg.t]
    # a row that saw no key: lse at or below the mask value (or -inf: every block skipped)
    dead = lse < MASK_VALUE / 2
    out = jnp.where(dead.transpose(0, 2, 1)[..., None], jnp.zeros((), out.dtype), out)
    return out, jnp.where(dead, -jnp.inf, lse.astype(jnp.float32))


def _backward(cfg: _Config, res: Residuals, d_out):
    qs, ks, vs, seg = _inputs(cfg, res.q, res.k, res.v, res.arrays)
    _, dq_info, dkv_info, fn = _mask_infos(cfg, res.q.shape[2])
    dq_info, dkv_info = jax.tree.map(jnp.asarray, (dq_info, dkv_info))
    dead = res.lse == -jnp.inf  # [B, N, T]
    d_out = jnp.where(dead.transpose(0, 2, 1)[..., None], 0, d_out).astype(res.out.dtype)
    do, out = (_heads_first(x, cfg.tp) for x in (d_out, res.out))
    # P = exp(logit - lse) must be 0 in the rows that saw no key and in the padded rows
    lse = jnp.pad(
        jnp.where(dead, jnp.inf, res.lse), ((0, 0), (0, 0), (0, cfg.tp - cfg.t)), constant_values=jnp.inf
    )

    def one(q1, k1, v1, seg1, out1, lse1, do1):
        residuals = (q1, k1, v1, seg1, None, out1, lse1, dq_info, dkv_info)
        grads = sk._splash_attention_bwd(
            False,  # save_residuals
            MASK_VALUE,
            cfg.mqa,
            cfg.block_sizes,
            None,  # residual_checkpoint_name
            fn,
            cfg.soft_cap,
            cfg.interpret,
            residuals,
            do1,
        )
        return grads[3:6]

    dq, dk, dv = jax.vmap(one)(qs, ks, vs, seg, out, lse, do)
    dq = (dq[:, :, : cfg.t].astype(jnp.float32) * cfg.scale).astype(res.q.dtype).transpose(0, 2, 1, 3)
    if cfg.mqa:
        dk, dv = dk[:, :, None], dv[:, :, None]
    else:
        dk, dv = dk.transpose(0, 2, 1, 3), dv.transpose(0, 2, 1, 3)
    return dq, dk[:, : cfg.s], dv[:, : cfg.s], None


_call = flash_vjp(_forward, _backward)


def _block(length: int, asked: int | None) -> tuple[int, int]:
    """``(block, padded length)``: a multiple of 128 no larger than the padded length."""
    whole = -(-length // LANES) * LANES
    if asked is not None:
        block = min(-(-asked // LANES) * LANES, whole)
        return block, -(-length // block) * block
    if whole <= MAX_BLOCK:
        return whole, whole
    block = next(b for b in (MAX_BLOCK, MAX_BLOCK // 2, LANES) if whole % b == 0)
    return block, whole


def splash_block(length: int) -> int:
    """The query (or key) block the Splash kernel runs a sequence of ``length`` in when no
    block size is asked for: the sequence padded to 128 lanes if that is at most 512, else
    the largest of 512, 256 and 128 that divides it.

    Example:
        >>> [splash_block(n) for n in (100, 1024, 640, 1536)]
        [128, 512, 128, 512]
    """
    return _block(length, None)[0]


def _window(p: AttentionInputs) -> tuple | None:
    m = p.static.mask
    if m.window is None:
        return (None, 0) if m.is_causal else None
    left, right = m.window
    return (left, 0) if m.is_causal else (left, right)


def splash_attention(p: AttentionInputs, block_sizes: BlockSizes | None = None):
    """The Splash kernel on canonical inputs (Mosaic on a TPU, the Pallas interpreter elsewhere).

    ``block_sizes`` sets the kernels' query and key blocks, each rounded up to a multiple
    of 128 and clamped to the padded sequence; None: up to 512.

    Returns:
        ``(out [B, T, N, H], lse [B, N, T] fp32)``; the lse is not differentiated.

    Example:
        >>> import jax, jaxckpt
        >>> q = jax.random.normal(jax.random.key(0), (1, 8, 2, 16))
        >>> kv = jax.random.normal(jax.random.key(1), (1, 8, 1, 16))
        >>> jaxckpt.flash_attention(q, kv, kv, is_causal=True, implementation="splash").shape
        (1, 8, 2, 16)
    """
    interpret = platform() != "tpu"
    if any(varying_axes(x) for x in jax.tree.leaves((p.query, p.key, p.value, p.arrays))):
        raise NotImplementedError(
            "implementation='splash' cannot run inside jax.shard_map with check_vma=True (JAX "
            f"{jax.__version__}: the Splash kernel's pallas_call declares its outputs with no "
            "varying mesh axes). Pass check_vma=False to jax.shard_map, or use "
            "implementation='blockwise'."
        )
    m = p.static.mask
    block_q, tp = _block(m.t, None if block_sizes is None else block_sizes.block_q)
    block_k, sp = _block(m.s, None if block_sizes is None else block_sizes.block_k)
    cfg = _Config(
        t=m.t,
        s=m.s,
        tp=tp,
        sp=sp,
        block_q=block_q,
        block_k=block_k,
        window=_window(p),
        scale=p.static.scale,
        soft_cap=p.static.logits_soft_cap,
        mqa=p.key.shape[2] == 1,
        interpret=interpret,
    )
    return _call(cfg, p.query, p.key, p.value, None, p.arrays, None)


def splash_fits(p: AttentionInputs) -> bool:
    """Whether ``implementation=None`` takes the Splash kernel: a TPU, and only features
    it supports (bias, a boolean mask and dropout go to blockwise)."""
    return platform() == "tpu" and features_used(p) <= SPLASH_FEATURES


def splash_note() -> str:
    """How ``implementation="splash"`` runs on this backend (``jaxckpt info`` prints it)."""
    if platform() == "tpu":
        return "Mosaic TPU kernel"
    return f"Pallas interpreter on {platform()!r}: the TPU kernel's numerics, slow, for testing"
