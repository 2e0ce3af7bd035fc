"""``call_torch``: a torch function of arrays as a JAX function (jit, vmap and grad)."""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from torch_bridge.interop._dlpack import tensor_to_numpy, to_torch, torch_dtype
from torch_bridge.interop._torch import torch

__all__ = ["VMAP_METHODS", "call_torch"]

VMAP_METHODS = ("sequential", "sequential_unrolled", "expand_dims", "broadcast_all")
# Under "expand_dims" an unbatched input reaches torch with a leading axis of size 1, and
# autograd would sum its gradient over the batch; the backward broadcasts it instead, so
# every input gets the per-example gradient that vmap expects.
_BACKWARD_VMAP = {"expand_dims": "broadcast_all"}
_BATCHING = frozenset({"expand_dims", "broadcast_all"})  # fn sees (and returns) a leading batch axis
_ARRAY_LIKE = (jax.Array, np.ndarray, np.generic, bool, int, float, complex)
_th = functools.cache(torch)  # the host callbacks run per call: skip the import machinery


@dataclasses.dataclass(frozen=True)
class _Spec:
    """What both host callbacks need to know about one traced call (fixed at trace time)."""

    fn: Callable[..., Any]
    in_tree: Any
    in_names: tuple[str, ...]
    in_avals: tuple[jax.ShapeDtypeStruct, ...]
    out_tree: Any
    out_names: tuple[str, ...]
    out_avals: tuple[jax.ShapeDtypeStruct, ...]
    vmap_method: str

    @functools.cached_property
    def diff_in(self) -> tuple[bool, ...]:
        """Real floating inputs: the ones autograd differentiates."""
        return tuple(jnp.issubdtype(a.dtype, jnp.floating) for a in self.in_avals)

    @functools.cached_property
    def diff_out(self) -> tuple[bool, ...]:
        """Real floating outputs: the ones that receive a cotangent."""
        return tuple(jnp.issubdtype(a.dtype, jnp.floating) for a in self.out_avals)

    @functools.cached_property
    def out_torch_dtypes(self) -> tuple:
        return tuple(torch_dtype(a.dtype) for a in self.out_avals)


def _names(prefix: str, tree) -> tuple[str, ...]:
    paths, _ = jax.tree_util.tree_flatten_with_path(tree)
    return tuple(prefix + jax.tree_util.keystr(path) for path, _ in paths)


def _batch_shape(spec: _Spec, arrays) -> tuple[int, ...]:
    """Leading axes that vmap's "expand_dims"/"broadcast_all" added to the inputs."""
    if spec.vmap_method not in _BATCHING:
        return ()
    prefixes = [a.shape[: a.ndim - len(v.shape)] for a, v in zip(arrays, spec.in_avals, strict=True)]
    return np.broadcast_shapes(*prefixes) if prefixes else ()


def _flat_outputs(spec: _Spec, out, arrays) -> list:
    """fn's outputs as a flat list of tensors, checked against ``out_shape_dtypes``."""
    th = _th()
    leaves, tree = jax.tree.flatten(out)
    if tree != spec.out_tree:
        raise ValueError(f"call_torch: fn returned the structure {tree}, out_shape_dtypes is {spec.out_tree}")
    batch = _batch_shape(spec, arrays)
    for name, leaf, aval, dtype in zip(
        spec.out_names, leaves, spec.out_avals, spec.out_torch_dtypes, strict=True
    ):
        if not isinstance(leaf, th.Tensor):
            raise TypeError(f"call_torch: fn's {name} must be a torch.Tensor, got {type(leaf).__name__}")
        if leaf.dtype != dtype:
            raise TypeError(
                f"call_torch: fn's {name} has dtype {leaf.dtype}, out_shape_dtypes says {aval.dtype}; "
                f"cast it in fn (.to({dtype})) or fix out_shape_dtypes"
            )
        if tuple(leaf.shape) != (*batch, *aval.shape):
            raise ValueError(
                f"call_torch: fn's {name} has shape {tuple(leaf.shape)}, out_shape_dtypes says "
                f"{(*batch, *aval.shape)}"
            )
    return leaves


def _forward_host(spec: _Spec, *arrays):
    """Runs fn once, without autograd; called by XLA on the host."""
    inputs = [to_torch(a) for a in arrays]
    versions = [t._version for t in inputs]
    with _th().no_grad():
        out = spec.fn(*jax.tree.unflatten(spec.in_tree, inputs))
    for name, t, version in zip(spec.in_names, inputs, versions, strict=True):
        if t._version != version:
            raise ValueError(
                f"call_torch: fn modified {name} in place, which would corrupt a JAX buffer; "
                "use out-of-place ops (x.add(1), not x.add_(1))"
            )
    return [tensor_to_numpy(t) for t in _flat_outputs(spec, out, arrays)]


def _backward_host(spec: _Spec, *arrays):
    """Re-runs fn under autograd and pulls the cotangents back; called by XLA on the host."""
    th = _th()
    primals, cts = arrays[: len(spec.in_avals)], iter(arrays[len(spec.in_avals) :])
    with th.enable_grad():
        inputs = [to_torch(a).detach().requires_grad_(d) for a, d in zip(primals, spec.diff_in, strict=True)]
        outs = _flat_outputs(spec, spec.fn(*jax.tree.unflatten(spec.in_tree, inputs)), primals)
        pairs = [(o, to_torch(next(cts))) for o, d in zip(outs, spec.diff_out, strict=True) if d]
        pairs = [(o, ct) for o, ct in pairs if o.requires_grad]
        wrt = [t for t, d in zip(inputs, spec.diff_in, strict=True) if d]
        if not pairs:  # no output depends on a differentiable input
            return [tensor_to_numpy(th.zeros_like(t)) for t in wrt]
        grads = th.autograd.grad(
            [o for o, _ in pairs],
            wrt,
            grad_outputs=[ct for _, ct in pairs],
            allow_unused=True,
            materialize_grads=True,
        )
    return [tensor_to_numpy(g) for g in grads]


def _differentiable(spec: _Spec) -> Callable[..., list]:
    """The flat JAX function: a pure_callback forward, a torch.autograd backward."""
    forward_cb = functools.partial(_forward_host, spec)
    backward_cb = functools.partial(_backward_host, spec)

    def forward(*xs):
        return jax.pure_callback(forward_cb, list(spec.out_avals), *xs, vmap_method=spec.vmap_method)

    def fwd(*xs):
        return forward(*xs), xs

    def bwd(xs, cts):
        for name, aval in zip(spec.in_names, spec.in_avals, strict=True):
            if jnp.issubdtype(aval.dtype, jnp.complexfloating):
                raise TypeError(
                    f"call_torch: cannot differentiate through the complex input {name} ({aval.dtype}); "
                    "pass its real and imaginary parts as separate float arrays"
                )
        diff_cts = [ct for ct, d in zip(cts, spec.diff_out, strict=True) if d]
        grad_avals = [
            jax.ShapeDtypeStruct(x.shape, x.dtype) for x, d in zip(xs, spec.diff_in, strict=True) if d
        ]
        vmap_method = _BACKWARD_VMAP.get(spec.vmap_method, spec.vmap_method)
        grads = iter(
            jax.pure_callback(backward_cb, grad_avals, *xs, *diff_cts, vmap_method=vmap_method)
            if grad_avals
            else []
        )
        return tuple(
            next(grads) if d else np.zeros(x.shape, jax.dtypes.float0)
            for x, d in zip(xs, spec.diff_in, strict=True)
        )

    f = jax.custom_vjp(forward)
    f.defvjp(fwd, bwd)
    return f


def _out_avals(out_shape_dtypes, args) -> Any:
    """``out_shape_dtypes``, or what it returns for the inputs' ShapeDtypeStructs."""
    if callable(out_shape_dtypes) and not isinstance(out_shape_dtypes, jax.ShapeDtypeStruct):
        in_avals = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), args)
        out_shape_dtypes = out_shape_dtypes(*in_avals)
    leaves = jax.tree.leaves(out_shape_dtypes)
    if not leaves:
        raise ValueError("call_torch: out_shape_dtypes has no leaves; fn must return at least one tensor")
    for name, leaf in zip(_names("out_shape_dtypes", out_shape_dtypes), leaves, strict=True):
        if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
            raise TypeError(
                f"call_torch: {name} must be a jax.ShapeDtypeStruct (or have .shape and .dtype), "
                f"got {type(leaf).__name__}"
            )
        if torch_dtype(leaf.dtype) is None:
            raise TypeError(
                f"call_torch: {name} has dtype {leaf.dtype}, which torch cannot exchange via DLPack"
            )
        if jax.dtypes.canonicalize_dtype(leaf.dtype) != np.dtype(leaf.dtype):
            raise ValueError(
                f"call_torch: {name} has dtype {np.dtype(leaf.dtype)}, a 64-bit type, but "
                "jax_enable_x64 is off; declare the 32-bit type and cast in fn"
            )
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), out_shape_dtypes)


def call_torch(
    fn: Callable[..., Any],
    out_shape_dtypes: Any | Callable[..., Any],
    *,
    vmap_method: str = "sequential",
) -> Callable[..., Any]:
    """Wraps a torch function of tensors as a JAX function usable under jit, vmap and grad.

    The wrapped function takes pytrees of arrays (or scalars) as positional arguments;
    ``fn`` receives the same pytrees with ``torch.Tensor`` leaves (CPU tensors that
    share memory with JAX's buffers: ``fn`` must not modify them in place), and must
    return a pytree of tensors matching ``out_shape_dtypes``. Pass static settings by
    closing over them (``functools.partial``). JAX treats ``fn`` as pure: it may run it
    more than once, or not at all when its outputs are unused. On a GPU backend the
    callback still hands ``fn`` host (CPU) tensors.

    The forward runs ``fn`` under ``torch.no_grad()`` in a ``jax.pure_callback``. The
    gradient (``jax.custom_vjp``) re-runs ``fn`` under ``torch.enable_grad()`` in a
    second callback and calls ``torch.autograd.grad`` with the cotangents: only real
    floating inputs are differentiated (integer and bool inputs get float0 cotangents,
    unused inputs get zeros). Limits: reverse mode only, first order only (no
    ``jax.jvp``, no ``jax.hessian``); no gradient through complex inputs (TypeError).

    Overhead: each callback is a host round trip. Measured on a 2-core CPU shared with
    other work (``benchmarks/bench_call_torch.py``: jitted, ``torch.sin`` of a [7]
    float32 array, median of 2000 calls, several runs): the forward costs 140-170 µs
    per call against ~7 µs for ``jnp.sin`` and ~80 µs for a bare numpy
    ``jax.pure_callback`` (the floor of any host callback); ``jax.grad`` costs
    310-330 µs (up to ~670 µs while the cores were busy) against ~7 µs. Under
    ``jax.grad`` XLA drops the unused forward callback and the backward re-runs fn
    under autograd; ``value_and_grad`` pays both. Use it for kernels large enough to
    hide that cost.

    Args:
        fn: a function of torch tensors returning a pytree of torch tensors.
        out_shape_dtypes: a pytree of ``jax.ShapeDtypeStruct`` (one per output leaf,
            unbatched shapes), or a callable that receives one ``jax.ShapeDtypeStruct``
            pytree per positional argument and returns that pytree (e.g.
            ``lambda x: x`` for a shape-preserving fn). 64-bit dtypes need
            ``jax_enable_x64``.
        vmap_method: how ``jax.vmap`` calls ``fn``: ``"sequential"`` (a loop, one
            example per call), ``"sequential_unrolled"``, ``"expand_dims"`` (one call,
            batched inputs with a leading axis, unbatched ones with a leading 1) or
            ``"broadcast_all"`` (one call, every input tiled to the batch). With the last
            two, ``fn`` must treat the leading axis as a batch and return outputs with
            it. The backward of ``"expand_dims"`` uses ``"broadcast_all"`` so that
            unbatched inputs get per-example gradients.

    Returns:
        A function of the same positional pytrees as ``fn``, returning JAX arrays in
        the structure of ``out_shape_dtypes``. Errors found in ``fn``'s outputs (shape,
        dtype, structure) surface at run time, as a ``JaxRuntimeError`` that quotes them.

    Raises:
        TypeError: if ``fn`` is not callable, an argument leaf is not an array, an
            ``out_shape_dtypes`` leaf has no shape/dtype, or on a gradient through a
            complex input.
        ValueError: if ``vmap_method`` is not one of ``VMAP_METHODS``, or
            ``out_shape_dtypes`` is empty or asks for a 64-bit dtype without x64.

    Example:
        >>> import jax, jax.numpy as jnp, torch
        >>> f = call_torch(lambda x, y: torch.sin(x) * y, lambda x, y: x)
        >>> x, y = jnp.array([0.0, 1.0, 2.0]), jnp.array([3.0, 5.0, 7.0])
        >>> [round(v, 4) for v in jax.jit(f)(x, y).tolist()]
        [0.0, 4.2074, 6.3651]
        >>> g = jax.grad(lambda x: f(x, y).sum())(x)  # y * cos(x), through torch.autograd
        >>> [round(v, 4) for v in g.tolist()]
        [3.0, 2.7015, -2.913]
    """
    if not callable(fn):
        raise TypeError(f"call_torch: fn must be callable, got {type(fn).__name__}")
    if vmap_method not in VMAP_METHODS:
        raise ValueError(f"call_torch: vmap_method must be one of {VMAP_METHODS}, got {vmap_method!r}")

    @functools.wraps(fn)
    def wrapped(*args):
        th = _th()
        for name, leaf in zip(_names("args", args), jax.tree.leaves(args), strict=True):
            if isinstance(leaf, th.Tensor):
                raise TypeError(f"call_torch: {name} is a torch.Tensor; pass a JAX array (to_jax(tensor))")
            if not isinstance(leaf, _ARRAY_LIKE):
                raise TypeError(f"call_torch: {name} must be an array, got {type(leaf).__name__}")
        out_avals = _out_avals(out_shape_dtypes, args)
        leaves, in_tree = jax.tree.flatten(args)
        leaves = [jnp.asarray(x) for x in leaves]
        out_leaves, out_tree = jax.tree.flatten(out_avals)
        spec = _Spec(
            fn=fn,
            in_tree=in_tree,
            in_names=_names("args", args),
            in_avals=tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves),
            out_tree=out_tree,
            out_names=_names("output", out_avals),
            out_avals=tuple(out_leaves),
            vmap_method=vmap_method,
        )
        return jax.tree.unflatten(out_tree, _differentiable(spec)(*leaves))

    return wrapped
