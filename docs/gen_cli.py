"""Write one reference page per ``jaxckpt`` subcommand from its argparse help (mkdocs-gen-files).

The parser is the one the command builds (``jaxckpt.cli._main.build_parser``), with the
subcommands that plugins add through the ``jaxckpt.cli`` entry point (torch_bridge's
``convert``), so the pages cannot drift from the command.
"""

import argparse
import os

import mkdocs_gen_files

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
os.environ.setdefault("COLUMNS", "100")  # argparse wraps its help to the terminal width

from jaxckpt.cli._main import build_parser


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


parser = build_parser()
commands = _subcommands(parser)
index = ["# `jaxckpt` command line", "", "```text", parser.format_help().rstrip(), "```", ""]
index += ["| subcommand | page |", "|---|---|"]
for name, sub in sorted(commands.items()):
    with mkdocs_gen_files.open(f"reference/cli/{name}.md", "w") as page:
        page.write(f"# `jaxckpt {name}`\n\n```text\n{sub.format_help().rstrip()}\n```\n")
    index.append(f"| `jaxckpt {name}` | [{name}]({name}.md) |")
with mkdocs_gen_files.open("reference/cli/index.md", "w") as page:
    page.write("\n".join(index) + "\n")
