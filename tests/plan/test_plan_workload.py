"""``plan.Workload``: validation naming the field, hashing, JSON round trip, per-device sizes,
and ``Workload.from_run``: the step ``train.train(model_config, run)`` runs."""

import dataclasses
import json

import pytest

from jaxckpt import nn, plan, train

CONFIG = nn.TransformerConfig.preset("tiny", n_layers=3, d_model=30, n_heads=5, n_kv_heads=1, ffn_dim=22)


def test_per_device_quantities_come_from_the_global_batch():
    w = plan.Workload(CONFIG, batch=15, seq=7, micro_batches=3, devices=5)
    assert (w.local_batch, w.local_tokens) == (3, 21)
    assert w.input_shape == (3, 15, 8)  # the global input the step is compiled with
    assert w.input_bytes == 3 * 3 * 8 * 4  # one device's share, int32
    assert w.mesh_shape == {"data": 1, "fsdp": 5}


def test_frozen_hashable_and_replace_validates():
    w = plan.Workload(CONFIG, 3, 7)
    adamw = train.OptimizerConfig(name="adamw")
    assert w == plan.Workload(
        CONFIG, batch=3, seq=7, micro_batches=1, optimizer=adamw, devices=1, attention=None
    )
    assert len({w, plan.Workload(CONFIG, 3, 7), w.replace(seq=9)}) == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        w.batch = 5
    with pytest.raises(ValueError, match="Workload: batch=3 must be a multiple of devices=5"):
        w.replace(devices=5)


@pytest.mark.parametrize(
    ("fields", "error", "match"),
    [
        (dict(batch=0), ValueError, r"Workload: batch=0 must be a positive int"),
        (dict(seq=-7), ValueError, r"Workload: seq=-7 must be a positive int"),
        (dict(micro_batches=True), ValueError, r"Workload: micro_batches=True must be a positive int"),
        (dict(devices=1.0), ValueError, r"Workload: devices=1.0 must be a positive int"),
        (
            dict(optimizer="sgd"),
            TypeError,
            r"Workload: optimizer must be a train\.OptimizerConfig, got 'sgd'",
        ),
        (
            dict(optimizer=train.OptimizerConfig(offload_master=True)),
            ValueError,
            r"Workload: optimizer\.offload_master=True needs fp32 master weights",
        ),
        (dict(batch=3, devices=5), ValueError, r"batch=3 must be a multiple of devices=5: FSDP"),
        (dict(config={"d_model": 30}), TypeError, r"Workload: config must be a TransformerConfig, got dict"),
    ],
)
def test_bad_fields_are_named_with_their_values(fields, error, match):
    with pytest.raises(error, match=match):
        plan.Workload(**{**dict(config=CONFIG, batch=15, seq=7), **fields})


def test_json_round_trip():
    config = CONFIG.replace(param_dtype="bfloat16")
    sgd = train.OptimizerConfig(name="sgd", moments_dtype="bfloat16", offload=True)
    w = plan.Workload(config, 15, 7, micro_batches=3, optimizer=sgd, devices=5, attention="xla")
    assert plan.Workload.from_dict(json.loads(json.dumps(w.to_dict()))) == w
    with pytest.raises(ValueError, match=r"Workload: unknown field\(s\) \['lora'\]"):
        plan.Workload.from_dict({**w.to_dict(), "lora": 8})


def test_on_mesh_takes_fsdp_and_refuses_a_data_axis():
    assert plan.Workload.on_mesh(CONFIG, 8, 7, None).devices == 1
    assert plan.Workload.on_mesh(CONFIG, 8, 7, "fsdp=4").devices == 4
    sgd = train.OptimizerConfig(name="sgd")
    assert plan.Workload.on_mesh(CONFIG, 8, 7, {"fsdp": 2, "data": 1}, optimizer=sgd).devices == 2
    assert plan.Workload.on_mesh(CONFIG, 8, 7, train.make_mesh("fsdp=8")).devices == 8
    with pytest.raises(ValueError, match=r"plans per device for FSDP meshes .*mesh=\{'data': 2, 'fsdp': 4\}"):
        plan.Workload.on_mesh(CONFIG, 8, 7, train.make_mesh("data=2,fsdp=4"))


def test_every_entry_point_reads_the_local_batch():
    """Over D devices one device runs B / D sequences: the layer graph, the FLOPs and the
    activations are those of the single-device workload with that batch."""
    sharded, alone = plan.Workload(CONFIG, 6, 16, devices=3), plan.Workload(CONFIG, 2, 16)
    assert plan.layer_graph(sharded) == plan.layer_graph(alone)
    assert plan.step_flops(sharded) == plan.step_flops(alone)
    assert plan.choice(sharded, "full").recompute_flops == plan.choice(alone, "full").recompute_flops
    assert plan.predict(sharded, "full").inputs == plan.predict(alone, "full").inputs
    assert plan.state_bytes(sharded)[0] < plan.state_bytes(alone)[0]


def test_from_run_is_the_step_train_runs():
    """The run's sizes, mesh, attention and the very optimizer object it trains with."""
    sgd = train.OptimizerConfig(name="sgd", moments_dtype="bfloat16", offload=True)
    run = train.RunConfig(
        steps=4, batch=8, seq=7, micro_batches=3, mesh="fsdp=2", optimizer=sgd, attention="xla"
    )
    w = plan.Workload.from_run(CONFIG, run)
    assert w == plan.Workload(CONFIG, 8, 7, micro_batches=3, optimizer=sgd, devices=2, attention="xla")
    assert w.optimizer is run.optimizer and (w.optimizer.name, w.optimizer.offload) == ("sgd", True)
    assert plan.Workload.from_run(CONFIG, run.replace(mesh=None)).devices == 1


def test_from_run_plans_the_skip_of_on_nonfinite_skip():
    """``on_nonfinite="skip"`` trains with the in-step skip (a select that costs memory)."""
    run = train.RunConfig(steps=1, batch=2, seq=7)
    assert plan.Workload.from_run(CONFIG, run).optimizer.skip_nonfinite is None
    skipping = plan.Workload.from_run(CONFIG, run.replace(on_nonfinite="skip"))
    assert skipping.optimizer.skip_nonfinite is True
    assert skipping.optimizer == dataclasses.replace(run.optimizer, skip_nonfinite=True)


def test_from_run_takes_a_run_config_only():
    with pytest.raises(TypeError, match=r"Workload\.from_run: run must be a train\.RunConfig, got dict"):
        plan.Workload.from_run(CONFIG, {"steps": 1, "batch": 2, "seq": 7})
    run = train.RunConfig(steps=1, batch=8, seq=7, mesh="data=2,fsdp=4")
    with pytest.raises(ValueError, match=r"plans per device for FSDP meshes"):
        plan.Workload.from_run(CONFIG, run)


def test_remat_auto_is_resolved_before_train_which_refuses_it():
    auto = train.RunConfig(steps=1, batch=2, seq=7, progress=False, remat="auto", budget="1GiB")
    with pytest.raises(ValueError, match=r"resolved by the planner before training: .*plan\.resolve_auto"):
        train.train(CONFIG, auto)
    with pytest.raises(ValueError, match=r"remat=auto plans per device for FSDP meshes"):
        plan.resolve_auto(CONFIG, auto.replace(batch=8, mesh="data=2,fsdp=4"))
    with pytest.raises(ValueError, match="needs 16 devices; this process sees 8"):
        plan.resolve_auto(CONFIG, auto.replace(batch=16, mesh="fsdp=16"))
    fixed = auto.replace(remat="save_attn")
    assert plan.resolve_auto(CONFIG, fixed) == (fixed, None)  # nothing to resolve
