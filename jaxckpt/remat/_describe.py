"""``describe``: the residuals JAX really saves for the backward pass under a spec."""

import dataclasses
import re
from collections.abc import Callable
from typing import Protocol

from jaxckpt._tags import Tag
from jaxckpt.remat._compress import compressed_bytes
from jaxckpt.remat._presets import Layered, get
from jaxckpt.remat._residuals import SavedResidual, saved_residuals
from jaxckpt.remat._spec import RematSpec

_NAMED = re.compile(r"named '([^']+)'")
_WHERE = re.compile(r" from \S+ \((.+)\)$")


class RematSegments(Protocol):
    """What ``describe`` needs from a model (``jaxckpt.nn.Transformer`` has it)."""

    def remat_segments(
        self, batch: int, seq: int, remat: "str | RematSpec"
    ) -> list[tuple[Callable, tuple, int]]:
        """``[(fn, (x, params), count)]``, one entry per distinct remat segment."""
        ...


@dataclasses.dataclass(frozen=True)
class Residual:
    """One saved residual of one remat segment.

    Attributes:
        tag: the ``Tag`` it carries, or None for an untagged intermediate.
        what: JAX's description (the primitive and the function that made it).
        shape, dtype: its abstract value.
        nbytes: bytes of one copy at its dtype. count: how many segments save it.
        where: ``"device"``, or ``"host"`` for an offloaded tag.
        fmt: ``"int8"`` or ``"fp8"`` for a tag the spec compresses, else None.
        stored_nbytes: bytes of one stored copy: ``nbytes``, or the compressed values and
            their scales (``remat.compressed_bytes``).

    Example:
        >>> from flax import nnx
        >>> from jaxckpt import nn, remat
        >>> model = nn.Transformer(nn.TransformerConfig.preset("tiny", n_layers=2), rngs=nnx.Rngs(0))
        >>> (r,) = remat.describe(model, (2, 16), "full").residuals  # full remat: the layer input
        >>> str(r.tag), r.shape, r.count, r.total_bytes
        ('layer_input', (2, 16, 128), 2, 32768)
    """

    tag: Tag | None
    what: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    count: int
    where: str
    fmt: str | None = None
    stored_nbytes: int | None = None

    def __post_init__(self):
        if self.stored_nbytes is None:
            object.__setattr__(self, "stored_nbytes", self.nbytes)

    @property
    def total_bytes(self) -> int:
        """Bytes stored by all segments: ``stored_nbytes * count``."""
        return self.stored_nbytes * self.count

    @property
    def uncompressed_bytes(self) -> int:
        """``nbytes * count``: what ``total_bytes`` would be at the residual's dtype."""
        return self.nbytes * self.count


@dataclasses.dataclass(frozen=True)
class RematReport:
    """The residuals saved by a model's block stack under ``spec`` (from ``describe``);
    ``str(report)`` is a table.

    Example:
        >>> from flax import nnx
        >>> from jaxckpt import nn, remat
        >>> model = nn.Transformer(nn.TransformerConfig.preset("tiny", n_layers=2), rngs=nnx.Rngs(0))
        >>> report = remat.describe(model, (2, 16), "save_attn")
        >>> [str(r.tag) for r in report.residuals]
        ['layer_input', 'attn_out', 'attn_lse']
        >>> report.total_bytes("host")  # nothing offloaded
        0
        >>> off = remat.describe(model, (2, 16), "offload_full")  # the boundaries in host memory
        >>> [(str(r.tag), r.where, r.count) for r in off.residuals], off.total_bytes("host")
        ([('layer_input', 'host', 2)], 32768)
    """

    spec: RematSpec
    residuals: tuple[Residual, ...]

    @property
    def tags(self) -> frozenset[Tag]:
        """Every tag that is saved (or offloaded)."""
        return frozenset(r.tag for r in self.residuals if r.tag is not None)

    def total_bytes(self, where: str = "device") -> int:
        """Bytes of all residuals kept on ``where`` (``"device"`` or ``"host"``), as stored
        (compressed where the spec compresses)."""
        return sum(r.total_bytes for r in self.residuals if r.where == where)

    def uncompressed_bytes(self, where: str = "device") -> int:
        """``total_bytes`` as if nothing were compressed."""
        return sum(r.uncompressed_bytes for r in self.residuals if r.where == where)

    def __str__(self) -> str:
        compressed = any(r.fmt for r in self.residuals)
        col = f" {'stored MiB':>16}" if compressed else ""
        lines = [f"{'tag':<12} {'shape':<22} {'dtype':<9} {'count':>5} {'MiB':>10}{col}  where   what"]
        for r in self.residuals:
            tag = str(r.tag) if r.tag else "-"
            mib = r.uncompressed_bytes / 2**20
            if compressed:
                col = f" {r.fmt or '':>5} {r.total_bytes / 2**20:>10.3f}"
            head = f"{tag:<12} {r.shape!s:<22} {r.dtype:<9} {r.count:>5} {mib:>10.3f}{col}"
            lines.append(f"{head}  {r.where:<7} {r.what}")
        for where, label in (("device", "total on device:"), ("host", "total on host:  ")):
            total = self.total_bytes(where)
            if where == "host" and not total:
                continue
            line = f"{label} {total / 2**20:.3f} MiB"
            if total != self.uncompressed_bytes(where):
                line += f" ({self.uncompressed_bytes(where) / 2**20:.3f} MiB uncompressed)"
            lines.append(line)
        return "\n".join(lines)


def _residual(saved: SavedResidual, spec: RematSpec, count: int) -> Residual | None:
    src = saved.src
    if src.startswith("from a constant"):
        return None  # a constant of the trace (the RoPE frequencies), not an activation
    if src.startswith("from the argument"):
        if not src.startswith("from the argument x"):
            return None  # a parameter, not an activation
        tag, what = Tag.LAYER_INPUT, "segment input"
    else:
        named = _NAMED.search(src)
        tag = Tag(named.group(1)) if named and named.group(1) in Tag._value2member_map_ else None
        where = _WHERE.search(src)
        what = src.split(" from ")[0] + (f" ({where.group(1)})" if where else "")
    place = "host" if tag in spec.offload else "device"
    fmt = spec.compress.get(tag)
    stored = None if fmt is None else compressed_bytes(saved.shape, saved.dtype, fmt, spec.compress_group)
    return Residual(tag, what, saved.shape, str(saved.dtype), saved.nbytes, count, place, fmt, stored)


def describe(model: RematSegments, batch: tuple[int, int], spec: "str | RematSpec") -> RematReport:
    """Lists the activations the backward pass finds saved, per remat segment.

    The list comes from ``jax.ad_checkpoint``'s saved-residual analysis of one remat
    segment of the block stack, so it is what JAX will really keep; parameters and
    constants (the RoPE frequencies) are left out and ``count`` says how many segments
    keep each residual. Activations outside the block stack (embedding, logits) do not
    depend on the spec and are not listed.

    A tag the spec compresses shows its format and its stored bytes (the one-byte values
    and their float32 scales) beside its bytes at its dtype; the totals are the stored bytes.

    Args:
        model: a ``jaxckpt.nn.Transformer`` (anything with ``remat_segments``).
        batch: ``(B, T)``, or a token array of that shape.
        spec: a preset name or ``RematSpec``.

    Returns:
        A ``RematReport``; ``str(report)`` is a table.

    Example:
        >>> from flax import nnx
        >>> from jaxckpt import nn, remat
        >>> model = nn.Transformer(nn.TransformerConfig.preset("tiny", n_layers=2), rngs=nnx.Rngs(0))
        >>> sorted(map(str, remat.describe(model, (2, 16), "save_attn").tags))
        ['attn_lse', 'attn_out', 'layer_input']
        >>> small = remat.describe(model, (2, 16), remat.compressed("full", "int8"))
        >>> [(str(r.tag), r.fmt, r.nbytes, r.stored_nbytes) for r in small.residuals]  # 1 byte + scales
        [('layer_input', 'int8', 16384, 4224)]
    """
    spec = get(spec)
    if isinstance(spec, Layered):
        raise ValueError(
            f"describe: the Layered spec {spec.describe()!r} keeps what each group's spec keeps; "
            "describe the groups' specs one by one (spec.specs), each row's count then being "
            "that of a uniform stack"
        )
    # Offloading moves a residual but does not change which ones exist; analysing the
    # offloaded tags as saved keeps their names (an offloaded value shows as a device_put).
    # Compression changes the bytes of a residual, not which ones exist: the rows are
    # those of the uncompressed spec, each compressed tag with its stored bytes.
    analysed = dataclasses.replace(spec, save=spec.save | spec.offload, offload=frozenset(), compress={})
    shape = tuple(getattr(batch, "shape", batch))
    if len(shape) != 2 or not all(isinstance(n, int) and n > 0 for n in shape):
        raise ValueError(f"describe: batch must be (B, T) or a [B, T] token array, got {batch!r}")
    rows = []
    for fn, args, count in model.remat_segments(shape[0], shape[1], analysed):
        for saved in saved_residuals(fn, *args):
            row = _residual(saved, spec, count)
            if row is not None:
                rows.append(row)
    return RematReport(spec, tuple(rows))
