"""Where a traced step places its ``checkpoint_name`` tags in the user's source: ``explain``
names a compiled buffer by the tag placed at its HLO source line (``checkpoint_name`` itself
leaves nothing in the compiled program)."""

import jax

from jaxckpt.plan._program_graph import subjaxprs
from jaxckpt.plan._targets import Target, deviceless


def tag_sites(step_fn, abstract_args: tuple, target: Target | None) -> dict:
    """``(file, line) -> tag``: where each ``checkpoint_name`` of the traced step was placed
    (the innermost frame of its call outside JAX and ``jaxckpt._tags``); and, under the key
    ``("scan", file, line)``, the tag a scan's body places on its carry (``layer_input``),
    by the scan's own line: what a loop stacks when it stores its carry."""
    try:
        if target is None:
            closed = jax.make_jaxpr(step_fn)(*abstract_args)
        else:
            with deviceless(target):
                closed = jax.make_jaxpr(step_fn)(*abstract_args)
    except Exception:  # a step that traces only under jit (static arguments): no tags named
        return {}
    sites = {}
    for eqn in _equations(closed.jaxpr):
        if eqn.primitive.name == "name":
            frame = _user_frame(eqn)
            if frame is not None:
                sites.setdefault(frame, str(eqn.params["name"]))
        elif eqn.primitive.name == "scan":
            frame = _user_frame(eqn)
            tag = _input_tag(getattr(eqn.params["jaxpr"], "jaxpr", eqn.params["jaxpr"]))
            if frame is not None and tag is not None:
                sites.setdefault(("scan", *frame), tag)
    return sites


def _input_tag(jaxpr, depth: int = 0) -> str | None:
    """The tag a jaxpr (or one it calls) places on one of its own inputs."""
    inputs = set(map(id, jaxpr.invars))
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "name" and id(eqn.invars[0]) in inputs:
            return str(eqn.params["name"])
        if depth < 6:
            for inner in subjaxprs(eqn):
                if tag := _input_tag(inner, depth + 1):
                    return tag
    return None


def _equations(jaxpr, depth: int = 0):
    for eqn in jaxpr.eqns:
        yield eqn
        if depth > 20:
            continue
        for inner in subjaxprs(eqn):
            yield from _equations(inner, depth + 1)


def _user_frame(eqn) -> tuple[str, int] | None:
    traceback = getattr(eqn.source_info, "traceback", None)
    if traceback is None:
        return None
    for frame in traceback.frames:  # innermost first
        file = frame.file_name.replace("\\", "/")
        if "/jax/" in file or "/jaxlib/" in file or file.endswith("jaxckpt/_tags.py"):
            continue
        return (frame.file_name, frame.line_num)
    return None
