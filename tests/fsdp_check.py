"""Run as a script in a fresh process with 8 simulated CPU devices; prints JSON.

``XLA_FLAGS=--xla_force_host_platform_device_count=8`` must be set before JAX starts,
so ``tests/test_fsdp.py`` runs this file in a subprocess. For the tiny config it
trains 3 steps on one device and on two meshes, and reports the losses, where the
state's shards live (bytes per device, a parameter's partition spec), and one
sharded step under every other remat preset.
"""

import json
import os
import sys


def main() -> dict:
    import jax
    import numpy as np
    from flax import nnx

    from jaxckpt import nn, remat, train

    cfg = nn.TransformerConfig.preset("tiny", n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, ffn_dim=96)
    batches = train.ByteBatches(train.load_tokens(None), 8, 16, seed=0)

    def run(mesh, preset="full", steps=3):
        trainer = train.Trainer(nn.Transformer(cfg, rngs=nnx.Rngs(0)), mesh=mesh, remat=preset)
        return [float(trainer.step(batches.batch_at(i))) for i in range(steps)], trainer

    single, trainer = run(None)
    total = sum(leaf.nbytes for leaf in jax.tree.leaves(trainer.state))
    out = {"devices": len(jax.devices()), "single": single, "total_bytes": total, "meshes": {}}
    for axes in ("data=2,fsdp=4", "fsdp=8"):
        losses, trainer = run(train.make_mesh(axes))
        kernel = trainer.state[0]["blocks"]["mlp"]["up"]["kernel"].get_value()
        out["meshes"][axes] = {
            "losses": losses,
            "bytes_per_device": sorted(set(train.bytes_per_device(trainer.state).values())),
            "up_kernel_spec": str(kernel.sharding.spec),
        }
    mesh = train.make_mesh("data=2,fsdp=4")
    skip = () if train.offload_saves_memory() else ("offload_qkv", "offload_minimal")
    # Remat does not change the numbers: every preset's first loss is the single-device one.
    out["presets"] = {p: run(mesh, p, steps=1)[0][0] for p in remat.PRESETS if p not in (*skip, "full")}
    out["planning"] = planning(cfg, trainer)
    out["max_loss_difference"] = float(
        max(np.abs(np.array(m["losses"]) - np.array(single)).max() for m in out["meshes"].values())
    )
    return out


def planning(cfg, trainer) -> dict:
    """Per-device planning, compiled in this process (it has the devices): the analytic
    figures against XLA's, and the planner's state shares against a real sharded trainer's."""
    from flax import nnx

    from jaxckpt import nn, plan, train

    out = {"ratios": {}}
    sized = nn.TransformerConfig.preset("tiny")  # activations large enough to model, as users' are
    for devices, preset in ((2, "full"), (8, "none"), (8, "full"), (8, "save_attn")):
        predicted = plan.predict(sized, 8, 128, preset, devices=devices).total
        measured = plan.measure(sized, 8, 128, preset, devices=devices).peak
        out["ratios"][f"{devices}/{preset}"] = predicted / measured
    measured = plan.measure(cfg, 8, 16, "full", devices=8)
    params = nnx.state(trainer.model, nnx.Param)
    out["planned_state_bytes"] = measured.params + measured.optimizer
    out["trainer_state_bytes"] = max(train.bytes_per_device(trainer.state).values())
    out["planned_params_bytes"] = measured.params
    out["trainer_params_bytes"] = max(train.bytes_per_device(params).values())
    budget = (measured.peak + plan.measure(cfg, 8, 16, "none", devices=8).peak) // 2
    chosen = plan.plan_memory(cfg, 8, 16, budget, devices=8)
    out["plan"] = {
        "budget": budget,
        "peak": chosen.measured.peak,
        "remat": chosen.remat,
        "devices": chosen.devices,
    }
    # remat="auto" on a mesh plans per device, and the step that trains is the one it measured
    auto_cfg = cfg.replace(remat="auto", budget=budget)
    auto = train.train(auto_cfg, steps=1, batch=8, seq=16, mesh="fsdp=8", progress=False)
    out["auto"] = {
        "devices": auto.plan.devices,
        "peak": auto.memory.peak,
        "planned_peak": auto.plan.measured.peak,
    }
    try:
        train.train(auto_cfg, steps=1, batch=8, seq=16, mesh="data=2,fsdp=4", progress=False)
    except ValueError as err:
        out["auto_data_axis_error"] = str(err)
    return out


if __name__ == "__main__":
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    json.dump(main(), sys.stdout)
