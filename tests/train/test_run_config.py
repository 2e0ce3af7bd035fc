"""``train.RunConfig``: the run as one frozen value beside the model's config. Its checks run
when it is built and name the (dotted) field; ``to_dict`` / ``from_dict`` round trip through
JSON; ``replace`` takes nested dicts; ``train.train`` and ``plan.Workload.from_run`` read the
same value."""

import json
import re

import pytest

from jaxckpt import nn, plan, remat, train

# The sizes of train's own doctest: the one compile here is a persistent-cache neighbour.
CFG = nn.TransformerConfig.preset("tiny", n_layers=1, d_model=32, n_heads=2, ffn_dim=48)
SIZES = dict(steps=1, batch=2, seq=16)


def _run(**fields) -> train.RunConfig:
    return train.RunConfig(**{**SIZES, **fields})


def test_defaults_and_parts_given_as_dicts():
    run = _run(data={"eval_split": 0.25}, checkpoint={"dir": "c", "every": 5})
    assert run.data == train.DataConfig(eval_split=0.25) and run.data.holds_out
    assert run.checkpoint == train.CheckpointConfig(dir="c", every=5)
    assert run.optimizer == train.OptimizerConfig() and run.optimizer.name == "adamw"
    assert (run.micro_batches, run.seed, run.on_nonfinite) == (1, 0, "stop")
    assert (run.remat, run.attention, run.budget, run.mlp_chunk) == ("full", None, None, None)
    assert run.remat_spec == remat.get("full")
    assert _run(remat="auto", budget="1GiB").budget == 2**30


def test_round_trip_through_json_with_nested_parts_and_a_mesh(tmp_path):
    """A ``jax.sharding.Mesh`` is written as its axis sizes, paths as strings; everything
    else comes back equal."""
    run = _run(
        micro_batches=3,
        seed=7,
        data={"path": tmp_path / "d.jsonl", "tokenizer": "bytes", "eval_split": 0.1, "eval_every": 2},
        optimizer=train.OptimizerConfig(name="sgd", moments_dtype="bfloat16", offload=True),
        checkpoint={"dir": tmp_path / "c", "every": 2, "resume": True},
        init_from=tmp_path / "base",
        mesh=train.make_mesh("data=2,fsdp=4"),
        on_nonfinite="skip",
        remat="save_attn",
        attention="xla",
        budget="2GiB",
        mlp_chunk=512,
        progress=False,
    )
    written = json.loads(json.dumps(run.to_dict()))
    assert written["mesh"] == {"data": 2, "fsdp": 4} and written["init_from"] == str(tmp_path / "base")
    assert written["data"]["path"] == str(tmp_path / "d.jsonl")
    assert written["checkpoint"]["dir"] == str(tmp_path / "c")
    back = train.RunConfig.from_dict(written)
    assert back.to_dict() == written
    expected = run.replace(
        init_from=str(tmp_path / "base"),
        mesh={"data": 2, "fsdp": 4},
        data={"path": str(tmp_path / "d.jsonl")},
        checkpoint={"dir": str(tmp_path / "c")},
    )
    assert back == expected and back.optimizer == run.optimizer


def test_round_trip_of_a_custom_remat_spec():
    spec = remat.RematSpec(save=frozenset({remat.Tag.ATTN_OUT}), layers_per_checkpoint=2)
    run = _run(remat=spec)
    written = json.loads(json.dumps(run.to_dict()))
    assert written["remat"]["save"] == ["attn_out"]  # tags by name: a file a person can edit
    back = train.RunConfig.from_dict(written)
    assert back.remat_spec == spec


def test_a_bad_tag_in_a_written_remat_spec_is_named():
    with pytest.raises(ValueError, match=r"RunConfig.remat: 'nope' is not a valid Tag"):
        train.RunConfig.from_dict({"steps": 1, "batch": 1, "seq": 8, "remat": {"save": ["nope"]}})


@pytest.mark.parametrize(
    ("fields", "error", "message"),
    [
        ({"foo": 1}, ValueError, "RunConfig: unknown field(s) ['foo']"),
        ({"data": {"foo": 1}}, ValueError, "RunConfig.data: unknown field(s) ['foo']"),
        (
            {"checkpoint": {"dir": "c", "foo": 1}},
            ValueError,
            "RunConfig.checkpoint: unknown field(s) ['foo']",
        ),
        ({"optimizer": {"lr": 1.0}}, ValueError, "RunConfig.optimizer: unknown field(s) ['lr']"),
        ({"data": ["x.txt"]}, TypeError, "RunConfig: data must be a DataConfig or its dict, got list"),
    ],
)
def test_unknown_fields_name_the_part(fields, error, message):
    with pytest.raises(error, match=re.escape(message)):
        train.RunConfig.from_dict({**SIZES, **fields})


def test_from_dict_takes_a_mapping():
    with pytest.raises(TypeError, match=r"RunConfig: expected a mapping of fields, got list"):
        train.RunConfig.from_dict([("steps", 1)])


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(steps=0), "steps=0 must be a positive int"),
        (dict(batch=0), "batch=0 must be a positive int"),
        (dict(seq=-1), "seq=-1 must be a positive int"),
        (dict(micro_batches=True), "micro_batches=True must be a positive int"),
        (dict(seed="x"), "seed='x' must be an int"),
        (dict(checkpoint={"resume": True}), "checkpoint.resume=True needs checkpoint.dir="),
        (dict(checkpoint={"dir": "c", "every": 0}), "checkpoint.every=0 must be a positive int"),
        (
            dict(data={"eval_every": 2}),
            "data.eval_every=2 needs held-out data: give data.eval_path= or data.eval_split=",
        ),
        (
            dict(data={"eval_path": "held.txt", "eval_split": 0.1}),
            "data.eval_path= and data.eval_split= are two ways to hold data out: give one",
        ),
        (dict(data={"eval_split": 1.5}), "data.eval_split=1.5 must lie strictly between 0 and 1"),
        (dict(data={"eval_split": 0.1, "eval_every": 0}), "data.eval_every=0 must be a positive int"),
        (dict(data={"shuffle_buffer": 0}), "data.shuffle_buffer=0 must be a positive int"),
        (dict(remat="auto"), "remat='auto' needs budget= (bytes, or e.g. '30GiB')"),
        (dict(remat="everything"), "unknown remat preset 'everything'"),
        (dict(on_nonfinite="halt"), "on_nonfinite='halt' must be 'stop' or 'skip'"),
        (dict(budget="lots"), "budget 'lots' is not understood"),
        (dict(mlp_chunk=0), "mlp_chunk=0 must be a positive int"),
        (dict(optimizer={"name": "lion"}), "name='lion' is not one of adamw, adafactor, sgd"),
    ],
)
def test_each_check_runs_at_construction_and_names_its_field(fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        _run(**fields)
    with pytest.raises(ValueError, match=re.escape(message)):  # replace checks too
        _run().replace(**fields)


def test_replace_takes_nested_dicts_of_changes():
    run = _run(checkpoint={"dir": "c", "every": 5}, optimizer={"name": "sgd", "learning_rate": 0.1})
    resumed = run.replace(steps=4, checkpoint={"resume": True}, optimizer={"momentum": 0.5})
    assert resumed.checkpoint == train.CheckpointConfig(dir="c", every=5, resume=True)
    assert resumed.optimizer == train.OptimizerConfig(name="sgd", learning_rate=0.1, momentum=0.5)
    assert (resumed.steps, resumed.data) == (4, run.data)
    assert (run.steps, run.checkpoint.resume) == (1, False)  # frozen: the original is unchanged
    assert run.replace(checkpoint=train.CheckpointConfig()).checkpoint.dir is None  # a whole part replaces
    assert run.replace(data={"eval_split": 0.2, "eval_every": 2}).data.eval_every == 2


def test_train_takes_a_model_config_and_a_run_config():
    with pytest.raises(TypeError, match=r"train: run must be a train\.RunConfig, got dict"):
        train.train(CFG, dict(SIZES))
    with pytest.raises(TypeError, match=r"train: model_config must be a TransformerConfig, got RunConfig"):
        train.train(_run(), CFG)


def test_train_and_the_planner_read_the_same_run():
    """``train.train(cfg, run)`` trains with the very optimizer, attention and remat that
    ``plan.Workload.from_run(cfg, run)`` plans for."""
    run = _run(
        optimizer=train.OptimizerConfig(name="sgd"), attention="xla", remat="save_attn", progress=False
    )
    result = train.train(CFG, run)
    workload = plan.Workload.from_run(CFG, run)
    assert result.trainer.optimizer is run.optimizer is workload.optimizer
    assert result.trainer.model.blocks.attn.implementation == workload.attention == "xla"
    assert result.trainer.spec == run.remat_spec == remat.get("save_attn")
    assert workload == plan.Workload(CFG, run.batch, run.seq, optimizer=run.optimizer, attention="xla")


def test_the_runs_mlp_chunk_tiles_the_model_it_trains_and_plans():
    run = _run(mlp_chunk=4)
    assert run.model_config(CFG) == CFG.replace(mlp_chunk=4)
    assert plan.Workload.from_run(CFG, run).config.mlp_chunk == 4
    assert _run().model_config(CFG) is CFG  # None: the model config's own choice


def test_a_per_layer_spec_round_trips_through_its_written_form_or_is_refused_by_name():
    """``remat.Layered`` (``plan_memory(per_layer=True)``'s answer) is written as its groups, in
    JSON and YAML (``--print-config``'s format) alike, and read back equal, compression
    included; a malformed group, or a Layered spec spelled as a name (a run file's ``--remat``
    takes a preset name), is refused naming the field."""
    import yaml

    spec = remat.Layered(((2, "save_attn"), (3, remat.RematSpec(save=frozenset({remat.Tag.MLP_UP})))))
    run = _run(remat=spec, compress="int8")
    written = run.to_dict()
    assert [g["layers"] for g in written["remat"]["groups"]] == [2, 3]
    assert written["remat"]["groups"][1]["save"] == ["mlp_up"]  # tags by name
    assert train.RunConfig.from_dict(json.loads(json.dumps(written))) == run
    back = train.RunConfig.from_dict({**SIZES, "remat": yaml.safe_load(yaml.safe_dump(written["remat"]))})
    assert back.remat == spec and _run(remat=back.remat, compress="int8").remat_spec == run.remat_spec
    assert run.remat_spec == remat.compressed(spec, "int8")
    bad = [
        ({"groups": [{"save": []}]}, r"RunConfig.remat.groups\[0\] must be a dict with 'layers'"),
        ({"groups": [{"layers": 0}]}, r"RunConfig.remat: Layered.groups\[0\]: count must be an int >= 1"),
        ({"groups": [{"layers": 2, "save": ["nope"]}]}, r"RunConfig.remat: 'nope' is not a valid Tag"),
        ({"groups": "2 x full"}, r"RunConfig.remat.groups must be a list"),
        ({"groups": [], "save": []}, r"a per-layer spec has only 'groups'; unknown: save"),
    ]
    for remat_field, message in bad:
        with pytest.raises(ValueError, match=message):
            train.RunConfig.from_dict({**SIZES, "remat": remat_field})
    with pytest.raises(ValueError, match=r"unknown remat preset '2 x save_attn \+ 3 x full'"):
        _run(remat="2 x save_attn + 3 x full")
