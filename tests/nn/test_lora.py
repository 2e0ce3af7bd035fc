"""LoRA: the adapters start at the base's outputs, only they train (no gradient and no
optimizer state for the base, from the tree and from the compiled step), remat does not
change their gradients, dropout is keyed per step, and FSDP splits them."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxckpt import nn, plan, remat, train
from jaxckpt.cli import main

SIZES = dict(n_layers=2, d_model=40, n_heads=4, n_kv_heads=2, ffn_dim=56, vocab_size=97, max_len=64)
BASE = nn.TransformerConfig.preset("tiny", **SIZES)
LORA = nn.LoraConfig(rank=3, alpha=6, targets=("q", "v", "o", "up", "down"))
CFG = BASE.replace(lora=LORA)
BATCH = (1, 2, 17)  # [M, B, T + 1]


@functools.cache
def _base_arrays() -> dict:
    return jax.tree.map(
        np.asarray, nnx.to_pure_dict(nnx.state(nn.Transformer(BASE, rngs=nnx.Rngs(3)), nnx.Param))
    )


def _base_params() -> dict:
    """A fresh copy each time: a trainer donates (deletes) the arrays it is given."""
    return jax.tree.map(np.array, _base_arrays())


def _lora_model(cfg=CFG, seed=0) -> nn.Transformer:
    return nn.from_params(nn.Transformer, cfg, _base_params(), seed=seed)


def _tokens(seed=0, shape=BATCH):
    return jax.random.randint(jax.random.key(seed), shape, 0, BASE.vocab_size)


def _flat(state) -> dict:
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_leaves_with_path(state)}


def _perturbed(model: nn.Transformer) -> nn.Transformer:
    """The model with random nonzero ``b`` matrices (so that every adapter gets a gradient)."""
    graphdef, adapters, rest = nnx.split(model, nnx.LoRAParam, ...)
    keys = iter(jax.random.split(jax.random.key(7), len(jax.tree.leaves(adapters))))
    adapters = jax.tree.map(lambda a: a + 0.05 * jax.random.normal(next(keys), a.shape, a.dtype), adapters)
    return nnx.merge(graphdef, adapters, rest)


def test_the_adapters_are_on_the_targets_only():
    model = _lora_model()
    blocks = model.blocks
    adapted = {"q_proj", "v_proj", "out_proj"}
    for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
        assert isinstance(getattr(blocks.attn, name), nn.LoraLinear) == (name in adapted), name
    assert isinstance(blocks.mlp.up, nn.LoraLinear) and isinstance(blocks.mlp.down, nn.LoraLinear)
    assert not isinstance(blocks.mlp.gate, nn.LoraLinear)
    a, b = blocks.attn.q_proj.lora.lora_a, blocks.attn.q_proj.lora.lora_b
    assert a.shape == (2, 40, 3) and b.shape == (2, 3, 40)  # stacked over the 2 layers
    assert nn.logical_axes(a) == ("layers", "embed", "lora_rank")
    assert nn.logical_axes(b) == ("layers", "lora_rank", "heads")
    assert not np.any(np.asarray(b[...]))  # b starts at zero


def test_step_zero_equals_the_base():
    tokens = _tokens()[0]
    base = nn.from_params(nn.Transformer, BASE, _base_params())
    np.testing.assert_array_equal(
        np.asarray(_forward(_lora_model(), tokens, None)), np.asarray(_forward(base, tokens, None))
    )


def test_only_the_adapters_train_and_the_loss_falls():
    model = _lora_model()
    before = _flat(nnx.state(model, nnx.Param))
    trainer = train.Trainer(model, optimizer=train.OptimizerConfig(learning_rate=3e-2, warmup_steps=0))
    tokens = _tokens(1)
    losses = [float(trainer.step(tokens)) for _ in range(5)]
    assert losses[-1] < losses[0] - 0.05, losses
    after = _flat(nnx.state(trainer.model, nnx.Param))
    assert before.keys() == after.keys()
    for name, value in before.items():
        changed = not np.array_equal(value, after[name])
        assert changed == ("lora" in name), name  # the base bit-identical, every adapter moved
    # The optimizer holds the adapters' moments only.
    opt_state = trainer.state[1]
    adapter_bytes = plan.tree_bytes(nnx.state(trainer.model, nnx.LoRAParam))
    moments = [leaf for leaf in jax.tree.leaves(opt_state) if leaf.ndim > 0]
    assert sum(leaf.nbytes for leaf in moments) == 2 * adapter_bytes


@pytest.mark.slow
def test_the_compiled_step_holds_no_base_gradient_or_state():
    """From XLA's own sizes: the step's arguments are the parameters, the adapters' two
    moments and the batch; its temp memory is smaller than full fine-tuning's by at least
    about the base's gradient (few tokens, so that the activations cannot hide it; measured
    97%: XLA reuses a few dead buffers for the full step's embedding gradient)."""
    wide = BASE.replace(d_model=64, ffn_dim=200, vocab_size=61)
    base = nn.Transformer(wide, rngs=nnx.Rngs(0))
    lora = train.Trainer(
        nn.from_params(nn.Transformer, wide.replace(lora=LORA), nnx.to_pure_dict(nnx.state(base)))
    )
    full = train.Trainer(base)
    shape = (1, 1, 9)
    params = plan.tree_bytes(nnx.state(lora.model, nnx.Param))
    adapters = plan.tree_bytes(nnx.state(lora.model, nnx.LoRAParam))
    analysis = {name: t.compile(shape).memory_analysis() for name, t in (("lora", lora), ("full", full))}
    counts = plan.tree_bytes(lora.state) - params - 2 * adapters  # step counters, schedule state
    assert 0 <= counts <= 64
    assert analysis["lora"].argument_size_in_bytes == params + 2 * adapters + counts + np.prod(shape) * 4
    base_grad = params - adapters
    saved = analysis["full"].temp_size_in_bytes - analysis["lora"].temp_size_in_bytes
    assert saved >= 0.9 * base_grad, (saved, base_grad)


_loss_and_grads = jax.jit(train.loss_and_grads, static_argnums=(0, 4))
"""One jitted function for every preset (the spec is static): the no-remat reference is
compiled once per module, not once per preset."""


@functools.cache
def _adapter_grads_case():
    """The perturbed model's split and tokens, built once and shared by the presets."""
    model = _perturbed(_lora_model())
    graphdef, params, rest = nnx.split(model, nn.trainable(model.config), ...)
    return graphdef, params, rest, _tokens(2)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["full", "dots", "save_attn", "minimal", "ratio_0.5"])
def test_remat_presets_give_the_same_adapter_gradients(preset):
    graphdef, params, rest, tokens = _adapter_grads_case()
    want_loss, want = _loss_and_grads(graphdef, params, rest, tokens, remat.get("none"))
    got_loss, got = _loss_and_grads(graphdef, params, rest, tokens, remat.get(preset))
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    assert jax.tree.structure(got) == jax.tree.structure(params)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert np.abs(np.asarray(w)).max() > 0
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)


@nnx.jit
def _forward(model, tokens, dropout_key):
    """``model(tokens, dropout_key=...)``, jitted: eagerly every op compiles its own program."""
    return model(tokens, dropout_key=dropout_key)


@pytest.mark.slow
def test_dropout_is_keyed_by_the_seed_and_the_step():
    cfg = CFG.replace(lora=nn.LoraConfig(rank=3, dropout=0.5))
    tokens = _tokens(3)
    # The perturbed model built once (eagerly: many small programs); each trainer gets a
    # fresh copy of its arrays, since a trainer donates the arrays it is given.
    graphdef, state = nnx.split(_perturbed(_lora_model(cfg)))
    state = jax.tree.map(np.asarray, state)

    def fresh():
        return nnx.merge(graphdef, jax.tree.map(np.array, state))

    def losses(seed):
        trainer = train.Trainer(fresh(), seed=seed)
        return [float(trainer.step(tokens)) for _ in range(3)]

    first, again, other = losses(0), losses(0), losses(1)
    assert first == again  # reproducible
    assert first != other  # another seed, other masks
    model = fresh()
    plain = _forward(model, tokens[0], None)
    no_key = _forward(model, tokens[0], None)
    np.testing.assert_array_equal(np.asarray(no_key), np.asarray(plain))  # no key: no dropout
    dropped = _forward(model, tokens[0], jax.random.key(0))
    assert not np.allclose(np.asarray(dropped), np.asarray(plain))


def test_fsdp_splits_the_adapters_and_their_moments():
    cfg = CFG.replace(lora=nn.LoraConfig(rank=3, targets=("q", "up")))
    trainer = train.Trainer(_lora_model(cfg), mesh=train.make_mesh("fsdp=8"))
    loss = float(trainer.step(_tokens(4, (1, 8, 17))))
    assert np.isfinite(loss)
    model_state, opt_state = trainer.state[0], trainer.state[1]
    a = model_state["blocks"]["mlp"]["up"]["lora"]["lora_a"].get_value()  # [L, embed, rank]
    b = model_state["blocks"]["mlp"]["up"]["lora"]["lora_b"].get_value()  # [L, rank, mlp]
    assert tuple(a.sharding.spec) == (None, "fsdp", None)
    assert tuple(b.sharding.spec) == (None, None, "fsdp")
    mu = [
        leaf
        for path, leaf in jax.tree_util.tree_leaves_with_path(opt_state)
        if "lora_b" in jax.tree_util.keystr(path) and "up" in jax.tree_util.keystr(path)
    ]
    assert mu and all("fsdp" in str(m.sharding.spec) for m in mu)


def test_bad_lora_settings_name_the_field(capsys):
    with pytest.raises(ValueError, match=r"LoraConfig: targets='q,x'"):
        nn.LoraConfig(rank=4, targets="q,x")
    with pytest.raises(ValueError, match="LoraConfig: rank"):
        nn.LoraConfig(rank=0)
    with pytest.raises(ValueError, match=r"LoraConfig: dropout=1\.0"):
        nn.LoraConfig(rank=2, dropout=1.0)
    with pytest.raises(ValueError, match=r"quantize_base=.nf4. .* needs LoRA"):
        BASE.replace(quantize_base="nf4")
    with pytest.raises(SystemExit):
        main(["train", "--lora-alpha", "8", "--steps", "1"])
    assert "--lora-alpha needs --lora R" in capsys.readouterr().err


CLI_SIZES = ["--model", "tiny", "--layers", "1", "--batch", "2", "--seq", "16", "--json"]


@pytest.fixture(scope="module")
def plain_checkpoint(tmp_path_factory):
    """A plain (no LoRA) one-step CLI training run's checkpoint: the base of the tests below."""
    d = tmp_path_factory.mktemp("base")
    assert main(["train", *CLI_SIZES, "--steps", "1", "--checkpoint-dir", str(d)]) == 0
    return d


@pytest.mark.slow
def test_the_cli_trains_adapters_on_an_init_from_base(plain_checkpoint, tmp_path, capsys):
    """A plain trained checkpoint as the base: its parameters, adapters added, stored in bf16."""
    argv = ["train", *CLI_SIZES, "--init-from", str(plain_checkpoint), "--tokenizer", "bytes", "--steps", "3"]
    argv += ["--lora", "4", "--lora-targets", "q,k", "--checkpoint-dir", str(tmp_path / "run")]
    assert main(argv) == 0
    assert len(json.loads(capsys.readouterr().out)["steps"]) == 3
    config = json.loads((tmp_path / "run" / "jaxckpt.json").read_text())["config"]
    assert config["lora"]["rank"] == 4 and config["param_dtype"] == "bfloat16"
    model = train.initial_model(nn.TransformerConfig.from_dict(config), 0, tmp_path / "run")
    assert np.any(np.asarray(model.blocks.attn.q_proj.lora.lora_b[...]))  # trained adapters restored


@pytest.mark.slow
def test_a_quantized_base_from_a_plain_checkpoint(plain_checkpoint):
    """--init-from a plain checkpoint with --lora and --quantize-base: the base quantized on load."""
    base = nn.TransformerConfig.from_dict(train.read_meta(plain_checkpoint)["config"])
    assert base.lora is None and base.param_dtype == "float32"
    cfg = base.replace(lora=LORA)
    model = train.initial_model(cfg.replace(quantize_base="int8"), 0, plain_checkpoint)
    assert isinstance(model.blocks.attn.q_proj, nn.QuantizedLinear)
    assert model.blocks.attn.q_proj.lora.lora_a[...].dtype == jnp.float32
    tokens = _tokens()[0]
    want = _forward(train.initial_model(base, 0, plain_checkpoint), tokens, None)
    rel = float(jnp.abs(_forward(model, tokens, None) - want).max() / jnp.abs(want).max())
    assert rel < 0.02  # int8's documented bound (tests/nn/test_nn_quant.py)
