"""One process of a multi-process CPU run; ``tests/train/test_multihost.py`` starts two.

Usage: ``python multihost_check.py HOST:PORT NUM_PROCESSES PROCESS_ID CHECKPOINT_DIR OUT_JSON``,
with ``XLA_FLAGS=--xla_force_host_platform_device_count=2`` (two devices per process); the test
has ``fault_harness``'s fork server run ``main`` warm instead.

It trains the CLI's tiny model with 1 layer (batch 8, seq 16: the train step
``multihost_die.py``'s processes compile, so that XLA's persistent cache serves both):

1. through the real command line, ``jaxckpt train --coordinator ... --json`` with the
   default mesh (data over the processes, fsdp over each one's devices): 3 steps,
   saving checkpoints at steps 2 and 3;
2. with ``train.train``, resumed from that checkpoint onto ``fsdp=4`` (every leaf split
   over all 4 devices of both processes): step 3.

and writes JSON: the losses, what this process printed, where the state's shards live
and how the default mesh lays the processes out.
"""

import contextlib
import io
import json
import sys

STEPS, BATCH, SEQ, LAYERS = 3, 8, 16, 1
"""The CLI runs steps 0..STEPS-1; the resumed run adds step STEPS."""


def check(coordinator: str, num_processes: int, process_id: int, checkpoint_dir: str) -> dict:
    import jax

    from jaxckpt import nn, train
    from jaxckpt.cli import main as cli
    from jaxckpt.train._distributed import default_mesh_axes

    argv = ["train", "--coordinator", coordinator, "--num-processes", str(num_processes)]
    argv += ["--process-id", str(process_id), "--layers", str(LAYERS), "--batch", str(BATCH)]
    argv += ["--seq", str(SEQ), "--steps", str(STEPS), "--json"]
    argv += ["--checkpoint-dir", checkpoint_dir, "--checkpoint-every", "2"]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = cli(argv)  # calls train.initialize first: JAX is multi-process from here on
    mesh = train.make_mesh(default_mesh_axes())
    cfg = nn.TransformerConfig.preset("tiny", n_layers=LAYERS)
    drawn = io.StringIO()  # the progress bar (only process 0 draws one)
    with contextlib.redirect_stdout(drawn):
        run = train.RunConfig(
            steps=STEPS + 1,
            batch=BATCH,
            seq=SEQ,
            mesh="fsdp=4",
            checkpoint=train.CheckpointConfig(dir=checkpoint_dir, resume=True),
        )
        resumed = train.train(cfg, run)
    state = resumed.trainer.state
    kernel = state[0]["blocks"]["mlp"]["up"]["kernel"].get_value()
    return {
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "global_devices": jax.device_count(),
        "local_devices": jax.local_device_count(),
        "cli_status": status,
        "cli_stdout": printed.getvalue(),
        "progress_stdout": drawn.getvalue(),
        "default_mesh": default_mesh_axes(),
        "default_mesh_processes": [[d.process_index for d in row] for row in mesh.devices],
        "resumed_steps": resumed.steps,
        "total_bytes": sum(leaf.nbytes for leaf in jax.tree.leaves(state)),
        "bytes_per_device": train.bytes_per_device(state),
        "up_kernel_spec": str(kernel.sharding.spec),
        "latest_step": train.latest_step(checkpoint_dir),
    }


def main(argv: list[str]) -> int:
    """``check`` with the command line's arguments; writes its report to OUT_JSON."""
    coordinator, num_processes, process_id, checkpoint_dir, out = argv
    report = check(coordinator, int(num_processes), int(process_id), checkpoint_dir)
    with open(out, "w") as f:
        json.dump(report, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
