"""``remat.Layered``: a remat spec that differs across the block stack.

The numbers are checked bit for bit against the uniform specs on CPU, and the memory
against XLA's own compiled analysis: cutting the stacked ``[L, ...]`` parameters into
groups must add no copy of them or of their gradients.
"""

import functools

import jax
import jax.numpy as jnp
import pytest
import remat_cases as rc
from flax import nnx

from jaxckpt import nn, plan, remat
from jaxckpt.remat import Layered


@functools.cache
def _loss_and_grads(spec):
    return rc.loss_and_grads(rc.model(), remat.get(spec), rc.tokens())


def test_groups_are_checked_and_named():
    spec = Layered(((2, "save_attn"), (3, remat.get("ratio_0.5"))))
    assert spec.n_layers == 5 and spec.specs == (remat.get("save_attn"), remat.get("ratio_0.5"))
    assert spec.describe() == "2 x save_attn + 3 x ratio_0.5" == str(spec)
    assert remat.get(spec) is spec and hash(spec) == hash(Layered(((2, "save_attn"), (3, "ratio_0.5"))))
    assert spec.kept_tags == remat.get("save_attn").kept_tags and spec.enabled
    with pytest.raises(ValueError, match=r"groups\[1\]: count must be an int >= 1"):
        Layered(((2, "full"), (0, "full")))
    with pytest.raises(ValueError, match="unknown remat preset 'fulll'"):
        Layered(((2, "fulll"),))
    with pytest.raises(TypeError, match=r"groups\[0\] must be a \(count, spec\) pair"):
        Layered((("full",),))
    with pytest.raises(ValueError, match=r"Layered\.groups is empty"):
        Layered(())
    assert Layered.of((0, "minimal"), (5, "full")) == remat.get("full")
    assert Layered.of((2, "full"), (1, "full"), (2, "dots")) == Layered(((3, "full"), (2, "dots")))


def test_a_stack_of_another_depth_is_refused_naming_both():
    x = jnp.ones((1, 3, rc.CONFIG.d_model))
    with pytest.raises(ValueError, match="covers 4 layers; the stack has n_layers=5"):
        nn.run_blocks(rc.model().blocks, x, Layered(((1, "full"), (3, "minimal"))), n_layers=5)


def test_the_pieces_cut_each_group_as_its_spec_cuts_a_stack():
    from jaxckpt.nn._stack import stack_pieces

    pieces = stack_pieces(Layered(((3, "ratio_0.5"), (2, "full"))), 5)
    assert [(*p[:3], p[4]) for p in pieces] == [(0, 2, 2, True), (2, 3, None, False), (3, 5, None, True)]


def _equal(a, b) -> bool:
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return all(jnp.array_equal(x, y) for x, y in pairs)


def _close(a, b) -> bool:
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return all(jnp.allclose(x, y, rtol=0, atol=1e-6 * float(jnp.max(jnp.abs(y)))) for x, y in pairs)


XLA_DEFAULTS = {"xla_backend_optimization_level": 3, "xla_cpu_use_fusion_emitters": True}
"""XLA:CPU's defaults for the two options the suite lowers (``tests/conftest.py``), given per
compile: the programs below compile as a user's would, in this process."""


def _at_xla_defaults(spec):
    model = rc.model()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    args = (graphdef, params, rest, remat.get(spec), rc.tokens())
    compiled = rc._loss_and_grads.lower(*args).compile(compiler_options=XLA_DEFAULTS)
    return compiled(params, rest, rc.tokens())


@pytest.mark.slow  # 15-40 s: three programs compiled at XLA's default options
def test_with_xla_s_default_flags_a_layered_stack_is_bit_equal_to_the_uniform_specs():
    """Remat changes what is stored, not what is computed. With XLA:CPU's default options (the
    suite compiles at ``--xla_backend_optimization_level=0`` without the fusion emitters,
    whose matmuls round differently inside a group's scan: see the next test) a stack cut
    into groups of ``full`` is bit-equal to ``full``; a mixed stack's loss is bit-equal to
    the uniform stack's, and its last group's layers (whose backward pass runs first, from
    the same cotangent) get the bit-equal gradients of the uniform stack under the last
    spec."""
    full = _at_xla_defaults("full")
    split = _at_xla_defaults(Layered(((2, "full"), (3, "full"))))
    mixed = _at_xla_defaults(Layered(((2, "save_attn"), (3, "full"))))
    assert _equal(split, full)
    assert jnp.array_equal(mixed[0], full[0])
    last = lambda g: jax.tree.map(lambda a: a[2:], g["blocks"])
    assert _equal(last(mixed[1]), last(full[1]))


@pytest.mark.slow  # about 2 s each, warm: two train-step programs
@pytest.mark.parametrize(
    "first, last",
    [(("full", 2), ("full", 3)), (("save_attn", 2), ("full", 3)), (("ratio_0.5", 3), ("minimal", 2))],
    ids=["full-full", "save_attn-full", "segments-minimal"],
)
def test_a_layered_stack_computes_what_the_uniform_specs_compute(first, last):
    """Under the suite's flags: the loss bit-equal to both uniform specs', the gradients
    within float32 rounding of the last spec's, as the uniform specs are of one another
    (``full`` and ``save_attn`` differ by up to 1e-7 of the largest gradient)."""
    (a, k), (b, rest) = first, last
    loss, grads = _loss_and_grads(Layered.of((k, a), (rest, b)))
    for name in (a, b):
        assert jnp.array_equal(loss, _loss_and_grads(name)[0])
    assert _close(grads, _loss_and_grads(b)[1])


@pytest.mark.slow  # about 3 s: two compiled train steps
def test_cutting_the_stack_copies_neither_the_parameters_nor_their_gradients():
    """Two groups of ``full`` are ``full``: XLA's peak is the uniform stack's to within a
    small part of one layer's parameters (a copy of the stack, or of its gradients, would
    add all of them)."""
    workload = plan.Workload(rc.CONFIG, batch=rc.B, seq=rc.T)
    uniform = plan.measure(workload, "full")
    cut = plan.measure(workload, Layered(((2, "full"), (3, "full"))))
    stack = plan.tree_bytes(nnx.state(rc.model().blocks))
    assert cut.peak - uniform.peak < stack / rc.CONFIG.n_layers / 2, (cut.peak, uniform.peak, stack)


def test_describe_asks_for_the_groups_one_by_one():
    with pytest.raises(ValueError, match="describe the groups' specs one by one"):
        remat.describe(rc.model(), (2, 8), Layered(((2, "full"), (3, "minimal"))))


def test_compressed_compresses_each_remat_group():
    spec = remat.compressed(Layered(((2, "none"), (3, "save_attn"))), "int8")
    assert spec.specs == (remat.get("none"), remat.compressed("save_attn", "int8"))


def test_a_rematspec_is_not_a_group_of_groups():
    with pytest.raises(TypeError, match="a group's spec is a RematSpec, not a Layered"):
        Layered(((2, Layered(((2, "full"),))),))
