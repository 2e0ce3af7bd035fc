"""Mixed-dtype checkpoints (fp32 norms, bf16 matrices): each tensor keeps its dtype where the
model allows it (fp32, bf16, fp16), every cast is reported, and a read -> write round trip
is bit-identical.

transformers cannot run a model in that mixed state (its fp32 RMSNorm output meets a bf16
``nn.Linear``: "expected m1 and m2 to have the same dtype"), and ``from_pretrained`` casts
every tensor to one dtype. So the mixed jaxckpt model is checked against the fp32 reading of
the same tensors (ours, and transformers' in fp32, which agree to 1e-5) within a bf16
tolerance: it computes in bf16, the checkpoint's native dtype.
"""

import json

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402
import safetensors.numpy  # noqa: E402
import torch_models as tm  # noqa: E402

import torch_bridge  # noqa: E402
from jaxckpt import train  # noqa: E402
from torch_bridge._convert import flatten  # noqa: E402
from torch_bridge._verify import TOLERANCES  # noqa: E402

pytestmark = pytest.mark.torch

BF16, F32 = np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32)


def _mixed(model):
    """``model`` with its 1-D tensors (norms) in fp32 and its matrices in bf16."""
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.to(torch.float32 if p.ndim == 1 else torch.bfloat16)
    return model


@pytest.fixture(scope="module")
def mixed_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixed")
    _mixed(tm.tiny_llama()).save_pretrained(path)
    return path


def _tensors(directory) -> dict[str, np.ndarray]:
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out |= safetensors.numpy.load_file(f)
    return out


def test_the_fixture_is_mixed(mixed_dir):
    dtypes = {key: a.dtype for key, a in _tensors(mixed_dir).items()}
    assert dtypes["model.norm.weight"] == F32 and dtypes["model.layers.0.self_attn.q_proj.weight"] == BF16


def test_each_tensor_keeps_its_dtype_and_nothing_is_reported(mixed_dir):
    converted = torch_bridge.read_checkpoint(mixed_dir)
    assert converted.config.param_dtype == converted.config.dtype == "bfloat16"  # the largest tensor's
    assert converted.report.dtype_changes == [] and converted.report.problems() == []
    params = flatten(converted.params)
    for path, array in params.items():
        assert array.dtype == (F32 if "norm" in path else BF16), path
    model = converted.model()  # from_params takes arrays whose dtype differs from the abstract model's
    assert model.final_norm.scale[...].dtype == jnp.float32
    assert model.blocks.attn.q_proj.kernel[...].dtype == jnp.bfloat16


def test_mixed_logits_are_the_fp32_logits_within_bf16_tolerance(mixed_dir):
    ids = tm.tokens(length=13)
    mixed = torch_bridge.load_hf(mixed_dir)
    as_fp32 = torch_bridge.load_hf(mixed_dir, dtype="fp32")
    theirs = tm.torch_logits(
        transformers.AutoModelForCausalLM.from_pretrained(mixed_dir, dtype=torch.float32), ids
    )
    ours32 = np.asarray(as_fp32(jnp.asarray(ids, jnp.int32)))
    assert np.abs(ours32 - theirs).max() <= 1e-5 * max(1.0, np.abs(theirs).max())
    logits = mixed(jnp.asarray(ids, jnp.int32))
    assert logits.dtype == jnp.bfloat16
    diff = np.abs(np.asarray(logits.astype(jnp.float32)) - ours32).max()
    assert diff <= TOLERANCES["bfloat16"] * max(1.0, np.abs(ours32).max()), diff


@pytest.mark.slow  # 2 s or more with the compile cache warm
def test_a_mixed_model_trains_and_keeps_its_dtypes(mixed_dir):
    trainer = train.Trainer(torch_bridge.load_hf(mixed_dir), remat="full")
    batch = jnp.asarray(tm.tokens(batch=2, length=10, seed=1)[None], jnp.int32)  # [M=1, B=2, T+1=10]
    losses = [float(trainer.step(batch)) for _ in range(2)]
    assert all(np.isfinite(losses)) and losses[1] < losses[0]
    model = trainer.model
    assert model.final_norm.scale[...].dtype == jnp.float32
    assert model.blocks.mlp.up.kernel[...].dtype == jnp.bfloat16


def test_read_then_write_is_bit_identical(mixed_dir, tmp_path):
    out = torch_bridge.save_hf(torch_bridge.load_hf(mixed_dir), tmp_path / "out", max_shard_size="20KB")
    before, after = _tensors(mixed_dir), _tensors(out)
    assert sorted(after) == sorted(before)
    for key, array in before.items():
        assert after[key].dtype == array.dtype, key
        np.testing.assert_array_equal(after[key].view(np.uint8), array.view(np.uint8), err_msg=key)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert transformers.AutoModelForCausalLM.from_pretrained(out) is not None


def test_an_asked_dtype_casts_everything_and_reports_each_cast(mixed_dir):
    converted = torch_bridge.read_checkpoint(mixed_dir, dtype="fp32")
    assert {a.dtype for a in flatten(converted.params).values()} == {F32}
    bf16 = sorted(k for k, a in _tensors(mixed_dir).items() if a.dtype == BF16)
    changes = converted.report.dtype_changes
    assert sorted(k for k, _, _ in changes) == bf16  # the fp32 norms were not cast
    assert {(a, b) for _, a, b in changes} == {("bfloat16", "float32")}


def test_dtypes_the_model_does_not_take_are_cast_to_the_native_dtype(tmp_path):
    model = _mixed(tm.tiny_llama())
    state = {
        k: v.to(torch.float64) if k.endswith("norm.weight") else v for k, v in model.state_dict().items()
    }
    state["model.norm.weight"] = state["model.norm.weight"].to(torch.float16)  # fp16: kept
    model.config.to_json_file(tmp_path / "config.json")
    torch.save(state, tmp_path / "weights.pt")
    converted = torch_bridge.read_checkpoint(tmp_path / "weights.pt", config=tmp_path / "config.json")
    params = flatten(converted.params)
    assert params["blocks.attn_norm.scale"].dtype == BF16  # float64 -> param_dtype (bf16)
    assert params["final_norm.scale"].dtype == np.float16
    changes = converted.report.dtype_changes
    assert ("model.layers.1.input_layernorm.weight", "float64", "bfloat16") in changes
    assert len(changes) == 2 * tm.LAYERS and not any(k == "model.norm.weight" for k, _, _ in changes)


def test_layers_that_differ_take_their_common_dtype():
    model = _mixed(tm.tiny_llama())
    state = dict(model.state_dict())
    state["model.layers.0.self_attn.q_proj.weight"] = state["model.layers.0.self_attn.q_proj.weight"].float()
    config = torch_bridge.config_from_hf(model.config.to_dict(), dtype="bf16")
    params, report = torch_bridge.convert_state_dict(state, "llama", config, keep_dtypes=True)
    assert flatten(params)["blocks.attn.q_proj.kernel"].dtype == F32  # one stack: fp32 holds all three
    assert report.dtype_changes == [
        (f"model.layers.{i}.self_attn.q_proj.weight", "bfloat16", "float32") for i in (1, 2)
    ]
    back = dict(torch_bridge.export_state_dict(params, "llama", config))
    for key, value in state.items():
        np.testing.assert_array_equal(back[key].astype(np.float32), value.float().numpy(), err_msg=key)


def test_a_fused_tensor_whose_parts_differ_is_written_in_their_common_dtype(tmp_path):
    source = _mixed(tm.tiny_family("phi3"))
    source.save_pretrained(tmp_path / "src")
    converted = torch_bridge.read_checkpoint(tmp_path / "src")
    attn = converted.params["blocks"]["attn"]
    attn["k_proj"]["kernel"] = attn["k_proj"]["kernel"].astype(np.float32)  # q and v stay bf16
    model = converted.model()
    out = torch_bridge.save_hf(model, tmp_path / "out")
    after, before = _tensors(out), _tensors(tmp_path / "src")
    fused = "model.layers.1.self_attn.qkv_proj.weight"
    assert after[fused].dtype == F32 and after["model.layers.1.mlp.gate_up_proj.weight"].dtype == BF16
    np.testing.assert_array_equal(after[fused], before[fused].astype(np.float32))  # no value changed
    assert attn["k_proj"]["kernel"].dtype == F32  # the write casts copies, not the parameters
