"""Context-parallel attention (``jaxckpt.attention.context_parallel_attention``) on the 8
simulated CPU devices, against ``attention_reference`` on the whole sequence.

Every case runs the forward and the gradients (q, k, v) of a random cotangent, in one
compiled program, with the sequence in the load-balanced zigzag order (causal) or in
contiguous chunks, and compares them to the reference within 1e-5 of the tensor's scale
(fp32): ``max|a - e| <= 1e-5 * max(1, max|e|)``, the issue's bound, tighter than the
kernel suite's table. Sizes are odd where they may be: T = 8 x 12, N = 6 query heads
over K = 2 key/value heads (GQA), H = 8, tiles of 5 x 7 (padded inside each chunk).
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from pairwise_cover import assert_covers_every_pair, grid_params
from tolerances import assert_close

from jaxckpt.attention import (
    COLLECTIVES,
    CONTEXT_PARALLEL_STRATEGIES,
    BlockSizes,
    attention_reference,
    collective_bytes,
    context_parallel_attention,
    from_zigzag,
    to_zigzag,
    zigzag_order,
)
from jaxckpt.attention._masks import classify_tiles, visible
from jaxckpt.attention._validate import MaskArrays, MaskConfig

B, T, N, K, H = 2, 96, 6, 2, 8
BLOCKS = BlockSizes(block_q=5, block_k=7)
BOUND = 1e-5
STRATEGY_NAMES = sorted(CONTEXT_PARALLEL_STRATEGIES)


def _mesh(shape: tuple[int, ...], names: tuple[str, ...]):
    auto = (jax.sharding.AxisType.Auto,) * len(names)
    return jax.make_mesh(shape, names, axis_types=auto, devices=jax.devices()[: int(np.prod(shape))])


def _inputs(kv_heads: int = K, packed: bool = False, seed: int = 0, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(keys[0], (B, T, N, H), dtype)
    k = jax.random.normal(keys[1], (B, T, kv_heads, H), dtype)
    v = jax.random.normal(keys[2], (B, T, kv_heads, H), dtype)
    ct = jax.random.normal(keys[3], (B, T, N, H), dtype)
    seg = None
    if packed:  # documents of random lengths, crossing the devices' chunks
        starts = jax.random.bernoulli(keys[4], 0.08, (B, T)).at[:, 0].set(True)
        seg = jnp.cumsum(starts, axis=1).astype(jnp.int32)
    return q, k, v, ct, seg


def _mesh_of(n: int, batch_axis: "str | None"):
    shape, names = ((2, n), (batch_axis, "seq")) if batch_axis else ((n,), ("seq",))
    return _mesh(shape, names)


@functools.cache
def _parallel(strategy: str, n: int, batch_axis: "str | None", opts: tuple, packed: bool, shapes: tuple):
    """The compiled ``(q, k, v, ct, pos[, seg]) -> (out, dq, dk, dv)`` of context parallelism
    over ``seq=n`` (with ``batch_axis=2`` beside it when given), on arrays already in the
    devices' order (zigzag or contiguous) and split along T: the program's only collectives
    are the strategy's, so the same compiled program is checked for its numbers here and for
    its communication in ``test_ring_...`` and ``test_all_gather_...``.

    ``shapes``: the ``(shape, dtype name)`` of q, k, v, ct, pos and, when packed, seg."""
    options = dict(opts)
    mesh = _mesh_of(n, batch_axis)
    spec = P(batch_axis, "seq")

    def local(q, k, v, pos, *seg):
        return context_parallel_attention(
            q,
            k,
            v,
            pos,
            strategy=strategy,
            segment_ids=seg[0] if seg else None,
            block_sizes=BLOCKS,
            **options,
        )

    sharded = jax.shard_map(local, mesh=mesh, in_specs=(spec,) * (5 if packed else 4), out_specs=spec)

    def run(q, k, v, ct, pos, *seg):
        out, vjp = jax.vjp(lambda q, k, v: sharded(q, k, v, pos, *seg), q, k, v)
        return (out, *vjp(ct))

    split = jax.sharding.NamedSharding(mesh, spec)
    specs = [jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=split) for shape, dtype in shapes]
    return jax.jit(run).lower(*specs).compile()


@functools.cache
def _reference(opts: tuple):
    """The jitted ``(q, k, v, ct, seg) -> (out, dq, dk, dv)`` of ``attention_reference`` on
    the whole sequence, in its own order (shared by both strategies)."""
    options = dict(opts)

    @jax.jit
    def reference(q, k, v, ct, seg):
        out, vjp = jax.vjp(lambda q, k, v: attention_reference(q, k, v, segment_ids=seg, **options), q, k, v)
        return (out, *vjp(ct))

    return reference


def _run_parallel(strategy, n, zigzag, batch_axis, opts, q, k, v, ct, seg):
    """Context parallelism on inputs in the sequence's order: put in the zigzag order
    (``to_zigzag``) or left in contiguous chunks, split along T over the devices, run, and
    the outputs put back in the sequence's order (``from_zigzag``)."""
    order = (lambda x: to_zigzag(x, n)) if zigzag else (lambda x: x)
    back = (lambda x: from_zigzag(x, n)) if zigzag else (lambda x: x)
    pos = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))
    arrays = [q, k, v, ct, pos] + ([] if seg is None else [seg])
    split = jax.sharding.NamedSharding(_mesh_of(n, batch_axis), P(batch_axis, "seq"))
    args = [jax.device_put(order(x), split) for x in arrays]
    shapes = tuple((tuple(x.shape), x.dtype.name) for x in args)
    compiled = _parallel(strategy, n, batch_axis, opts, seg is not None, shapes)
    return [back(x) for x in compiled(*args)]


def _errors(strategy, n=8, zigzag=False, batch_axis=None, kv_heads=K, packed=False, **options):
    q, k, v, ct, seg = _inputs(kv_heads, packed)
    opts = tuple(sorted(options.items()))
    got = _run_parallel(strategy, n, zigzag, batch_axis, opts, q, k, v, ct, seg)
    want = _reference(opts)(q, k, v, ct, seg)
    errors = {}
    for name, a, e in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        a, e = np.asarray(a), np.asarray(e)
        assert a.shape == e.shape, (name, a.shape, e.shape)
        errors[name] = float(np.abs(a - e).max() / max(1.0, np.abs(e).max()))
    return errors


@pytest.mark.parametrize("strategy", STRATEGY_NAMES)
def test_bfloat16_within_the_kernel_tolerances(strategy):
    """bf16 inputs (fp32 accumulators and merges inside): the output and gradients stay
    within the dtype table the single-device kernels are held to, against the fp32
    reference of the same bf16 inputs."""
    q, k, v, ct, seg = _inputs(packed=True, dtype=jnp.bfloat16)
    options = (("is_causal", True),)
    got = _run_parallel(strategy, 8, True, None, options, q, k, v, ct, seg)
    want = _reference(options)(*(x.astype(jnp.float32) for x in (q, k, v, ct)), seg)
    for name, a, e in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert a.dtype == jnp.bfloat16, (name, a.dtype)
        assert_close(a, e, jnp.bfloat16, "fwd" if name == "out" else "grad", name)


def _check(errors):
    bad = {name: err for name, err in errors.items() if not err <= BOUND}
    assert not bad, f"relative errors above {BOUND}: {bad} (all: {errors})"


SEQ8_COVERING = (
    ("ring", True, False),
    ("ring", False, True),
    ("all_gather", False, False),
    ("all_gather", True, True),
    ("all_gather", True, False),
)
"""``(strategy, causal, packed)``: every pair of values of two of the three factors meets in one
of the first four (a pairwise covering of the 2 x 2 x 2 grid); the fifth is the all-gather
program the communication test below reads (compiled anyway; its reference is ring's). The
other three run with ``--grid``; causal and packed together also run in
``test_causal_window_packed_zigzag`` and ``test_bfloat16_within_the_kernel_tolerances``."""


SEQ8_GRID = list(itertools.product(STRATEGY_NAMES, (False, True), (False, True)))


@pytest.mark.parametrize(
    ("strategy", "causal", "packed"),
    grid_params(
        SEQ8_GRID,
        SEQ8_COVERING,
        name=lambda strategy, causal, packed: (
            f"{strategy}-{'causal' if causal else 'full'}-{'packed' if packed else 'rows'}"
        ),
    ),
)
def test_equals_reference_on_seq8(strategy, causal, packed):
    """Ring and all-gather, causal (zigzag order) and not (contiguous chunks), packed rows
    and not: forward and gradients equal the whole-sequence reference."""
    _check(_errors(strategy, zigzag=causal, packed=packed, is_causal=causal))


def test_the_seq8_cases_meet_every_pair_of_values():
    assert_covers_every_pair(SEQ8_COVERING[:4], SEQ8_GRID)
    assert {(s, True, False) for s in STRATEGY_NAMES} <= set(SEQ8_COVERING)  # _compiled_vjp's programs


@pytest.mark.parametrize("strategy", STRATEGY_NAMES)
def test_window_soft_cap_mqa(strategy):
    """A sliding window reaching across chunks in both directions, a soft cap, and MQA
    (one key/value head for six query heads), contiguous chunks."""
    _check(_errors(strategy, kv_heads=1, local_window_size=(17, 4), logits_soft_cap=3.0))


@pytest.mark.parametrize("strategy", STRATEGY_NAMES)
def test_causal_window_packed_zigzag(strategy):
    """Causal with a window and packed documents, in the zigzag order, the positions
    compared across both chunks each device holds."""
    _check(_errors(strategy, zigzag=True, packed=True, is_causal=True, local_window_size=(9, 0)))


@pytest.mark.parametrize("strategy", STRATEGY_NAMES)
def test_seq4_beside_a_data_axis(strategy):
    """``seq=4`` beside a ``data=2`` axis that splits the batch; causal, zigzag order."""
    _check(_errors(strategy, n=4, zigzag=True, batch_axis="data", is_causal=True))


def test_unknown_strategy_and_unbound_axis_are_named():
    q = jnp.ones((1, 4, 2, 8))
    mesh = _mesh((2,), ("seq",))
    spec = P(None, "seq")
    call = lambda strategy, axis: jax.shard_map(
        lambda q: context_parallel_attention(q, q, q, jnp.arange(2), strategy=strategy, axis_name=axis),
        mesh=mesh,
        in_specs=spec,
        out_specs=spec,
    )(q)
    with pytest.raises(ValueError, match="strategy must be one of"):
        call("ulysses", "seq")
    with pytest.raises(ValueError, match="axis_name='sp'"):
        call("ring", "sp")
    with pytest.raises(ValueError, match=r"positions \(query\) must have shape"):
        jax.shard_map(
            lambda q: context_parallel_attention(q, q, q, jnp.arange(3)),
            mesh=mesh,
            in_specs=spec,
            out_specs=spec,
        )(q)


def test_zigzag_round_trip_and_balance():
    """``from_zigzag`` inverts ``to_zigzag``, and under a causal mask every device of the
    zigzag order has the same number of visible (query, key) pairs, unlike contiguous
    chunks, where the last device has 2n - 1 times the first's."""
    x = jnp.arange(3 * 40).reshape(3, 40)
    assert (from_zigzag(to_zigzag(x, 4), 4) == x).all()
    assert sorted(zigzag_order(40, 4).tolist()) == list(range(40))
    n, t = 4, 48
    pos = zigzag_order(t, n).reshape(n, t // n)
    work = [int((pos[i][:, None] >= np.arange(t)[None, :]).sum()) for i in range(n)]
    assert len(set(work)) == 1, work
    contiguous = [int((np.arange(t).reshape(n, -1)[i][:, None] >= np.arange(t)).sum()) for i in range(n)]
    assert contiguous[-1] > 5 * contiguous[0]
    with pytest.raises(ValueError, match="multiple of 2 \\* n = 8"):
        zigzag_order(12, 4)


@pytest.mark.parametrize("window", [None, (5, 2)])
def test_tiles_classified_from_positions(window):
    """The tile classification from explicit positions is conservative: a tile marked
    empty holds no visible pair, a tile marked full holds only visible pairs (checked
    against ``visible`` on every pair, zigzag positions); with positions equal to the
    indices it is the index-based classification."""
    t, s, bq, bk = 24, 24, 5, 7
    cfg = MaskConfig(t=t, s=s, is_causal=True, window=window)
    arrays = MaskArrays(None, None, None, None, None)
    q_pos = jnp.asarray(zigzag_order(48, 2)[:t])[None]
    kv_pos = jnp.asarray(zigzag_order(48, 2)[24:])[None]
    some, every = classify_tiles(cfg, arrays, bq, bk, (q_pos, kv_pos))
    grid = visible(
        cfg, jnp.arange(t)[:, None], jnp.arange(s)[None], q_pos=q_pos[0][:, None], k_pos=kv_pos[0][None]
    )
    nq, nk = -(-t // bq), -(-s // bk)
    padded = jnp.zeros((nq * bq, nk * bk), bool).at[:t, :s].set(grid)
    tiles = padded.reshape(nq, bq, nk, bk).transpose(0, 2, 1, 3)
    assert not (np.asarray(tiles.any((2, 3))) & ~np.asarray(some)).any()
    assert not (np.asarray(every) & ~np.asarray(tiles.all((2, 3)))).any()
    assert not np.asarray(some).all()  # some tiles are skipped
    index = jnp.arange(t, dtype=jnp.int32)[None]
    by_position = classify_tiles(cfg, arrays, bq, bk, (index, index))
    by_index = classify_tiles(cfg, arrays, bq, bk)
    for a, b in zip(by_position, by_index, strict=True):
        np.testing.assert_array_equal(a, b)


def _compiled_vjp(strategy: str, n: int = 8):
    """The compiled forward + VJP of causal context parallelism alone (no segment ids),
    inputs and outputs split along T: the program's only collectives are the strategy's.
    It is the program ``test_equals_reference_on_seq8[<strategy>-causal-rows]`` runs."""
    f32 = jnp.dtype(jnp.float32).name
    shapes = (
        ((B, T, N, H), f32),
        ((B, T, K, H), f32),
        ((B, T, K, H), f32),
        ((B, T, N, H), f32),
        ((B, T), jnp.dtype(jnp.int32).name),
    )
    return _parallel(strategy, n, None, (("is_causal", True),), False, shapes)


def test_ring_passes_each_block_once_around_the_ring():
    """Read from the compiled HLO: the ring forward receives n - 1 blocks of K, V and their
    positions; the backward n - 1 blocks of K, V, positions and the fp32 dK/dV
    accumulators, and the accumulators once more on their way home. Nothing else."""
    n, local = 8, T // 8
    kv, pos = B * local * K * H * 4, B * local * 4
    counted = collective_bytes(_compiled_vjp("ring", n))
    forward = (n - 1) * (2 * kv + pos)
    backward = (n - 1) * (2 * kv + pos + 2 * kv) + 2 * kv
    assert counted.bytes == {**dict.fromkeys(COLLECTIVES, 0), "collective-permute": forward + backward}
    assert counted.unknown_trip_counts == 0


def test_all_gather_gathers_kv_once_and_reduces_their_gradients():
    """The all-gather strategy receives the whole K, V and positions once (the backward
    reuses the gathered K/V its forward saved), and reduces dK/dV back to the shards."""
    counted = collective_bytes(_compiled_vjp("all_gather"))
    gathered, reduced = (2 * K * H + 1) * B * T * 4, 2 * B * (T // 8) * K * H * 4
    expected = {**dict.fromkeys(COLLECTIVES, 0), "all-gather": gathered, "reduce-scatter": reduced}
    assert counted.bytes == expected
    assert counted.ops["all-gather"] == 3 and counted.unknown_trip_counts == 0
