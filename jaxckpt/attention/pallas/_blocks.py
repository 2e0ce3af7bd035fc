"""Block sizes and launch parameters of the Pallas (Triton) attention kernel.

The defaults, per padded head dim and dtype (:func:`default_pallas_blocks`), follow the
Triton FlashAttention-2 kernels tuned for Hopper (the Triton tutorial's fused attention
and JAX's own ``pallas.ops.gpu.attention``):

- the forward keeps a ``block_q x Hp`` query block and streams ``block_k`` keys: 128 x 64
  in a 16-bit dtype (two 128 x 64 tiles of K and V per pipeline stage fit the 228 KiB
  of shared memory three stages deep);
- the dK/dV kernel keeps a key block and streams query blocks, the dQ kernel the
  reverse; each holds two fp32 accumulators, so their streamed side is smaller
  (dK/dV 32 x 128, dQ 128 x 32: few registers per streamed tile);
- fp32 operands take twice the bytes: every block is halved; so is a head dim of 256;
- 4 warps up to ``Hp = 64``, 8 above (the accumulators need the registers).

None of this was measured here (no GPU): ``autotune_pallas_blocks`` (``jaxckpt.attention._autotune``)
times candidates on a GPU and :func:`set_pallas_blocks` records the winner for a
``(head dim, dtype)``, which every later call then uses.
"""

import dataclasses

import jax.numpy as jnp

MIN_BLOCK = 16
"""Triton's smallest dot operand side: a block on the GPU is a power of two >= 16."""
MAX_HEAD_DIM = 256
"""The largest padded head dim whose blocks fit a Hopper SM's shared memory."""


def padded_head_dim(h: int) -> int:
    """H (or any size) rounded up to a power of two: the head dim the kernels run at
    (Triton's tensors are powers of two; the zero columns change no logit and no output).

    Example:
        >>> padded_head_dim(40), padded_head_dim(64)
        (64, 64)
    """
    return 1 << max(0, (h - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class PallasBlocks:
    """The three kernels' ``(block_q, block_k)`` and Triton's ``num_warps`` / ``num_stages``.

    Example:
        >>> from jaxckpt.attention import PallasBlocks
        >>> PallasBlocks(fwd=(128, 64), dkdv=(32, 128), dq=(128, 32)).num_warps
        4
    """

    fwd: tuple[int, int]
    dkdv: tuple[int, int]
    dq: tuple[int, int]
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        for name in ("fwd", "dkdv", "dq"):
            pair = getattr(self, name)
            if len(pair) != 2 or any(not isinstance(x, int) or x < 1 for x in pair):
                raise ValueError(f"PallasBlocks.{name} must be two positive ints; got {pair!r}.")

    def clamp(self, t: int, s: int, *, interpret: bool) -> "PallasBlocks":
        """Blocks no larger than T and S (on a GPU: than their next power of two, >= 16)."""

        def fit(block: int, size: int) -> int:
            return min(block, size if interpret else max(MIN_BLOCK, padded_head_dim(size)))

        pairs = [(fit(bq, t), fit(bk, s)) for bq, bk in (self.fwd, self.dkdv, self.dq)]
        return dataclasses.replace(self, fwd=pairs[0], dkdv=pairs[1], dq=pairs[2])

    def check_for_gpu(self) -> None:
        """Raises unless every block is a power of two >= 16 (what Triton's dots take)."""
        for name in ("fwd", "dkdv", "dq"):
            for x in getattr(self, name):
                if x < MIN_BLOCK or x & (x - 1):
                    raise ValueError(
                        f"implementation='pallas' on a GPU needs block sizes that are powers of two "
                        f">= {MIN_BLOCK}; got block_sizes {name}={getattr(self, name)}. Use e.g. "
                        "jaxckpt.BlockSizes(64, 64), or block_sizes=None for the tuned defaults."
                    )


def default_pallas_blocks(head_dim: int, dtype) -> PallasBlocks:
    """The default blocks for a padded head dim and an input dtype (see the module doc).

    Example:
        >>> import jax.numpy as jnp
        >>> from jaxckpt.attention import default_pallas_blocks
        >>> default_pallas_blocks(128, jnp.bfloat16)
        PallasBlocks(fwd=(128, 64), dkdv=(32, 128), dq=(128, 32), num_warps=8, num_stages=3)
    """
    halve = jnp.dtype(dtype).itemsize > 2 or head_dim > 128
    d = 2 if halve else 1
    return PallasBlocks(
        fwd=(128 // d, 64 // d),
        dkdv=(32, 128 // d),
        dq=(128 // d, 32),
        num_warps=4 if head_dim <= 64 else 8,
        num_stages=2 if halve else 3,
    )


_TUNED: dict[tuple[int, str], PallasBlocks] = {}


def set_pallas_blocks(head_dim: int, dtype, blocks: PallasBlocks | None) -> None:
    """Makes ``blocks`` the Pallas kernel's blocks for this padded head dim and dtype
    (None restores the default). :func:`autotune_pallas_blocks` calls it.

    Example:
        >>> import jax.numpy as jnp
        >>> from jaxckpt.attention import PallasBlocks, pallas_blocks, set_pallas_blocks
        >>> set_pallas_blocks(64, jnp.float16, PallasBlocks((64, 64), (64, 64), (64, 64)))
        >>> pallas_blocks(64, jnp.float16).fwd
        (64, 64)
        >>> set_pallas_blocks(64, jnp.float16, None)
    """
    key = (int(head_dim), jnp.dtype(dtype).name)
    if blocks is None:
        _TUNED.pop(key, None)
    elif not isinstance(blocks, PallasBlocks):
        raise TypeError(f"blocks must be a PallasBlocks or None; got {type(blocks).__name__}.")
    else:
        _TUNED[key] = blocks


def pallas_blocks(head_dim: int, dtype) -> PallasBlocks:
    """The blocks the Pallas kernel uses for a padded head dim and dtype: the tuned ones
    (:func:`set_pallas_blocks`) if any, else :func:`default_pallas_blocks`.

    Example:
        >>> import jax.numpy as jnp
        >>> from jaxckpt.attention import pallas_blocks
        >>> pallas_blocks(64, jnp.float32).fwd
        (64, 32)
    """
    return _TUNED.get((int(head_dim), jnp.dtype(dtype).name)) or default_pallas_blocks(head_dim, dtype)
