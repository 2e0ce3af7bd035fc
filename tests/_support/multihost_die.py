"""One process of a multi-process CPU run that the other process may outlive;
``tests/reliability/test_multihost_failure.py`` starts two and SIGKILLs one.

Usage: ``python multihost_die.py PROGRESS -- <jaxckpt train arguments>``

After each training step it appends ``step <n>`` to the file PROGRESS (flushed), so the
test knows both processes are in the training loop before it kills one. Nothing else
changes: the process runs ``jaxckpt train`` and exits with its status.
"""

import os
import sys


def main(argv: list[str]) -> int:
    progress, sep, *train_args = argv
    assert sep == "--", "usage: multihost_die.py PROGRESS -- <train arguments>"
    from jaxckpt.cli import main as cli
    from jaxckpt.train import _run_steps

    guard = _run_steps.guard_step

    def guarded(on_nonfinite, step, loss, *rest):
        with open(progress, "a") as f:
            f.write(f"step {step}\n")
            f.flush()
            os.fsync(f.fileno())
        return guard(on_nonfinite, step, loss, *rest)

    _run_steps.guard_step = guarded
    return cli(["train", *train_args])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
