"""``RematSpec``: which tagged activations are saved, offloaded or recomputed."""

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping

import jax

from jaxckpt._tags import Tag
from jaxckpt.remat._compress import DEFAULT_GROUP, FORMATS

Policy = Callable[..., object]

OFFLOAD_SRC = "device"
OFFLOAD_DST = "pinned_host"


def _tags(value: Iterable[str], field: str) -> frozenset[Tag]:
    if isinstance(value, str):
        raise TypeError(
            f"RematSpec.{field} takes a collection of tags, got the string {value!r}; wrap it: ({value!r},)"
        )
    valid = {t.value for t in Tag}
    unknown = sorted(str(v) for v in value if str(v) not in valid)
    if unknown:
        raise ValueError(f"RematSpec.{field}: unknown tag(s) {unknown}; valid tags: {sorted(valid)}")
    return frozenset(Tag(str(v)) for v in value)


UNCOMPRESSIBLE = {Tag.ATTN_LSE: "the attention's float32 log-sum-exp, which the flash backward needs exact"}
"""Tags that are never compressed, and why."""


class TagFormats(Mapping):
    """An immutable, hashable ``Tag -> format`` mapping (``RematSpec.compress``).

    Example:
        >>> from jaxckpt.remat import RematSpec, Tag
        >>> formats = RematSpec(compress={"layer_input": "int8"}).compress
        >>> formats == {Tag.LAYER_INPUT: "int8"}, hash(formats) == hash(TagFormats(formats))
        (True, True)
    """

    __slots__ = ("_items",)

    def __init__(self, items: "Mapping | Iterable[tuple[Tag, str]]" = ()):
        items = items.items() if isinstance(items, Mapping) else items
        self._items = tuple(sorted(items))

    def __getitem__(self, tag) -> str:
        for key, fmt in self._items:
            if key == tag:
                return fmt
        raise KeyError(tag)

    def __iter__(self) -> Iterator[Tag]:
        return (key for key, _ in self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(self._items)

    def __eq__(self, other) -> bool:
        return isinstance(other, Mapping) and dict(self._items) == dict(other.items())

    def __repr__(self) -> str:
        return "{" + ", ".join(f"{str(k)!r}: {v!r}" for k, v in self._items) + "}"


NO_COMPRESSION = TagFormats()
"""The empty ``RematSpec.compress``."""


def _formats(spec: "RematSpec") -> TagFormats:
    """``spec.compress`` checked against the spec and normalised (see ``RematSpec``)."""
    given = spec.compress
    if not isinstance(given, Mapping):
        raise TypeError(
            f"RematSpec.compress takes a mapping tag -> format, got {type(given).__name__}: {given!r}; "
            "for example {Tag.LAYER_INPUT: 'int8'}"
        )
    tags = _tags(list(given), "compress")
    formats = TagFormats((Tag(str(tag)), fmt) for tag, fmt in given.items())
    for tag, fmt in formats.items():
        _check_compressed(spec, tag, fmt)
    if len(formats) != len(tags):
        raise ValueError(f"RematSpec.compress: a tag is given twice in {given!r}")
    return formats


def _check_compressed(spec: "RematSpec", tag: Tag, fmt: str) -> None:
    where = f"RematSpec.compress: tag {str(tag)!r}"
    if fmt not in FORMATS:
        raise ValueError(f"{where}: unknown format {fmt!r}; valid formats: {', '.join(FORMATS)}")
    if tag in UNCOMPRESSIBLE:
        raise ValueError(f"{where} cannot be compressed: it is {UNCOMPRESSIBLE[tag]}")
    if not spec.enabled:
        raise ValueError(
            f"{where}: a disabled spec (the 'none' preset) keeps everything at full precision "
            "and compresses nothing; enable remat"
        )
    if tag == Tag.LINEAR_OUT and spec.save_dots and tag not in spec.save | spec.offload:
        raise ValueError(
            f"{where}: under save_dots jax's dots policy keeps the matmul outputs, not the name; "
            "compress them by name instead: save={Tag.LINEAR_OUT}, save_dots=False"
        )
    if tag not in spec.kept_tags:
        raise ValueError(f"{where} is recomputed, not kept; add it to save or offload")
    if spec.layers_per_checkpoint > 1 and tag != Tag.LAYER_INPUT:
        raise ValueError(
            f"{where} is kept inside a remat segment of layers_per_checkpoint="
            f"{spec.layers_per_checkpoint} layers, where it cannot be compressed; only the "
            "segment's input (layer_input) can be"
        )


@dataclasses.dataclass(frozen=True)
class RematSpec:
    """What the backward pass finds saved, offloaded or must recompute.

    Everything not in ``save`` or ``offload`` (and not a matmul output when
    ``save_dots``) is recomputed from the boundary of its remat segment.

    Attributes:
        save: tags kept in device memory.
        offload: tags moved to ``pinned_host`` memory after the forward pass and back
            for the backward pass. ``Tag.LAYER_INPUT`` there is the remat boundary
            itself (what ``full`` keeps: a layer's input, or a segment's): no device
            copy of it is kept between the passes (the ``offload_full`` preset).
        layers_per_checkpoint: ``k`` layers form one remat segment and only the
            segment's input is kept (the seed's ``checkpoint_ratio`` is ``1/k``).
            Inside a segment, ``save`` and ``offload`` still apply; ``Tag.LAYER_INPUT``
            is then the segment's input (its layers' inputs are recomputed with it).
        save_dots: also save every matmul output without batch dimensions
            (``jax.checkpoint_policies.dots_with_no_batch_dims_saveable``), the dense
            projections' included (``Tag.LINEAR_OUT``).
        enabled: ``False`` means no ``jax.checkpoint`` at all: autodiff keeps whatever
            it needs (the ``none`` preset).
        compress: tag -> ``"int8"`` or ``"fp8"``: the kept tags stored compressed
            (``jaxckpt.remat.quantize``, one float32 scale per ``compress_group``
            features). The forward pass is exact; the backward pass reads the dequantized
            values. A compressed tag must be kept (in ``save``, in ``offload``, or
            ``Tag.LAYER_INPUT``, every enabled spec's boundary); ``Tag.ATTN_LSE`` is never
            compressed. Given as a dict (tags or tag strings), stored as a ``TagFormats``.
        compress_group: features per scale of the compressed tags.

    Example:
        >>> from jaxckpt.remat import RematSpec, Tag
        >>> spec = RematSpec(save={Tag.ATTN_OUT, Tag.ATTN_LSE})
        >>> spec.policy() is not None
        True
        >>> RematSpec(save={Tag.ATTN_OUT}, compress={"attn_out": "fp8", Tag.LAYER_INPUT: "int8"}).compress
        {'attn_out': 'fp8', 'layer_input': 'int8'}
    """

    save: frozenset[Tag] = frozenset()
    offload: frozenset[Tag] = frozenset()
    layers_per_checkpoint: int = 1
    save_dots: bool = False
    enabled: bool = True
    compress: "Mapping[Tag, str]" = NO_COMPRESSION
    compress_group: int = DEFAULT_GROUP

    def __post_init__(self):
        object.__setattr__(self, "save", _tags(self.save, "save"))
        object.__setattr__(self, "offload", _tags(self.offload, "offload"))
        both = self.save & self.offload
        if both:
            raise ValueError(f"RematSpec: tags {sorted(both)} are in both save and offload; pick one")
        k = self.layers_per_checkpoint
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"RematSpec.layers_per_checkpoint must be an int >= 1, got {k!r}")
        g = self.compress_group
        if isinstance(g, bool) or not isinstance(g, int) or g < 1:
            raise ValueError(f"RematSpec.compress_group must be an int >= 1, got {g!r}")
        object.__setattr__(self, "compress", _formats(self))

    @property
    def kept_tags(self) -> frozenset[Tag]:
        """Every tag the backward pass finds stored: ``saved_tags``, ``offload``, and
        ``Tag.LAYER_INPUT`` (the remat boundary) when the spec is enabled.

        Example:
            >>> sorted(map(str, RematSpec(save={Tag.ATTN_OUT}).kept_tags))
            ['attn_out', 'layer_input']
        """
        if not self.enabled:
            return frozenset()
        return self.saved_tags | self.offload | {Tag.LAYER_INPUT}

    @property
    def offloads_boundary(self) -> bool:
        """Whether the remat boundary (``Tag.LAYER_INPUT``: each layer's input, or each
        segment's) lives in ``pinned_host`` memory between the forward and backward pass.

        Example:
            >>> RematSpec(offload={Tag.LAYER_INPUT}).offloads_boundary, RematSpec().offloads_boundary
            (True, False)
        """
        return self.enabled and Tag.LAYER_INPUT in self.offload

    @property
    def saved_tags(self) -> frozenset[Tag]:
        """The tags the policy keeps on device: ``save``, and ``Tag.LINEAR_OUT`` (every dense
        projection's matmul) under ``save_dots``.

        Example:
            >>> RematSpec(save_dots=True).saved_tags
            frozenset({<Tag.LINEAR_OUT: 'linear_out'>})
        """
        return self.save | {Tag.LINEAR_OUT} if self.save_dots else self.save

    def policy(self) -> Policy:
        """The ``jax.checkpoint`` policy for one remat segment.

        Returns:
            A policy callable for ``jax.checkpoint(..., policy=...)``. For a disabled
            spec it is ``everything_saveable`` (the model skips ``jax.checkpoint``).

        Raises:
            ValueError: if ``offload`` is non-empty and the default device has no
                ``pinned_host`` memory.
        """
        cp = jax.checkpoint_policies
        if not self.enabled:
            return cp.everything_saveable
        saved = self.saved_tags
        if self.offload:
            require_pinned_host()
            names = cp.save_and_offload_only_these_names(
                names_which_can_be_saved=[str(t) for t in sorted(saved)],
                names_which_can_be_offloaded=[str(t) for t in sorted(self.offload)],
                offload_src=OFFLOAD_SRC,
                offload_dst=OFFLOAD_DST,
            )
        else:
            names = cp.save_only_these_names(*(str(t) for t in sorted(saved)))
        if self.save_dots:
            return cp.save_from_both_policies(cp.dots_with_no_batch_dims_saveable, names)
        return names


def has_pinned_host(device: jax.Device | None = None) -> bool:
    """Whether ``device`` (default: the first device) has a ``pinned_host`` memory space,
    which the ``offload_*`` presets need.

    Example:
        >>> import jax
        >>> from jaxckpt import remat
        >>> remat.has_pinned_host(jax.devices("cpu")[0]) in (True, False)  # depends on the backend
        True
    """
    device = device or jax.devices()[0]
    try:
        kinds = {m.kind for m in device.addressable_memories()}
    except (AttributeError, NotImplementedError, jax.errors.JaxRuntimeError):
        return False
    return OFFLOAD_DST in kinds


def require_pinned_host() -> None:
    """Raises a ValueError when the default device cannot offload to host memory.

    Raises:
        ValueError: naming the device, and presets without offload to use instead.

    Example:
        >>> from jaxckpt import remat
        >>> if remat.has_pinned_host():
        ...     require_pinned_host()  # returns None: offload presets work here
    """
    if not has_pinned_host():
        device = jax.devices()[0]
        raise ValueError(
            f"offload needs a '{OFFLOAD_DST}' memory space, and {device.platform} device {device} has none; "
            "use a preset without offload (for example 'save_qkv' or 'minimal')"
        )
