"""The one dtype table of test tolerances, and ``assert_close`` which reads it.

Every comparison of an attention kernel with its reference goes through
:func:`assert_close`, so a tolerance is chosen in exactly one place.
``kind="fwd"`` is for outputs and log-sum-exps, ``kind="grad"`` for gradients,
which are looser: a gradient is a sum over many more rounded products (dK sums
over every query row and head of its group), and in bf16/fp16 the kernel rounds
the probabilities and dS to the input dtype before each matmul.

``atol`` is relative to the scale of the tensor, ``max(1, max|expected|)``. Each
element is a dot product whose rounding error is proportional to the size of its
terms, not to its value: an entry of dQ that cancels to 0.01 inside a tensor whose
entries reach 15 still carries an error of 15 * 2**-9 in bf16. (Measured: bf16 dQ
with a soft cap and scale 4/sqrt(H), max|dQ| = 14.6, error 0.063 at an entry of
0.0076.) The scale is at least 1, so for tensors of order one nothing changes.
"""

import jax
import jax.numpy as jnp
import numpy as np

TOL = {
    np.dtype(jnp.float32): {
        "fwd": dict(atol=2e-5, rtol=2e-5),
        "grad": dict(atol=1e-4, rtol=1e-4),
    },
    np.dtype(jnp.bfloat16): {  # 8 mantissa bits: one rounding is 2**-9 ~ 2e-3
        "fwd": dict(atol=2e-2, rtol=2e-2),
        # atol 0.06 -> 0.1, measured: dK off by 0.084 (max|dK| < 1) at B1 T51 S39 N6 K3 H8
        # with all features. Where a key is a row's only visible key the exact dS is 0,
        # but the kernel's delta = rowsum(dO * O) uses O rounded to bf16 (as FlashAttention-2
        # does), so dS ~ |dO| |O| sqrt(H) 2**-9; dropout's 1/(1 - rate) inflates O and the
        # soft-cap cases' scale 4/sqrt(H) inflates dK. The same case is off by 3e-6 in
        # float32 and 0.0066 in float16. In units of each dtype's epsilon, 0.1 is 26 bf16
        # epsilons, still tighter than float16's 0.02 (41 float16 epsilons).
        "grad": dict(atol=1e-1, rtol=6e-2),
    },
    np.dtype(jnp.float16): {  # 11 mantissa bits: one rounding is 2**-12 ~ 2.4e-4
        "fwd": dict(atol=5e-3, rtol=5e-3),
        "grad": dict(atol=2e-2, rtol=2e-2),
    },
}


def tol(dtype, kind: str = "fwd") -> dict:
    """``dict(atol=..., rtol=...)`` for ``dtype`` and ``kind`` ("fwd" or "grad")."""
    if kind not in ("fwd", "grad"):
        raise ValueError(f"kind must be 'fwd' or 'grad'; got {kind!r}.")
    return TOL[np.dtype(dtype)][kind]


def _nonfinite_problems(a: np.ndarray, e: np.ndarray) -> list[str]:
    problems = []
    if np.isnan(a).any() and not np.array_equal(np.isnan(a), np.isnan(e)):
        problems.append(f"NaN at {np.argwhere(np.isnan(a) & ~np.isnan(e))[:5].tolist()} (first 5)")
    inf_mismatch = np.isinf(a) != np.isinf(e)
    inf_mismatch |= np.isinf(a) & np.isinf(e) & (np.sign(a) != np.sign(e))
    if inf_mismatch.any():
        problems.append(f"+-inf differs at {np.argwhere(inf_mismatch)[:5].tolist()} (first 5)")
    return problems


def assert_close(actual, expected, dtype, kind: str = "fwd", name: str = "") -> None:
    """Asserts ``|actual - expected| <= atol * scale + rtol * |expected|`` elementwise.

    ``scale = max(1, max |expected|)`` over the finite entries (see the module doc).

    Both sides are compared in float32. Infinities must sit at the same places with
    the same sign (a row seeing no key has ``lse = -inf``); NaN must match NaN.

    Args:
        actual: the kernel's result.
        expected: the reference result.
        dtype: the *input* dtype that chooses the row of :data:`TOL`.
        kind: "fwd" (outputs, lse) or "grad" (gradients).
        name: what is compared (e.g. "dq"), printed on failure.
    """
    bounds = tol(dtype, kind)
    # Cast on the host (ml_dtypes casts bf16 and fp8 as XLA does): jnp's astype would compile
    # one small program for every shape and dtype the suite compares.
    a = np.asarray(jax.device_get(actual)).astype(np.float32)
    e = np.asarray(jax.device_get(expected)).astype(np.float32)
    label = f"{name or 'value'} ({np.dtype(dtype).name}, {kind}, {bounds})"
    if a.shape != e.shape:
        raise AssertionError(f"{label}: shape {a.shape} != expected shape {e.shape}")
    problems = _nonfinite_problems(a, e)
    finite = np.isfinite(a) & np.isfinite(e)
    err = np.abs(np.where(finite, a, 0.0) - np.where(finite, e, 0.0))
    scale = max(1.0, float(np.abs(np.where(finite, e, 0.0)).max(initial=0.0)))
    bad = finite & (err > bounds["atol"] * scale + bounds["rtol"] * np.abs(e))
    if bad.any():
        worst = np.unravel_index(np.argmax(np.where(bad, err, -1.0)), a.shape)
        rel = err / np.maximum(np.abs(e), np.finfo(np.float32).tiny)
        problems.append(
            f"{int(bad.sum())}/{a.size} elements out of tolerance; max abs err "
            f"{err.max():.3g}, max rel err (where out) {rel[bad].max():.3g}; worst at "
            f"{tuple(int(i) for i in worst)}: actual {a[worst]:.6g} vs expected {e[worst]:.6g}; "
            f"atol scale max(1, max|expected|) = {scale:.3g}"
        )
    if problems:
        raise AssertionError(f"{label} shape {a.shape}: " + "; ".join(problems))
