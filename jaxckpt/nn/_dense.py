"""The dense projection's matmul: ``x @ kernel`` with a backward pass laid out for XLA:CPU.

Autodiff of ``x [..., D] @ kernel [D, F]`` gives the weight gradient as a dot that
contracts over the token axes (``x^T dy``). XLA:CPU runs that layout on its slow
Eigen path, with transposes around it; a materialised ``x^T`` (an
``optimization_barrier`` keeps XLA from folding the transpose back into the dot) turns
it into a plain ``[D, N] @ [N, F]`` that the fast matmul library takes. On
``bench_finetune``'s 100M model that cut the step from 6.25 s to 5.58 s (XLA:CPU), with
gradients equal to 1e-7. Other backends lower the plain transpose: they fuse it.

The output carries ``Tag.LINEAR_OUT``, because a ``custom_vjp`` hides the dot from
``dots_with_no_batch_dims_saveable``: ``RematSpec(save_dots=True)`` saves that tag
instead, so the ``dots`` preset keeps what it kept before.
"""

import jax
import jax.numpy as jnp
from jax import lax

from jaxckpt._tags import Tag, tag


@jax.custom_vjp
def _project(x: jax.Array, kernel: jax.Array) -> jax.Array:
    return lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))


def _project_fwd(x, kernel):
    return _project(x, kernel), (x, kernel)


def _materialized_transpose(a: jax.Array) -> jax.Array:
    return lax.platform_dependent(a, cpu=lambda v: lax.optimization_barrier(v.T), default=lambda v: v.T)


def _project_bwd(residuals, dy):
    x, kernel = residuals
    dx = lax.dot_general(dy, kernel, (((dy.ndim - 1,), (1,)), ((), ())))  # dy @ kernel.T
    x2 = x.reshape(-1, x.shape[-1])
    dkernel = _materialized_transpose(x2) @ dy.reshape(-1, dy.shape[-1])
    return dx.astype(x.dtype), dkernel.astype(kernel.dtype)


_project.defvjp(_project_fwd, _project_bwd)


def dense_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kwargs):
    """``lax.dot_general`` for ``nnx.Linear(dot_general=...)``: the plain projection
    (``lhs [..., D]`` contracted with a 2-D ``rhs [D, F]``, default precision and result
    type, no output sharding) goes through the CPU-friendly backward above and is tagged
    ``Tag.LINEAR_OUT``; any other call is ``lax.dot_general`` itself.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> x, k = jnp.ones((2, 3, 4)), jnp.ones((4, 5))
        >>> dense_dot_general(x, k, (((2,), (0,)), ((), ()))).shape
        (2, 3, 5)
        >>> g = jax.grad(lambda k: dense_dot_general(x, k, (((2,), (0,)), ((), ()))).sum())(k)
        >>> float(g[0, 0])  # six tokens of ones
        6.0
    """
    plain = (
        rhs.ndim == 2
        and tuple(map(tuple, dimension_numbers[0])) == ((lhs.ndim - 1,), (0,))
        and not any(dimension_numbers[1])
        and precision is None
        and preferred_element_type is None
        and kwargs.get("out_sharding") is None
        and lhs.dtype == rhs.dtype
        and jnp.issubdtype(lhs.dtype, jnp.floating)
    )
    if not plain:
        kwargs.update(precision=precision, preferred_element_type=preferred_element_type)
        return lax.dot_general(lhs, rhs, dimension_numbers, **kwargs)
    return tag(_project(lhs, rhs), Tag.LINEAR_OUT)
