"""Multi-head (and grouped-query) self-attention over ``flash_attention``."""

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from jaxckpt._tags import tag
from jaxckpt.attention import (
    MANUAL_PARTITIONING,
    context_parallel_attention,
    flash_attention,
    normalize,
    resolve_implementation,
)
from jaxckpt.nn._activation_sharding import active_sharding, constrain, context_parallel_strategy
from jaxckpt.nn._choices import LayerKind, Positions, RopeKind
from jaxckpt.nn._config import TransformerConfig
from jaxckpt.nn._kv_cache import LayerCache
from jaxckpt.nn._layers import make_dense, make_norm
from jaxckpt.nn._lora import project
from jaxckpt.nn._rope import apply_rope, rope_tables
from jaxckpt.remat import Tag

FULL = LayerKind()
"""The kind of a layer of a uniform stack: full attention, RoPE when the config has it."""


def _shard_mapped(attend, args: tuple, mesh, rules: dict) -> jax.Array:
    """``attend(*args)`` inside ``jax.shard_map`` over the active activation-sharding mesh:
    for a kernel XLA cannot partition (a Mosaic TPU kernel, e.g. ``implementation="splash"``).

    q/k/v ``[B, T, heads, H]`` are split as the rules split ``batch`` and ``heads``, the
    segment ids ``[B, T]`` as ``batch``; each device attends over whole sequences of its
    batch rows. ``check_vma=False``: under ``jax.grad`` the kernel's custom call fails the
    varying-axes check (JAX 0.10).
    """
    batch, heads = rules.get("batch"), rules.get("heads")
    spec = PartitionSpec(batch, None, heads, None)
    specs = (spec, spec, spec, PartitionSpec(batch, None))[: len(args)]
    return jax.shard_map(attend, mesh=mesh, in_specs=specs, out_specs=spec, check_vma=False)(*args)


def _seq_axis(mesh, rules: dict) -> "str | None":
    """The mesh axis the rules split the sequence over, when it has more than one device."""
    axis = rules.get("seq")
    return axis if isinstance(axis, str) and mesh.shape.get(axis, 1) > 1 else None


def _context_parallel(options: dict, args: tuple, positions, mesh, rules: dict, axis: str) -> jax.Array:
    """``context_parallel_attention`` inside ``jax.shard_map``: q/k/v ``[B, T, heads, H]``
    split along T over ``axis`` (and as the rules split ``batch`` and ``heads``), each
    device attending with its queries across every shard, masks from the tokens'
    ``positions`` (``[T]`` or ``[B, T]``, in whatever order the tokens are)."""
    b, t = args[0].shape[:2]
    positions = jnp.broadcast_to(jnp.asarray(positions).astype(jnp.int32), (b, t))
    batch, heads = rules.get("batch"), rules.get("heads")
    spec, rows = PartitionSpec(batch, axis, heads, None), PartitionSpec(batch, axis)
    strategy = context_parallel_strategy()

    def local(q, key, value, pos, *seg):
        seg = seg[0] if seg else None
        return context_parallel_attention(
            q, key, value, pos, axis_name=axis, strategy=strategy, segment_ids=seg, **options
        )

    specs = (spec, spec, spec, rows, rows)[: len(args) + 1]
    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=spec)(*args[:3], positions, *args[3:])


class Attention(nnx.Module):
    """Self-attention: q/k/v projections, optional q/k norm, RoPE, attention, output projection.

    Causal unless ``cfg.causal`` is False. What varies from layer to layer (a sliding
    window, RoPE or not, the local RoPE base) comes in as the call's static ``kind``.

    The attention itself is ``jaxckpt.flash_attention`` with the ``implementation`` given
    here (None: automatic) and the config's scale and logit soft cap; GQA is passed
    through without repeating K/V. Under an ``activation_sharding`` whose rules split
    ``seq`` over a mesh axis of more than one device (context parallelism), it is
    ``jaxckpt.attention.context_parallel_attention`` inside ``jax.shard_map``, with that
    context's strategy and masks from the tokens' ``positions`` (in any order).

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from jaxckpt.nn import Attention, TransformerConfig
        >>> cfg = TransformerConfig(d_model=12, n_heads=3, n_kv_heads=1, head_dim=4, qk_norm=True)
        >>> Attention(cfg, rngs=nnx.Rngs(0))(jnp.ones((2, 5, 12))).shape
        (2, 5, 12)
    """

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs, implementation: "str | None" = None):
        n, k, h, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_model
        bias = cfg.attention_bias
        self.q_proj = make_dense(cfg, d, n * h, bias=bias, rngs=rngs, axes=("embed", "heads"), target="q")
        self.k_proj = make_dense(cfg, d, k * h, bias=bias, rngs=rngs, axes=("embed", "kv_heads"), target="k")
        self.v_proj = make_dense(cfg, d, k * h, bias=bias, rngs=rngs, axes=("embed", "kv_heads"), target="v")
        self.out_proj = make_dense(
            cfg, n * h, d, bias=cfg.attention_out_bias, rngs=rngs, axes=("heads", "embed"), target="o"
        )
        self.q_norm = make_norm(cfg, "head_dim") if cfg.qk_norm else None
        self.k_norm = make_norm(cfg, "head_dim") if cfg.qk_norm else None
        self.heads = (n, k, h)
        self.config = cfg
        self.implementation = implementation

    def _rope(self, positions: jax.Array, kind: LayerKind) -> "tuple[jax.Array, jax.Array] | None":
        """The cos / sin tables of a layer of ``kind`` at ``positions [T]`` or ``[B, T]``
        (None: no RoPE). Longrope picks its factors by ``max(positions) + 1``, as transformers."""
        cfg = self.config
        if cfg.positions != Positions.ROPE or not kind.rope:
            return None
        if kind.sliding and cfg.local_rope_theta is not None:
            theta, scaling = cfg.local_rope_theta, None
        else:
            theta, scaling = cfg.rope_theta, cfg.rope_scaling
        table = functools.partial(rope_tables, positions, cfg.rotary_dim, theta, scaling, max_len=cfg.max_len)
        if scaling is None or scaling.kind != RopeKind.LONGROPE:
            return table(seq_len=positions.shape[-1])
        # As transformers: the long factors once max(positions) + 1 passes the original length
        # (a decode step past it, a packed row whose documents are shorter than the row).
        limit = scaling.original_max_len
        short, long = table(seq_len=limit), table(seq_len=limit + 1)
        use_long = jnp.max(positions) + 1 > limit
        return tuple(jnp.where(use_long, b, a) for a, b in zip(short, long, strict=True))

    def _tables(
        self, positions: jax.Array, kinds: tuple[LayerKind, ...], index
    ) -> "tuple[jax.Array, jax.Array] | None":
        """The RoPE tables of the layer: its kind's, picked by ``index`` among ``kinds``'
        (a NoPE kind's are the identity: cos 1, sin 0, which rotate nothing, exactly)."""
        tables = [self._rope(positions, kind) for kind in kinds]
        present = [tab for tab in tables if tab is not None]
        if not present:
            return None
        if len(tables) == 1:
            return tables[0]
        identity = (jnp.ones_like(present[0][0]), jnp.zeros_like(present[0][1]))
        tables = [identity if tab is None else tab for tab in tables]
        return tuple(jnp.stack(parts)[index] for parts in zip(*tables, strict=True))

    def _window(self, kind: LayerKind) -> "tuple[int, int] | None":
        """``flash_attention``'s ``local_window_size`` of a layer of ``kind``: a sliding
        window of W keys (the query's own included) reaches W - 1 back."""
        cfg = self.config
        if not kind.sliding or cfg.sliding_window is None:
            return None
        return (cfg.sliding_window - 1, 0 if cfg.causal else cfg.sliding_window - 1)

    def _attend(self, q, key, value, window, segment_ids=None, mask=None, positions=None) -> jax.Array:
        cfg = self.config
        options = dict(
            mask=mask,
            scale=cfg.attention_scale,
            is_causal=cfg.causal and mask is None,
            local_window_size=window if mask is None else None,
            logits_soft_cap=cfg.attention_softcap,
        )
        attend = lambda q, key, value, *seg: flash_attention(
            q, key, value, segment_ids=seg[0] if seg else None, implementation=self.implementation, **options
        )
        args = (q, key, value) if segment_ids is None else (q, key, value, segment_ids)
        active = active_sharding()
        if active is None:
            return attend(*args)
        axis = _seq_axis(*active)
        if axis is not None and mask is None:  # the sequence is split: attend across its shards
            if self.implementation not in (None, "blockwise"):
                raise ValueError(
                    f"Attention(implementation={self.implementation!r}): a sequence split over the "
                    f"mesh axis {axis!r} runs the blockwise kernel across the shards; use "
                    "implementation=None or 'blockwise'"
                )
            options = {arg: given for arg, given in options.items() if arg != "mask"}
            return _context_parallel(options, args, positions, *active, axis)
        name = resolve_implementation(
            normalize(*args[:3], segment_ids=segment_ids, **options), self.implementation
        )
        if name not in MANUAL_PARTITIONING:
            return attend(*args)
        return _shard_mapped(attend, args, *active)

    def _project(self, x: jax.Array, dropout_key=None) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q ``[B, T, N, H]``, k and v ``[B, T, K, H]``, tagged, q/k-normed when configured."""
        b, t, _ = x.shape
        n, k, h = self.heads
        heads = ("batch", "seq", "heads", "head_dim")
        q, key, value = (
            project(layer, x, dropout_key, salt)
            for salt, layer in enumerate((self.q_proj, self.k_proj, self.v_proj))
        )
        q = tag(constrain(q.reshape(b, t, n, h), *heads), Tag.Q_PROJ)
        key = tag(constrain(key.reshape(b, t, k, h), *heads), Tag.K_PROJ)
        value = tag(constrain(value.reshape(b, t, k, h), *heads), Tag.V_PROJ)
        if self.q_norm is not None:
            q, key = self.q_norm(q), self.k_norm(key)
        return q, key, value

    def __call__(
        self,
        x: jax.Array,
        kind: "LayerKind | tuple[LayerKind, ...]" = FULL,
        index=None,
        *,
        positions: "jax.Array | None" = None,
        segment_ids: "jax.Array | None" = None,
        cache: "LayerCache | None" = None,
        dropout_key: "jax.Array | None" = None,
    ):
        """``[B, T, D] -> [B, T, D]`` for a layer of ``kind`` (static), or of the kind
        ``kind[index]`` when ``kind`` is a tuple and ``index`` a (traced) int: the RoPE
        tables are then picked by index and the attention by ``lax.switch`` over the
        distinct windows, so one compiled layer serves every kind.

        Args:
            positions: ``[B, T]`` (or ``[T]``) integer positions for RoPE; default
                ``0..T-1`` (``cache.start + 0..T-1`` with a cache). Packed rows restart
                them at 0 in each document.
            segment_ids: ``[B, T]`` integer ids; a query attends only to keys of its own
                segment (packed documents). Not with a cache.
            cache: this layer's ``LayerCache``: the new keys and values are written at
                ``cache.start`` and the queries attend to every cached key before them
                (decoding). The call then returns ``(out, new_cache)``.
            dropout_key: a key for the LoRA adapters' dropout (training); None: no dropout.
        """
        kinds = kind if isinstance(kind, tuple) else (kind,)
        b, t, _ = x.shape
        n, _, h = self.heads
        q, key, value = self._project(x, dropout_key)
        if positions is None:
            positions = jnp.arange(t) if cache is None else cache.start + jnp.arange(t)
        tables = self._tables(positions, kinds, index)
        if tables is not None:
            q, key = apply_rope(q, *tables), apply_rope(key, *tables)
        windows = [self._window(kind) for kind in kinds]
        if cache is not None:
            if segment_ids is not None:
                raise ValueError(
                    "Attention: segment_ids and a KV cache do not go together; decode one sequence per row"
                )
            cache = cache.write(key, value)
            mask = cache.mask(t, windows, index, causal=self.config.causal)
            out = self._attend(q, cache.key, cache.value, None, mask=mask)
            return tag(self._out(out.reshape(b, t, n * h), dropout_key), Tag.OUT_PROJ), cache
        distinct = list(dict.fromkeys(windows))
        if len(distinct) == 1:
            out = self._attend(q, key, value, distinct[0], segment_ids, positions=positions)
        else:
            which = jnp.asarray([distinct.index(w) for w in windows])[index]
            branches = [
                lambda q, k, v, w=w: self._attend(q, k, v, w, segment_ids, positions=positions)
                for w in distinct
            ]
            out = jax.lax.switch(which, branches, q, key, value)
        return tag(self._out(out.reshape(b, t, n * h), dropout_key), Tag.OUT_PROJ)

    def _out(self, out: jax.Array, dropout_key) -> jax.Array:
        return project(self.out_proj, out, dropout_key, 3)
