"""Data parallel + FSDP on the 8 CPU devices of the test process (``tests/conftest.py``),
against the single-device run, and the planner's per-device figures against XLA's and a
real sharded trainer's.

Each trainer is built and compiled once per module (``_run`` is cached), so the tests
that read the same run share it.
"""

import functools

import jax
import numpy as np
import pytest
from flax import nnx

from jaxckpt import nn, plan, remat, train
from jaxckpt.cli import main

CFG = nn.TransformerConfig.preset("tiny", n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, ffn_dim=96)
BATCH, SEQ, STEPS = 8, 16, 3
MESHES = ("data=2,fsdp=4", "fsdp=8")


@functools.cache
def _batches() -> train.ByteBatches:
    return train.ByteBatches(train.load_tokens(None), BATCH, SEQ, seed=0)


@functools.cache
def _run(mesh: str | None, preset: str = "full", steps: int = STEPS) -> tuple[list[float], train.Trainer]:
    """``steps`` losses of the tiny model on ``mesh`` (None: one device) under ``preset``."""
    built = None if mesh is None else train.make_mesh(mesh)
    trainer = train.Trainer(nn.Transformer(CFG, rngs=nnx.Rngs(0)), mesh=built, remat=preset)
    return [float(trainer.step(_batches().batch_at(i))) for i in range(steps)], trainer


def _total_bytes() -> int:
    return sum(leaf.nbytes for leaf in jax.tree.leaves(_run(None)[1].state))


def test_the_process_has_eight_devices():
    assert len(jax.devices()) == 8


@pytest.mark.slow
@pytest.mark.parametrize("mesh", MESHES)
def test_sharded_losses_match_one_device(mesh):
    single, sharded = _run(None)[0], _run(mesh)[0]
    assert float(np.abs(np.array(sharded) - np.array(single)).max()) <= 1e-5, (mesh, sharded, single)


@pytest.mark.slow
@pytest.mark.parametrize(("mesh", "ways"), [("fsdp=8", 8), ("data=2,fsdp=4", 4)])
def test_state_is_really_split(mesh, ways):
    trainer = _run(mesh)[1]
    # The state leaves that no fsdp size divides (scalars, small vectors) stay whole.
    assert max(train.bytes_per_device(trainer.state).values()) <= _total_bytes() / ways * 1.02
    kernel = trainer.state[0]["blocks"]["mlp"]["up"]["kernel"].get_value()
    assert "fsdp" in str(kernel.sharding.spec)


@pytest.mark.slow
@pytest.mark.parametrize(
    "preset",
    [
        p
        for p in remat.PRESETS
        if p != "full" and (train.offload_saves_memory() or not remat.PRESETS[p].offload)
    ],
)
def test_every_remat_preset_runs_sharded(preset):
    """Remat does not change the numbers: every preset's first loss is the single-device one."""
    loss = _run("data=2,fsdp=4", preset, steps=1)[0][0]
    assert loss == pytest.approx(_run(None)[0][0], abs=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize(("devices", "preset"), [(2, "full"), (8, "none"), (8, "full"), (8, "save_attn")])
def test_per_device_prediction_matches_xla(devices, preset):
    """Predicted / XLA's per-device peak, on a model whose activations matter (as users' do)."""
    workload = plan.Workload(nn.TransformerConfig.preset("tiny"), 8, 128, devices=devices)
    ratio = plan.predict(workload, preset).total / plan.measure(workload, preset).peak
    assert 0.9 <= ratio <= 1.1, ratio


@pytest.mark.slow
def test_planned_state_is_what_a_sharded_trainer_holds():
    measured = plan.measure(plan.Workload(CFG, BATCH, SEQ, devices=8), "full")
    trainer = _run("fsdp=8")[1]
    params = nnx.state(trainer.model, nnx.Param)
    assert measured.params == max(train.bytes_per_device(params).values())
    planned_state = measured.params + measured.optimizer
    assert planned_state <= max(train.bytes_per_device(trainer.state).values()) <= planned_state + 64


@pytest.mark.slow
def test_remat_auto_on_an_fsdp_mesh_plans_per_device_and_trains_what_it_measured():
    """Half-way between XLA's per-device peaks of full remat and none."""
    workload = plan.Workload(CFG, BATCH, SEQ, devices=8)
    budget = (plan.measure(workload, "full").peak + plan.measure(workload, "none").peak) // 2
    run = train.RunConfig(
        steps=1, batch=BATCH, seq=SEQ, mesh="fsdp=8", progress=False, remat="auto", budget=budget
    )
    resolved, auto = plan.resolve_auto(CFG, run)
    assert auto.devices == 8 and auto.measured.peak <= budget and resolved.remat == auto.spec
    assert resolved == run.replace(remat=auto.spec)  # the rest of the run as given
    # the chosen spec as compiled over the 8 devices
    assert [m for s, _, m in auto.attempts if s == auto.spec] == [auto.measured]
    run = train.train(CFG, resolved, plan=auto)
    assert run.plan is auto and run.memory.peak == auto.measured.peak <= budget


def test_remat_auto_refuses_a_mesh_with_a_data_axis():
    auto = train.RunConfig(steps=1, batch=BATCH, seq=SEQ, mesh="data=2,fsdp=4", remat="auto", budget="1GiB")
    with pytest.raises(ValueError, match="plans per device for FSDP meshes"):
        plan.resolve_auto(CFG, auto)


def test_mesh_arguments_are_checked():
    assert train.parse_mesh("fsdp=2") == {"fsdp": 2}
    for bad, match in (
        ("tensor=2", "unknown axis 'tensor'"),
        ("data=0", "positive integer"),
        ("data=2,data=2", "twice"),
    ):
        with pytest.raises(ValueError, match=match):
            train.parse_mesh(bad)
    with pytest.raises(ValueError, match="needs 16 devices; this process sees 8"):
        train.make_mesh("data=2,fsdp=8")


def test_cli_mesh_larger_than_the_devices_is_a_clear_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--mesh", "data=16", "--steps", "1", "--json"])
    assert exit_info.value.code == 2
    assert "--mesh 'data=16' needs 16 devices; this process sees 8" in capsys.readouterr().err


def test_logical_axis_rules_place_every_parameter():
    """Every parameter the modules create names its axes; the layer axis is never split."""
    cfg = nn.TransformerConfig.preset("gpt2", n_layers=3, d_model=16, n_heads=2, ffn_dim=24, vocab_size=11)
    model = nn.Transformer(cfg, rngs=nnx.Rngs(0))
    mesh = train.make_mesh({"fsdp": 1}, devices=jax.devices()[:1])
    for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        names = nn.logical_axes(variable)
        assert None not in names, path
        assert len(names) == variable.get_value().ndim, path
        spec = tuple(train.leaf_spec(variable.get_value().shape, mesh, names))
        if names[0] == "layers":
            assert spec[0] is None, path
    # the stacked axis is the largest here, yet the split goes to the embedding axis
    assert tuple(train.leaf_spec((64, 8), mesh, ("layers", "embed"))) == (None, "fsdp")
    with pytest.raises(ValueError, match="logical names"):
        train.leaf_spec((64, 8), mesh, ("embed",))
