"""A griffe extension for the API reference: ``Example:`` sections are read as ``Examples:``.

The library's docstrings head their doctests ``Example:`` (Google style allows both);
griffe parses only ``Examples:`` into code, and renders ``Example:`` as an admonition
whose ``>>>`` lines would be read as Markdown.
"""

import re

import griffe

_HEADER = re.compile(r"^(\s*)Example:[ \t]*$", re.MULTILINE)


class ExampleSections(griffe.Extension):
    """Rename each ``Example:`` section header to ``Examples:`` before the docstring is parsed."""

    def on_object(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _HEADER.sub(r"\1Examples:", obj.docstring.value)
