"""``plan.Workload``: validation naming the field, hashing, JSON round trip, per-device sizes."""

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
    assert w == plan.Workload(CONFIG, batch=3, seq=7, micro_batches=1, optimizer="adamw", devices=1)
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
        (dict(optimizer="lion"), ValueError, r"Workload: optimizer='lion' is unknown; valid: adamw"),
        (dict(batch=3, devices=5), ValueError, r"batch=3 must be a multiple of devices=5: FSDP"),
        (dict(config={"d_model": 30}), TypeError, r"Workload: config must be a TransformerConfig, got dict"),
    ],
)
def test_bad_fields_are_named_with_their_values(fields, error, match):
    with pytest.raises(error, match=match):
        plan.Workload(**{**dict(config=CONFIG, batch=15, seq=7), **fields})


def test_json_round_trip():
    config = CONFIG.replace(param_dtype="bfloat16")
    w = plan.Workload(config, 15, 7, micro_batches=3, optimizer="sgd", devices=5)
    assert plan.Workload.from_dict(json.loads(json.dumps(w.to_dict()))) == w
    with pytest.raises(ValueError, match=r"unknown fields \['lora'\]"):
        plan.Workload.from_dict({**w.to_dict(), "lora": 8})


def test_on_mesh_takes_fsdp_and_refuses_a_data_axis():
    assert plan.Workload.on_mesh(CONFIG, 8, 7, None).devices == 1
    assert plan.Workload.on_mesh(CONFIG, 8, 7, "fsdp=4").devices == 4
    assert plan.Workload.on_mesh(CONFIG, 8, 7, {"fsdp": 2, "data": 1}, optimizer="sgd").devices == 2
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


def test_remat_auto_is_resolved_before_train_which_refuses_it():
    auto = CONFIG.replace(remat="auto", budget="1GiB")
    with pytest.raises(ValueError, match=r"resolved by the planner before training: .*plan\.resolve_auto"):
        train.train(auto, steps=1, batch=2, seq=7, progress=False)
    with pytest.raises(ValueError, match=r"remat=auto plans per device for FSDP meshes"):
        plan.resolve_auto(auto, batch=8, seq=7, mesh="data=2,fsdp=4")
    with pytest.raises(ValueError, match="needs 16 devices; this process sees 8"):
        plan.resolve_auto(auto, batch=16, seq=7, mesh="fsdp=16")
