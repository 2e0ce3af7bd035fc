"""Entry point of the ``jaxckpt`` command: one sub-parser per subcommand."""

import argparse
import json
import sys

import jax

import jaxckpt
from jaxckpt import plan
from jaxckpt._plugins import CLI, load_attention_plugins, plugins
from jaxckpt.attention import available_implementations, implementations
from jaxckpt.cli import _compare, _eval, _generate, _plan, _train
from jaxckpt.cli._flags import FLAGS, flag_message
from jaxckpt.cli._run_file import with_run_file


def _state(impl) -> str:
    """``available``, ``available (<how it runs here>)`` or why it cannot run here."""
    reason = impl.unavailable()
    if reason is not None:
        return reason
    note = impl.note()
    return f"available ({note})" if note else "available"


def _info(args: argparse.Namespace) -> int:
    """Prints versions, devices, the attention implementations usable here and the GPU and
    TPU compile targets (``jaxckpt plan --device``)."""
    missing = {"gpu": plan.gpu_aot_unavailable(), "tpu": plan.tpu_aot_unavailable()}

    def state(target) -> str:
        kind = f"XLA:GPU {target.sm}" if target.platform == "gpu" else f"XLA:TPU {target.device_kind}"
        return missing[target.platform] or f"available: {kind}, deviceless"

    report = {
        "jaxckpt": jaxckpt.__version__,
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "attention_implementations": {name: _state(impl) for name, impl in implementations().items()},
        "attention_features": {name: sorted(impl.supports) for name, impl in implementations().items()},
        "compile_targets": {name: state(target) for name, target in plan.TARGETS.items()},
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    for key, value in report.items():
        if isinstance(value, dict):
            print(f"{key}:")
            for name, state in value.items():
                print(f"  {name:<14} {', '.join(state) if isinstance(state, list) else state}")
        else:
            print(f"{key}: {value}")
    print(f"usable here: {', '.join(available_implementations())}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``jaxckpt`` (one sub-parser per subcommand)."""
    load_attention_plugins()  # e.g. npu_backend's "npu": listed by `info`, usable by --attention
    parser = argparse.ArgumentParser(prog="jaxckpt", description=jaxckpt.__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"jaxckpt {jaxckpt.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="versions, devices and attention implementations usable here")
    info.add_argument("--json", action="store_true", help="print JSON instead of text")
    info.set_defaults(run=_info)
    _compare.add_parser(sub)
    _train.add_parser(sub)
    _eval.add_parser(sub)
    _generate.add_parser(sub)
    _plan.add_parser(sub)
    for name, entry in plugins(CLI).items():  # e.g. torch_bridge's `convert`
        try:
            entry.load()(sub)
        except ImportError as err:  # a broken optional install must not break jaxckpt itself
            broken = sub.add_parser(name, help=f"unavailable: {err}")
            broken.set_defaults(run=lambda args, err=err: _unavailable(args, err))
    return parser


def _unavailable(args: argparse.Namespace, err: ImportError) -> int:
    raise ValueError(f"this subcommand could not be loaded: {err}")


NONFINITE_EXIT = 3
"""The exit status of a run stopped by a non-finite step (``--on-nonfinite stop``); bad
input, a failed write included, exits 2."""


def main(argv: list[str] | None = None) -> int:
    """Runs the ``jaxckpt`` command line; returns the exit status.

    Bad input (a ``ValueError``, ``OSError`` or ``ImportError``: a failed write too) exits
    with status 2 and one line naming the flag, not a traceback; a non-finite training
    step (``FloatingPointError``) exits with status 3: the library's ``name=`` becomes the
    subcommand's flag (``FLAGS`` in ``jaxckpt/cli/_flags.py``, and a subcommand's own
    ``flags`` default).

    Example:
        >>> main(["info", "--json"])  # doctest: +ELLIPSIS
        {
          "jaxckpt": ...
        0
    """
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        argv = with_run_file(parser, argv)  # --config FILE: its flags first, the typed ones override
    except (ValueError, OSError) as err:
        parser.exit(2, f"jaxckpt: error: {flag_message(str(err), {**FLAGS, 'config': '--config'})}\n")
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except FloatingPointError as err:  # train --on-nonfinite stop: the run diverged
        parser.exit(NONFINITE_EXIT, f"jaxckpt {args.command}: stopped: {err}\n")
    except (ValueError, OSError, ImportError) as err:  # bad input: report it without a traceback
        message = flag_message(str(err), {**FLAGS, **getattr(args, "flags", {})})
        parser.exit(2, f"jaxckpt {args.command}: error: {message}\n")


if __name__ == "__main__":
    sys.exit(main())
