"""Block sizes of the blockwise kernel."""

import dataclasses

TILE_BUDGET_BYTES = 256 * 2**20
"""Automatic block sizes keep one fp32 tile of logits (all of B*N) within this.

Large enough that up to B*N = 256 keeps the fastest 512 x 512 tiles (measured:
256 x 256 tiles were 22% slower at B*N = 256), small enough that a large batch
times many heads cannot blow a tile up to gigabytes."""
MIN_AUTO_BLOCK = 128


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes of the blockwise (FlashAttention-2) kernel.

    ``block_q`` query rows are processed against ``block_k`` keys at a time. A
    block larger than the sequence is clamped to it, and a sequence that is not
    a multiple of its block is padded internally.

    The defaults were chosen by measurement on a 2-core AVX-512 CPU
    (``benchmarks/bench_block_sizes.py``): large enough that the two matmuls
    of a block dominate its softmax. One tile of fp32 logits spans every batch
    element and head (``B*N*block_q*block_k`` floats), so when ``block_sizes`` is
    left to ``flash_attention`` it uses :meth:`auto`, which halves the blocks for
    large ``B*N`` until a tile fits :data:`TILE_BUDGET_BYTES`. Blocks given
    explicitly are used as given.

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

    @classmethod
    def auto(cls, rows: int) -> "BlockSizes":
        """The defaults, halved (larger side first, down to 128) until ``rows`` x tile fits.

        Args:
            rows: ``B * N``, the batch elements times query heads a tile spans.

        Example:
            >>> BlockSizes.auto(8)
            BlockSizes(block_q=512, block_k=512)
            >>> BlockSizes.auto(1024)
            BlockSizes(block_q=256, block_k=256)
        """
        bq, bk = cls.block_q, cls.block_k
        while rows * bq * bk * 4 > TILE_BUDGET_BYTES and max(bq, bk) > MIN_AUTO_BLOCK:
            if bk >= bq:
                bk //= 2
            else:
                bq //= 2
        return cls(bq, bk)

    def clamp(self, t: int, s: int) -> "BlockSizes":
        """Returns block sizes no larger than the query length T and key length S."""
        return BlockSizes(block_q=min(self.block_q, max(t, 1)), block_k=min(self.block_k, max(s, 1)))
