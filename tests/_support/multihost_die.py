"""One process of a multi-process CPU run that the other process may outlive;
``tests/reliability/test_multihost_failure.py`` starts two and SIGKILLs one.

Usage: ``python multihost_die.py PROGRESS -- <jaxckpt train arguments>`` (or
``multihost_die.py raise lost|other``: ``raise_uncaught``)

After each training step it appends ``step <n>`` to the file PROGRESS (flushed), so the
test knows both processes are in the training loop before it kills one. Nothing else
changes: the process runs ``jaxckpt train`` and exits with its status.
"""

import os
import sys


def main(argv: list[str]) -> int:
    if argv[:1] == ["raise"]:
        return raise_uncaught(argv[1])
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


def raise_uncaught(error: str) -> int:
    """``multihost_die.py raise lost|other``: process 0 of a two-process run whose error hook is
    installed (``train.initialize``'s, without the run) prints ``before`` unflushed, registers
    an exit handler, and raises ``error`` uncaught: a gloo error of a lost peer, or any other."""
    import atexit

    import jax

    from jaxckpt.train import _distributed

    _distributed._run.update(coordinator="127.0.0.1:1234", num_processes=2, process_id=0)
    sys.excepthook = _distributed._exit_on_lost_peer(sys.excepthook)
    atexit.register(print, "exit handlers ran")  # JAX's own would wait at the shutdown barrier
    print("before", flush=False)
    if error == "lost":
        raise jax.errors.JaxRuntimeError("UNKNOWN: Gloo all-reduce failed: Connection reset by peer")
    raise ValueError("something else")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
