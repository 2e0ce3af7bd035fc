"""The public surface: every name in each package's ``__all__`` exists and is documented,
and every public function and class shows an example.

What counts as documented:

- a function, a class or a module: a docstring of its own (not one inherited from a base
  class, nor the signature a dataclass or NamedTuple writes when there is none);
- anything else (a constant, a registry dict): an attribute docstring, the string literal
  statement right after its assignment in the module that assigns it (followed through
  ``from X import NAME`` re-exports), the convention Sphinx autodoc and griffe read. A
  value carries no docstring of its own at run time, so the source is read.

What counts as an example: a Google-style ``Example:`` (or ``Examples:``) section with a
``>>>`` line after it, for each function and class (the doctests run them). Modules and
constants need no example.

Each test is parametrized per package, and a failure lists every name that lacks what.
"""

import ast
import importlib
import importlib.util
import inspect
import re
from pathlib import Path

import pytest

PACKAGES = [
    "jaxckpt",
    "jaxckpt.attention",
    "jaxckpt.remat",
    "jaxckpt.nn",
    "jaxckpt.data",
    "jaxckpt.train",
    "jaxckpt.generate",
    "jaxckpt.plan",
    "jaxckpt.cli",
    pytest.param("torch_bridge", marks=pytest.mark.torch),
    pytest.param("npu_backend", marks=pytest.mark.torch),
]

GENERIC_DOCS = {"An enumeration."}
"""Docstrings Python writes for a class that has none (Enum before 3.12)."""

EXAMPLE = re.compile(r"^\s*Examples?:\s*$.*?^\s*>>> ", re.MULTILINE | re.DOTALL)


def _exports(package: str) -> list[tuple[str, object]]:
    module = importlib.import_module(package)
    return [(name, getattr(module, name)) for name in module.__all__ if hasattr(module, name)]


def _has_code_doc(obj) -> bool:
    """Functions, classes and modules: documented by a docstring of their own."""
    return inspect.ismodule(obj) or inspect.isclass(obj) or callable(obj)


def own_docstring(obj) -> str | None:
    """``obj``'s own docstring, or None (inherited, generated or absent)."""
    if inspect.isclass(obj):
        doc = vars(obj).get("__doc__")
        generated = doc is not None and doc.startswith(f"{obj.__name__}(")  # dataclass / NamedTuple
        return None if not doc or generated or doc in GENERIC_DOCS else doc
    doc = getattr(obj, "__doc__", None)
    if not inspect.ismodule(obj) and doc is type(obj).__doc__:  # e.g. a functools.partial's
        return None
    return doc or None


def _assigns(node: ast.stmt, name: str) -> bool:
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, ast.AnnAssign | ast.AugAssign):
        targets = [node.target]
    else:
        return False
    return any(isinstance(t, ast.Name) and t.id == name for t in targets)


def attribute_docstring(module: str, name: str) -> str | None:
    """The string literal right after the last assignment of ``name`` in ``module``'s
    source, following ``from X import name`` re-exports; None when there is none."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        return None
    body = ast.parse(Path(spec.origin).read_text()).body
    doc, assigned = None, False
    for node, following in zip(body, [*body[1:], None], strict=True):
        if _assigns(node, name):
            assigned = True
            is_doc = isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
            doc = following.value.value if is_doc and isinstance(following.value.value, str) else None
    if assigned:
        return doc
    for node in body:
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    return attribute_docstring(node.module, alias.name)
    return None


@pytest.mark.parametrize("package", PACKAGES)
def test_every_exported_name_exists(package):
    module = importlib.import_module(package)
    missing = [name for name in module.__all__ if not hasattr(module, name)]
    twice = sorted({name for name in module.__all__ if module.__all__.count(name) > 1})
    assert not missing, f"{package}.__all__ names what the package does not define: {missing}"
    assert not twice, f"{package}.__all__ lists names twice: {twice}"


@pytest.mark.parametrize("package", PACKAGES)
def test_every_exported_name_has_a_docstring(package):
    undocumented = [
        name
        for name, obj in _exports(package)
        if not (own_docstring(obj) if _has_code_doc(obj) else attribute_docstring(package, name))
    ]
    assert not undocumented, (
        f"{package}: no docstring of their own (a constant: no string literal after its "
        f"assignment): {undocumented}"
    )


@pytest.mark.parametrize("package", PACKAGES)
def test_every_public_function_and_class_has_an_example(package):
    without = [
        name
        for name, obj in _exports(package)
        if not inspect.ismodule(obj) and _has_code_doc(obj) and not EXAMPLE.search(own_docstring(obj) or "")
    ]
    assert not without, f"{package}: no 'Example:' section with a '>>>' line: {without}"


def test_the_checks_themselves():
    """A generated dataclass docstring and an inherited one do not count; an attribute
    docstring is found through a re-export."""
    import dataclasses

    @dataclasses.dataclass
    class Bare:
        x: int

    class Child(Bare):
        pass

    assert own_docstring(Bare) is None and own_docstring(Child) is None
    assert own_docstring(own_docstring).startswith("``obj``'s own docstring")
    assert attribute_docstring(__name__, "GENERIC_DOCS").startswith("Docstrings Python")
    assert attribute_docstring(__name__, "PACKAGES") is None
    assert EXAMPLE.search("Does x.\n\n    Example:\n        >>> 1\n        1\n")
    assert not EXAMPLE.search("Does x.\n\n    >>> 1\n    1\n")  # no Example section
