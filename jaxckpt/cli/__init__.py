"""The ``jaxckpt`` command line: argparse -> library calls, no logic of its own.

Subcommands: ``info``, ``compare`` (the main job), ``train``, ``plan``, and those that
plugins add (torch_bridge's ``convert``). Every one takes ``--json``. The model preset
is ``--model`` everywhere (``--config`` stays an alias where it was the flag).
Library errors name Python arguments (``steps=0``); ``main`` prints them with the
flags instead (``--steps 0``), through the table in ``_flags.py``.
"""

from jaxckpt.cli._main import main

__all__ = ["main"]
