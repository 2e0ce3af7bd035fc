"""Varying-manual-axes (``shard_map`` with ``check_vma=True``) for the kernels' loop carries.

Inside ``jax.shard_map`` every value has a type that says over which manual mesh
axes it varies, and a ``fori_loop`` / ``scan`` carry must keep its type. A carry
created from constants (``jnp.zeros``) varies over no axis, while the loop body,
which reads the sharded inputs, returns one that varies over theirs. The kernels
therefore cast each initial carry to vary like the inputs it will be combined
with. Outside ``shard_map`` (or with ``check_vma=False``) nothing varies and
these are no-ops.
"""

import jax


def varying_axes(x) -> frozenset:
    """The manual mesh axes over which ``x`` varies (empty outside ``shard_map``)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)  # jax >= 0.9: aval.mat.varying; before: aval.vma
    return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def vary_like(tree, *like):
    """``tree`` with every leaf cast to vary over each axis some leaf of ``like`` varies over.

    Args:
        tree: the initial loop carry (a pytree of arrays).
        like: pytrees of the arrays the loop body combines with the carry.

    Returns:
        ``tree``, each leaf passed through ``jax.lax.pcast(..., to="varying")`` for the
        axes it lacks; unchanged when nothing varies.
    """
    axes = frozenset().union(*(varying_axes(x) for x in jax.tree.leaves(like)))
    if not axes:
        return tree

    def cast(x):
        missing = tuple(sorted(axes - varying_axes(x)))
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(cast, tree)
