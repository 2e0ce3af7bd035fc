"""Block sizes of the blockwise kernel."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes of the blockwise (FlashAttention-2) kernel.

    ``block_q`` query rows are processed against ``block_k`` keys at a time. A
    block larger than the sequence is clamped to it, and a sequence that is not
    a multiple of its block is padded internally.

    The defaults were chosen by measurement on a 2-core AVX-512 CPU
    (``benchmarks/bench_block_sizes.py``): large enough that the two matmuls
    of a block dominate its softmax, small enough that a block of scores stays
    in cache.

    Example:
        >>> import jaxckpt
        >>> jaxckpt.BlockSizes(block_q=256, block_k=512)
        BlockSizes(block_q=256, block_k=512)
    """

    block_q: int = 512
    block_k: int = 512

    def __post_init__(self):
        for name in ("block_q", "block_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"BlockSizes.{name} must be a positive int, got {value!r}.")

    def clamp(self, t: int, s: int) -> "BlockSizes":
        """Returns block sizes no larger than the query length T and key length S."""
        return BlockSizes(block_q=min(self.block_q, max(t, 1)), block_k=min(self.block_k, max(s, 1)))
