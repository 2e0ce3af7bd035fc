"""FP32 master weights in host memory (``OptimizerConfig(offload_master=True)``): the step
computes with 16-bit device copies, the update streams master by master, and the planner
compiles and prices that step."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import SingleDeviceSharding

from jaxckpt import nn, plan, train
from jaxckpt.cli import main
from jaxckpt.data import Example, pack_documents
from jaxckpt.train._master import compute_copies, update_masters
from jaxckpt.train._transforms import clip_by_global_norm

BF16 = nn.TransformerConfig.preset(
    "tiny", n_layers=2, d_model=48, n_heads=3, n_kv_heads=1, ffn_dim=80, dtype="bfloat16"
)
BATCH = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 3, 17)), jnp.int32)  # 2 micro-batches


def _trainer(offload_master: bool, offload: bool = False) -> train.Trainer:
    settings = train.OptimizerConfig(offload_master=offload_master, offload=offload, warmup_steps=0)
    return train.Trainer(nn.Transformer(BF16, rngs=nnx.Rngs(0)), optimizer=settings)


def _params(trainer):
    return jax.tree.map(np.asarray, nnx.as_pure(nnx.state(trainer.model, nnx.Param)))


@functools.cache
def _four_steps(offload_master: bool, offload: bool = False) -> tuple[train.Trainer, list[float]]:
    """A trainer after four steps on ``BATCH`` and its losses, built once per module: both
    host routes compare with the one device route, and the evaluator test reads a trained
    host-master model."""
    trainer = _trainer(offload_master, offload)
    return trainer, [float(trainer.step(BATCH)) for _ in range(4)]


@pytest.mark.slow
@pytest.mark.parametrize("offload", [False, True], ids=["state-on-device", "state-on-host"])
def test_masters_stay_float32_in_host_memory_and_train_as_on_the_device(offload):
    """The first loss is the device route's bit for bit; later ones differ by the 16-bit
    rounding of the weight gradients (XLA:CPU keeps those in float32 on the device route)."""
    (device, on_device), (host, on_host) = _four_steps(False), _four_steps(True, offload)
    losses = {"device": on_device, "host": on_host}
    assert losses["host"][0] == losses["device"][0]
    np.testing.assert_allclose(losses["host"], losses["device"], rtol=1e-3)
    assert losses["host"][-1] < losses["host"][0]
    for leaf in jax.tree.leaves(nnx.state(host.model, nnx.Param)):
        assert leaf.dtype == jnp.float32 and leaf.sharding.memory_kind == "pinned_host"
    # AdamW moves a weight by about the learning rate a step, whatever the gradient's size:
    # a near-zero gradient rounded differently can move it the other way. On average the
    # two routes stay far closer than that.
    lr = host.optimizer.learning_rate
    for a, b in zip(jax.tree.leaves(_params(host)), jax.tree.leaves(_params(device)), strict=True):
        np.testing.assert_allclose(a, b, atol=4 * 2 * lr)
        assert np.mean(np.abs(a - b)) < lr / 10


def test_the_streamed_update_is_optax_s_on_float32_gradients():
    settings = train.OptimizerConfig(clip_norm=0.5, warmup_steps=0)
    keys = jax.random.split(jax.random.key(0), 3)
    masters = {"a": jax.random.normal(keys[0], (3, 5)), "b": jax.random.normal(keys[1], (7,))}
    grads = jax.tree.map(lambda m: 3 * m, masters)
    base = settings.base_transformation()
    reference = optax.chain(clip_by_global_norm(0.5), base)
    with jax.numpy_dtype_promotion("standard"):  # optax mixes float and int32, as in the trainer
        ours, state = update_masters(base, 0.5, grads, base.init(masters), masters, state_on_host=False)
        updates, ref_state = reference.update(grads, reference.init(masters), masters)
    expected = optax.apply_updates(masters, updates)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(ref_state[1]), strict=True):
        np.testing.assert_array_equal(a, b)


def test_copies_cast_what_the_layers_cast():
    params = nnx.state(nn.Transformer(BF16, rngs=nnx.Rngs(0)), nnx.Param)
    copies = nnx.as_pure(compute_copies(params, jnp.bfloat16))
    assert copies["blocks"]["attn"]["q_proj"]["kernel"].dtype == jnp.bfloat16
    assert copies["embed"]["embedding"].dtype == jnp.bfloat16
    assert copies["final_norm"]["scale"].dtype == jnp.float32  # norms compute in float32


@pytest.mark.parametrize(
    "config",
    [
        BF16.replace(dtype="float32"),
        BF16.replace(lora=nn.LoraConfig(rank=2)),
        BF16.replace(param_dtype="bfloat16"),
    ],
    ids=["float32-compute", "lora", "bfloat16-params"],
)
def test_offload_master_needs_float32_masters_of_a_16_bit_compute(config):
    with pytest.raises(
        ValueError, match=r"offload_master=True needs the float32 master weights.*param_dtype="
    ):
        train.Trainer(
            nn.Transformer(config, rngs=nnx.Rngs(0)), optimizer=train.OptimizerConfig(offload_master=True)
        )


@pytest.mark.slow
def test_a_resumed_run_with_host_masters_ends_as_the_uninterrupted_one(tmp_path):
    settings = train.OptimizerConfig(offload_master=True)
    run = train.RunConfig(steps=4, batch=2, seq=16, progress=False, optimizer=settings)
    whole = train.train(BF16, run)
    train.train(BF16, run.replace(steps=2, checkpoint={"dir": tmp_path, "every": 2}))
    resumed = train.train(BF16, run.replace(checkpoint={"dir": tmp_path, "resume": True}))
    assert [s["loss"] for s in resumed.steps] == [s["loss"] for s in whole.steps[2:]]
    assert resumed.to_dict()["optimizer"]["offload_master"] is True


@pytest.mark.slow  # 2 s or more with the compile cache warm
def test_the_evaluator_computes_with_device_copies():
    host = _four_steps(True)[0]
    docs = [Example(np.arange(n, dtype=np.int32), np.ones(n, bool)) for n in (5, 7)]
    state = nnx.as_pure(nnx.state(host.model))
    device_memory = SingleDeviceSharding(jax.devices()[0], memory_kind="device")
    on_device = nnx.merge(nnx.graphdef(host.model), jax.device_put(state, device_memory))
    ours = train.Evaluator(host.model)(host.model, pack_documents(docs, batch=2, seq=8))
    theirs = train.Evaluator(on_device)(on_device, pack_documents(docs, batch=2, seq=8))
    assert ours["tokens"] == theirs["tokens"] == 10
    assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-6)


@pytest.mark.slow
def test_the_planner_compiles_and_prices_host_masters():
    """``small`` in bfloat16: the masters leave the device's peak, within 10% of XLA:CPU."""
    config = nn.TransformerConfig.preset("small", dtype="bfloat16")
    on_device = plan.Workload(config, 2, 512)
    on_host = on_device.replace(optimizer=train.OptimizerConfig(offload_master=True))
    measured = {w.optimizer.offload_master: plan.measure(w, "full").peak for w in (on_device, on_host)}
    assert measured[True] < measured[False]
    predicted = plan.predict(on_host, "full")
    assert predicted.total == pytest.approx(measured[True], rel=0.10)
    assert predicted.host == plan.state_bytes(on_host)[0]


@pytest.mark.slow
def test_the_cli_trains_with_host_masters(capsys):
    argv = ["train", "--model", "tiny", "--layers", "1", "--dtype", "bfloat16", "--steps", "2"]
    assert main([*argv, "--batch", "2", "--seq", "16", "--offload-master", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["optimizer"]["offload_master"] is True
    assert result["optimizer"]["offload_saves_memory"] is False  # CPU: the same RAM
    with pytest.raises(SystemExit) as exit_:  # float32 compute: no masters to offload
        main([*argv[:-4], "--steps", "1", "--batch", "2", "--seq", "16", "--offload-master"])
    assert exit_.value.code == 2
    assert "--offload-master needs the float32 master weights" in capsys.readouterr().err


@pytest.mark.slow
def test_the_planner_cli_prices_host_masters(capsys):
    argv = ["plan", "--model", "tiny", "--batch", "2", "--seq", "64", "--dtype", "bfloat16"]
    argv += ["--budget", "1GiB", "--remat", "full", "--json"]
    assert main(argv) == 0
    on_device = json.loads(capsys.readouterr().out)
    assert main([*argv, "--offload-master"]) == 0
    on_host = json.loads(capsys.readouterr().out)
    assert on_device["host_bytes"] == 0 < on_host["host_bytes"]
    assert on_host["measured_bytes"] < on_device["measured_bytes"]


@pytest.mark.slow
def test_host_masters_shard_over_an_fsdp_mesh():
    mesh = train.make_mesh({"data": 1, "fsdp": 4}, devices=jax.devices()[:4])
    settings = train.OptimizerConfig(offload_master=True)
    host = train.Trainer(nn.Transformer(BF16, rngs=nnx.Rngs(0)), optimizer=settings, mesh=mesh)
    device = train.Trainer(nn.Transformer(BF16, rngs=nnx.Rngs(0)), mesh=mesh)
    tokens = np.asarray(BATCH[:, :1].repeat(4, axis=1))  # 4 rows: one a device
    losses = {
        name: [float(t.step(tokens)) for _ in range(3)] for name, t in (("host", host), ("device", device))
    }
    np.testing.assert_allclose(losses["host"], losses["device"], rtol=1e-3)
    kernel = host.state[0]["blocks"]["attn"]["q_proj"]["kernel"].get_value()
    assert kernel.sharding.memory_kind == "pinned_host" and "fsdp" in str(kernel.sharding.spec)
