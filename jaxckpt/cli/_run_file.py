"""Run files: a subcommand's flags written down as a YAML, TOML or JSON mapping.

``jaxckpt train --config run.yaml`` reads the file's keys as the flags they name (``steps: 300``
is ``--steps 300``; ``checkpoint-dir`` and ``checkpoint_dir`` are both ``--checkpoint-dir``), and
the flags given on the command line override them. The file's values go through the same
argparse types and choices as typed flags, so a bad value is refused the same way, naming the
file and the key. ``--print-config`` prints the resolved run as YAML, which reads back as the
same run, and ``jaxckpt train`` saves it as ``run.yaml`` beside its checkpoints.

The files are parsed by maintained libraries: PyYAML (``.yaml``, ``.yml``), the standard
library's ``tomllib`` (``.toml``) and ``json`` (``.json``).

Example:
    >>> import argparse
    >>> p = argparse.ArgumentParser()
    >>> _ = p.add_argument("--steps", type=int, default=100)
    >>> _ = p.add_argument("--resume", action="store_true")
    >>> run_file_argv(p, {"steps": 3, "resume": True}, "run.yaml")
    ['--steps', '3', '--resume']
    >>> resolved_run(p, p.parse_args(["--steps", "3"]))
    {'steps': 3, 'resume': False}
"""

import argparse
import io
import json
import os
import tomllib
from pathlib import Path

import yaml

READERS = {
    ".yaml": yaml.safe_load,
    ".yml": yaml.safe_load,
    ".toml": tomllib.loads,
    ".json": json.loads,
}
"""A run file's suffix -> the parser of its text."""

NOT_IN_RUN = frozenset({"help", "config", "print_config", "run_parser"})
"""Flags that say how to read or show a run, not what the run is."""

RUN_FILE_NAME = "run.yaml"
"""The resolved run that ``jaxckpt train`` saves beside its checkpoints."""


def read_run_file(path: str | os.PathLike) -> dict:
    """The mapping a run file holds.

    Raises:
        ValueError: for an unknown suffix, a file its parser refuses, or a top level that is
            not a mapping (the message names the file).
        OSError: when the file cannot be read.
    """
    path = Path(path)
    reader = READERS.get(path.suffix.lower())
    if reader is None:
        raise ValueError(f"config={str(path)!r}: a run file ends in {', '.join(READERS)}")
    text = path.read_text(encoding="utf-8")
    try:
        values = reader(text)
    except (yaml.YAMLError, tomllib.TOMLDecodeError, json.JSONDecodeError) as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ValueError(f"config={str(path)!r} is not valid {path.suffix[1:]}: {first}") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ValueError(f"config={str(path)!r} must hold a mapping of flags, got {type(values).__name__}")
    return values


def _run_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Key -> the optional flag it sets: both ``checkpoint-dir`` and ``checkpoint_dir``."""
    keys = {}
    for action in parser._actions:  # argparse has no public list of a parser's actions
        if not action.option_strings or action.dest in NOT_IN_RUN:
            continue
        long = max(action.option_strings, key=len).lstrip("-")
        for key in {long, long.replace("-", "_"), action.dest}:
            keys[key] = action
    return keys


def run_file_argv(parser: argparse.ArgumentParser, values: dict, source: str) -> list[str]:
    """The command-line tokens that ``values`` (a run file's mapping) stand for.

    Raises:
        ValueError: for a key that names no flag of ``parser``, or a value of the wrong kind
            (the message names ``source`` and the key).
    """
    actions = _run_actions(parser)
    argv = []
    for key, value in values.items():
        action = actions.get(str(key))
        if action is None:
            valid = sorted({k for k in actions if "-" not in k})
            raise ValueError(f"config={source!r}: unknown key {key!r}; valid keys: {', '.join(valid)}")
        flag = max(action.option_strings, key=len)
        if action.nargs == 0:  # store_true / store_false
            if not isinstance(value, bool):
                raise ValueError(f"config={source!r}: {key} must be true or false, got {value!r}")
            if value != action.default:
                argv.append(flag)
        elif value is not None:
            if isinstance(value, dict | list):
                raise ValueError(f"config={source!r}: {key} must be one value, got {value!r}")
            argv += [flag, str(value).lower() if isinstance(value, bool) else str(value)]
    return argv


def resolved_run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict:
    """``{flag name: value}`` of every flag of the run (None left out): what ``--print-config``
    prints and ``run.yaml`` holds."""
    out = {}
    for action in parser._actions:
        if not action.option_strings or action.dest in NOT_IN_RUN:
            continue
        value = getattr(args, action.dest, None)
        if value is not None:
            key = max(action.option_strings, key=len).lstrip("-").replace("-", "_")
            out[key] = value
    return out


def run_yaml(run: dict) -> str:
    """``run`` as YAML text, in the flags' order."""
    out = io.StringIO()
    yaml.safe_dump(run, out, sort_keys=False, default_flow_style=False)
    return out.getvalue()


def save_run_file(directory: str | os.PathLike, run: dict) -> Path:
    """Writes ``run`` as ``RUN_FILE_NAME`` in ``directory``, atomically (a failed write leaves
    the old file); returns its path."""
    path = Path(directory) / RUN_FILE_NAME
    tmp = path.with_name(f".{RUN_FILE_NAME}.tmp")
    tmp.write_text(run_yaml(run), encoding="utf-8")
    os.replace(tmp, path)
    return path


def with_run_file(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``argv`` with the tokens of the run file its ``--config`` names put in front of the
    subcommand's own flags, so that the flags typed override the file's. ``argv`` unchanged
    without ``--config``, or for a subcommand that takes no run file (one that takes them sets
    the ``run_parser`` default to its parser)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("command", nargs="?")
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    if known.config is None or known.command is None:
        return argv
    sub = _subparser(parser, known.command)
    if sub is None or sub.get_default("run_parser") is None:  # convert's --config is a config.json
        return argv
    values = read_run_file(known.config)
    at = argv.index(known.command) + 1
    return [*argv[:at], *run_file_argv(sub, values, known.config), *argv[at:]]


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices.get(command)
    return None
