"""The public attention signature, written once.

The contract's arguments (``query, key, value, bias=None, mask=None, *, scale=None,
is_causal=False, ...``, the ones shared with ``jax.nn.dot_product_attention`` plus
jaxckpt's additions) are spelled out in exactly one place: the signature of
:func:`jaxckpt.attention.normalize`, which gives each of them its meaning. Every
public attention function is built from it by :func:`entry_point`, so adding a
keyword to the contract is one edit (to ``normalize``), and ``flash_attention``,
``attention_reference`` and every registered implementation (``npu_backend``'s
included, which take :class:`AttentionInputs`) receive it.
"""

import functools
import inspect
from collections.abc import Callable

import jax.numpy as jnp

from jaxckpt.attention._validate import AttentionInputs, finish, normalize

CONTRACT = inspect.signature(normalize)
"""``inspect.Signature`` of the contract arguments (those of :func:`normalize`)."""
RESIDUAL = inspect.Parameter("return_residual", inspect.Parameter.KEYWORD_ONLY, default=False)


def public_signature(**extra) -> inspect.Signature:
    """The contract's signature, then the keyword-only ``extra`` (name=default), then
    ``return_residual=False``."""
    kw = inspect.Parameter.KEYWORD_ONLY
    params = [*CONTRACT.parameters.values()]
    params += [inspect.Parameter(name, kw, default=default) for name, default in extra.items()]
    return CONTRACT.replace(parameters=[*params, RESIDUAL], return_annotation=inspect.Signature.empty)


def entry_point(**extra) -> Callable[[Callable], Callable]:
    """Decorator: a core on canonical inputs -> the public attention function.

    The core is ``core(inputs: AttentionInputs, **extra) -> (out [B, T, N, H],
    lse [B, N, T] fp32)``. The function returned takes the contract's arguments (see
    the module docstring), the keyword-only ``extra`` with their defaults, and
    ``return_residual=False``; it binds them (a ``TypeError`` names an unknown or
    missing argument), calls :func:`normalize`, runs the core and puts the results
    back in the caller's layout. It keeps the core's name, module and docstring, and
    ``inspect.signature`` / ``help()`` show the full public signature.

    Args:
        **extra: the keywords beyond the contract and their defaults, passed to the core.

    Example:
        >>> from jaxckpt.attention._reference import reference_normalized
        >>> @entry_point()
        ... def naive(inputs):
        ...     '''Naive attention.'''
        ...     return reference_normalized(inputs)
        >>> import inspect
        >>> str(inspect.signature(naive)).endswith("dropout_rng=None, return_residual=False)")
        True
    """
    signature = public_signature(**extra)

    def decorate(core: Callable) -> Callable:
        @functools.wraps(core)
        def public(*args, **kwargs):
            try:
                bound = signature.bind(*args, **kwargs)
            except TypeError as err:
                raise TypeError(f"{core.__name__}(): {err}; its signature is {signature}.") from None
            bound.apply_defaults()
            given = bound.arguments
            inputs: AttentionInputs = normalize(**{name: given[name] for name in CONTRACT.parameters})
            out, lse = core(inputs, **{name: given[name] for name in extra})
            return finish(out, jnp.asarray(lse), inputs.unbatched, given["return_residual"])

        public.__signature__ = signature
        public.__annotations__ = {}  # the core's (inputs: AttentionInputs, ...) are not the public ones
        return public

    return decorate
