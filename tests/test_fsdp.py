"""Data parallel + FSDP on 8 simulated CPU devices (a subprocess: the device count is
fixed when JAX starts), against the single-device run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxckpt import train

SCRIPT = Path(__file__).with_name("fsdp_check.py")


@pytest.fixture(scope="module")
def report() -> dict:
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.slow
def test_sharded_losses_match_one_device(report):
    assert report["devices"] == 8
    assert report["max_loss_difference"] <= 1e-5, report["meshes"]


@pytest.mark.slow
def test_state_is_really_split(report):
    total, meshes = report["total_bytes"], report["meshes"]
    # The state leaves that no fsdp size divides (scalars, small vectors) stay whole.
    assert max(meshes["fsdp=8"]["bytes_per_device"]) <= total / 8 * 1.02
    assert max(meshes["data=2,fsdp=4"]["bytes_per_device"]) <= total / 4 * 1.02
    assert "fsdp" in meshes["fsdp=8"]["up_kernel_spec"]


@pytest.mark.slow
def test_every_remat_preset_runs_sharded(report):
    assert len(report["presets"]) >= 7
    for preset, loss in report["presets"].items():
        assert loss == pytest.approx(report["single"][0], abs=1e-5), preset


@pytest.mark.slow
def test_per_device_planning_matches_xla_and_the_trainer(report):
    planning = report["planning"]
    for case, ratio in planning["ratios"].items():  # predicted / XLA's per-device peak
        assert 0.9 <= ratio <= 1.1, (case, ratio)
    # the planner's per-device state is what a sharded trainer really holds (fsdp=8 there)
    assert planning["planned_params_bytes"] == planning["trainer_params_bytes"]
    assert (
        planning["planned_state_bytes"]
        <= planning["trainer_state_bytes"]
        <= planning["planned_state_bytes"] + 64
    )
    chosen = planning["plan"]
    assert chosen["devices"] == 8 and chosen["peak"] <= chosen["budget"]
    assert planning["auto"]["devices"] == 8
    assert planning["auto"]["peak"] == planning["auto"]["planned_peak"] <= chosen["budget"]
    assert "plans per device for FSDP meshes" in planning["auto_data_axis_error"]


def test_mesh_arguments_are_checked():
    assert train.parse_mesh("fsdp=2") == {"fsdp": 2}
    for bad, match in (
        ("tensor=2", "unknown axis 'tensor'"),
        ("data=0", "positive integer"),
        ("data=2,data=2", "twice"),
    ):
        with pytest.raises(ValueError, match=match):
            train.parse_mesh(bad)
    with pytest.raises(ValueError, match="needs 8 devices; this process sees 1"):
        train.make_mesh("data=2,fsdp=4")


def test_cli_mesh_larger_than_the_devices_is_a_clear_error(capsys):
    from jaxckpt.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--mesh", "data=2", "--steps", "1", "--json"])
    assert exit_info.value.code == 2
    assert "needs 2 devices; this process sees 1" in capsys.readouterr().err


def test_logical_axis_rules_place_every_parameter():
    """Every parameter the modules create names its axes; the layer axis is never split."""
    from flax import nnx

    from jaxckpt import nn

    cfg = nn.TransformerConfig.preset("gpt2", n_layers=3, d_model=16, n_heads=2, ffn_dim=24, vocab_size=11)
    model = nn.Transformer(cfg, rngs=nnx.Rngs(0))
    mesh = train.make_mesh({"fsdp": 1})
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
