"""The ``jaxckpt`` command line: argparse -> library calls."""

from jaxckpt.cli._main import main

__all__ = ["main"]
