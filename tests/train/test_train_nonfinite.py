"""``--on-nonfinite stop|skip``: a diverged run (a huge learning rate) never writes a
non-finite update; ``stop`` names the step, keeps the last good checkpoint and exits 3,
``skip`` leaves params and optimizer state as they were and counts the skips; the float16
loss scaler's overflows compose with both; NaN weights are refused at load."""

import json

import fault_harness as harness
import numpy as np
import pytest

from jaxckpt import nn, train
from jaxckpt.cli import main

ARGS = ["train", "--layers", "1", "--batch", "2", "--seq", "16", "--steps", "6", "--lr", "1e8"]
"""Step 0 and 1 are finite, step 2's loss is NaN (seen: 5.53, 5.55, nan, ...)."""

FIRST_BAD = 2


def _finite(arrays: dict) -> bool:
    return all(np.isfinite(a).all() for a in arrays.values() if np.issubdtype(a.dtype, np.inexact))


@pytest.mark.slow
def test_stop_names_the_step_keeps_the_last_good_checkpoint_and_exits_3(tmp_path, capsys):
    ckpt = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        main([*ARGS, "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1", "--json"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_info.value.code == 3, err
    assert err.startswith(f"jaxckpt train: stopped: step {FIRST_BAD}: the loss is nan"), err
    assert f"the last good checkpoint is step {FIRST_BAD} in {str(ckpt)!r}" in err, err
    assert train.latest_step(ckpt) == FIRST_BAD and train.read_meta(ckpt)["checkpoints"][-1] == FIRST_BAD
    assert _finite(harness.checkpoint_arrays(ckpt, FIRST_BAD))
    with pytest.raises(SystemExit) as again:  # a resume meets the same step, and stops there again
        main([*ARGS, "--checkpoint-dir", str(ckpt), "--resume", "--json"])
    assert again.value.code == 3 and f"step {FIRST_BAD}: the loss is nan" in capsys.readouterr().err


@pytest.mark.slow
def test_skip_leaves_params_and_optimizer_state_unchanged_and_counts(tmp_path, capsys):
    ckpt = tmp_path / "run"
    every = ["--checkpoint-every", "2"]  # steps 2, 4 and 6 (the newest 3 are kept)
    assert main([*ARGS, "--on-nonfinite", "skip", "--checkpoint-dir", str(ckpt), *every]) == 0
    capsys.readouterr()
    good, last = harness.checkpoint_arrays(ckpt, FIRST_BAD), harness.checkpoint_arrays(ckpt, 6)
    changed = sorted(k for k in good if good[k].tobytes() != last[k].tobytes())
    # params, moments and step count: bit for bit
    assert changed == ["['1']['loss_scaler']['skipped']"], changed
    assert _finite(last)
    assert main([*ARGS, "--on-nonfinite", "skip", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    skipped = [s["step"] for s in report["steps"] if s["skipped"]]
    assert skipped == list(range(FIRST_BAD, 6)) and report["skipped_steps"] == len(skipped), report["steps"]


CFG16 = nn.TransformerConfig.preset(
    "tiny", d_model=30, n_layers=1, n_heads=5, n_kv_heads=1, head_dim=6, ffn_dim=22, dtype="float16"
)


@pytest.mark.slow
def test_float16_overflows_do_not_stop_a_run_but_a_nan_loss_does():
    """Dynamic loss scaling: a scale too high overflows the float16 gradients (finite loss):
    the scaler skips and halves, whatever ``on_nonfinite``; a NaN loss then stops the run."""
    scaled = train.OptimizerConfig(loss_scale_init=2.0**40, warmup_steps=0, learning_rate=1e-2)
    run = train.RunConfig(steps=4, batch=3, seq=16, progress=False, optimizer=scaled, on_nonfinite="stop")
    diverging = run.replace(steps=8, optimizer=train.OptimizerConfig(learning_rate=1e8, warmup_steps=0))
    run = train.train(CFG16, run)
    assert run.skipped_steps == 4 and all(np.isfinite(s["loss"]) for s in run.steps)
    with pytest.raises(train.NonFiniteError, match=r"^step \d+: the loss is nan") as err:
        train.train(CFG16, diverging)
    assert err.value.step >= 1
