"""Context parallelism in training: a ``seq`` mesh axis splits every row along T (in the
zigzag order) and the attention runs across the shards. Five steps of a tiny LoRA model
on ``fsdp=2,seq=4`` and on ``seq=8`` have the losses of one device (fp32, 1e-5), for
both strategies, on token windows and on packed rows; and with remat presets, QLoRA and
the tiled MLP.

Each trainer is built, compiled and run once per module (``_losses`` is cached). The
mesh x strategy x batch grid runs a pairwise covering design (4 of its 8 cases); ``pytest
--grid`` runs all 8.
"""

import functools
import itertools

import jax
import numpy as np
import pytest
from flax import nnx
from pairwise_cover import assert_covers_every_pair, grid_params

from jaxckpt import nn, train
from jaxckpt import remat as remat_presets
from jaxckpt.attention import collective_bytes, zigzag_order
from jaxckpt.data import PackedBatch
from jaxckpt.train._sharding import activation_rules
from jaxckpt.train._step import zigzag_batch

CFG = nn.TransformerConfig.preset(
    "tiny",
    n_layers=2,
    d_model=48,
    n_heads=6,
    n_kv_heads=2,
    head_dim=8,
    ffn_dim=40,
    vocab_size=256,  # byte tokens
    max_len=64,
    dtype="float32",
    lora=nn.LoraConfig(rank=3),
)
BATCH, SEQ, STEPS = 2, 48, 5
BOUND = 1e-5


def _packed(step: int) -> PackedBatch:
    """One micro-batch of BATCH rows of SEQ slots: documents of random lengths (crossing
    the shards), positions restarting in each, padding at the end of each row."""
    rng = np.random.default_rng(step)
    fields = {name: np.zeros((1, BATCH, SEQ), np.int32) for name in PackedBatch._fields}
    fields["weights"] = np.zeros((1, BATCH, SEQ), np.float32)
    for row in range(BATCH):
        at, segment = 0, 1
        while at < SEQ - 6:
            n = int(rng.integers(3, 17))
            n = min(n, SEQ - 3 - at)
            doc = rng.integers(1, CFG.vocab_size, n + 1)
            fields["inputs"][0, row, at : at + n] = doc[:-1]
            fields["targets"][0, row, at : at + n] = doc[1:]
            fields["weights"][0, row, at : at + n] = 1.0
            fields["segment_ids"][0, row, at : at + n] = segment
            fields["positions"][0, row, at : at + n] = np.arange(n)
            at, segment = at + n, segment + 1
    return PackedBatch(**fields)


@functools.cache
def _windows(step: int) -> np.ndarray:
    return train.ByteBatches(train.load_tokens(None), BATCH, SEQ, seed=0).batch_at(step)


@functools.cache
def _run(
    mesh: "str | None",
    strategy: str = "all_gather",
    packed: bool = False,
    remat: str = "full",
    config: nn.TransformerConfig = CFG,
):
    """STEPS losses of the tiny LoRA model (or ``config``) on ``mesh`` (None: one device),
    and the communication of its compiled step."""
    built = None if mesh is None else train.make_mesh(mesh, devices=jax.devices()[: _size(mesh)])
    model = nn.Transformer(config, rngs=nnx.Rngs(0))
    trainer = train.Trainer(model, mesh=built, remat=remat, context_parallel=strategy)
    batch = _packed if packed else _windows
    losses = np.array([float(trainer.step(batch(i))) for i in range(STEPS)])
    return losses, collective_bytes(trainer.compile(batch(0)))


def _losses(*args, **kwargs) -> np.ndarray:
    return _run(*args, **kwargs)[0]


def _size(mesh: str) -> int:
    return int(np.prod(list(train.parse_mesh(mesh).values())))


MESHES, STRATEGIES, BATCHES = ("fsdp=2,seq=4", "seq=8"), ("all_gather", "ring"), (False, True)


FULL_GRID = list(itertools.product(MESHES, STRATEGIES, BATCHES))
COVERING = [
    (MESHES[i], STRATEGIES[j], BATCHES[k])
    for i, j, k in itertools.product(range(2), repeat=3)
    if (i + j + k) % 2 == 0
]
"""mesh x strategy x (windows, packed): ``make test`` runs the 4 cases whose three indices add
up to an even number (every pair of values of two factors meets in one of them); the other 4
are marked ``grid`` (``pytest --grid``)."""
GRID = grid_params(
    FULL_GRID,
    COVERING,
    name=lambda mesh, strategy, packed: f"{mesh}-{strategy}-{'packed' if packed else 'windows'}",
)


@pytest.mark.slow
@pytest.mark.parametrize(("mesh", "strategy", "packed"), GRID)
def test_losses_equal_one_device(mesh, strategy, packed):
    single, (split, comm) = _losses(None, packed=packed), _run(mesh, strategy, packed)
    assert single[-1] < single[0]  # it trains
    assert float(np.abs(split - single).max()) <= BOUND, (split, single)
    if strategy == "ring":  # the attention really ran across the shards, as a ring
        assert comm.bytes["collective-permute"] > 0, comm


def test_the_covering_design_meets_every_pair_of_values():
    """``make test``'s cases of ``test_losses_equal_one_device`` hold every pair of values of
    any two of its factors (so every value too)."""
    assert len(COVERING) == 4
    assert_covers_every_pair(COVERING, FULL_GRID)


PRESETS = [p for p in ("save_attn", "none", "offload_full") if p in remat_presets.PRESETS]
"""Remat presets composed with the ring (``offload_full``: once the boundary offload lands)."""


@pytest.mark.slow
@pytest.mark.parametrize("remat", PRESETS)
def test_composes_with_remat_presets(remat):
    """Against the one-device run of the module (full remat): remat does not change the
    numbers, so one reference serves every preset, and the claim is the stronger one that
    the split run under each preset has the losses of the one-device run."""
    single, split = _losses(None), _losses("fsdp=2,seq=4", "ring", remat=remat)
    assert float(np.abs(split - single).max()) <= BOUND, (split, single)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("strategy", "changes"),
    [("ring", dict(quantize_base="nf4")), ("all_gather", dict(mlp_chunk=8))],
    ids=["qlora-nf4-ring", "tiled-mlp-all_gather"],
)
def test_composes_with_qlora_and_the_tiled_mlp(strategy, changes):
    config = CFG.replace(**changes)
    single, split = _losses(None, config=config), _losses("fsdp=2,seq=4", strategy, config=config)
    assert float(np.abs(split - single).max()) <= BOUND, (split, single)


def test_seq_axis_in_the_mesh_and_rules():
    assert train.parse_mesh("data=1,fsdp=2,seq=4") == {"data": 1, "fsdp": 2, "seq": 4}
    mesh = train.make_mesh("fsdp=2,seq=4", devices=jax.devices())
    assert dict(mesh.shape) == {"data": 1, "fsdp": 2, "seq": 4}
    assert activation_rules(mesh) == {"batch": ("data", "fsdp"), "seq": "seq"}
    assert dict(train.make_mesh("fsdp=8").shape) == {"data": 1, "fsdp": 8}  # no seq unless asked
    with pytest.raises(ValueError, match="multiple of the mesh's 2 devices"):
        train.Trainer(nn.Transformer(CFG, rngs=nnx.Rngs(0)), mesh=mesh).compile((1, 3, SEQ + 1))
    with pytest.raises(ValueError, match="context_parallel must be one of"):
        train.Trainer(nn.Transformer(CFG, rngs=nnx.Rngs(0)), context_parallel="ulysses")


def test_zigzag_batch_keeps_each_target_with_its_input():
    windows = _windows(0)
    ordered = zigzag_batch(windows, 4)
    order = zigzag_order(SEQ, 4)
    np.testing.assert_array_equal(ordered.inputs, windows[..., :-1][..., order])
    np.testing.assert_array_equal(ordered.targets, windows[..., 1:][..., order])
    np.testing.assert_array_equal(ordered.positions[0, 0], order)
    assert ordered.segment_ids is None and float(ordered.weights.min()) == 1.0
    packed = zigzag_batch(_packed(0), 4)
    np.testing.assert_array_equal(packed.segment_ids, _packed(0).segment_ids[..., order])
    with pytest.raises(ValueError, match="seq=40 must be a multiple of 2 x the mesh's seq=8"):
        zigzag_batch(windows[..., :41], 8)


def test_run_config_names_the_context_parallel_strategy():
    assert train.RunConfig(steps=1, batch=1, seq=8, context_parallel="ring").context_parallel == "ring"
    with pytest.raises(ValueError, match="context_parallel must be one of all_gather, ring; got 'zigzag'"):
        train.RunConfig(steps=1, batch=1, seq=8, context_parallel="zigzag")


def test_cli_context_parallel_flag_reaches_the_run():
    from jaxckpt.cli._main import build_parser
    from jaxckpt.cli._train import train_run

    args = build_parser().parse_args(["train", "--mesh", "fsdp=2,seq=4", "--context-parallel", "ring"])
    run = train_run(args)
    assert run.context_parallel == "ring" and run.mesh == "fsdp=2,seq=4"
