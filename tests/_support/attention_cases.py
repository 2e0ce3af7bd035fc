"""Random attention inputs and feature arguments for the attention tests.

A :class:`Case` names a shape, a dtype, a set of features (the names of
``jaxckpt.attention.FEATURES``) and block sizes; :func:`build` turns it into
arrays. :func:`evaluate` runs one implementation (forward, lse and gradients in
one jit), :func:`visible_np` is an independent NumPy oracle of the mask.

Every XLA compile costs seconds on a CPU, so the helpers avoid the ones that test
nothing: arrays are made in NumPy and placed with ``jax.device_put`` (``jnp.asarray``
of a NumPy array compiles a small program per shape and dtype), and :func:`evaluate`
reuses one jitted program per function and static options, so that a repeated call
is neither retraced nor recompiled.
"""

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import jaxckpt

FEATURES = ("bias", "mask", "causal", "lengths", "window", "segments", "softcap", "dropout")
SOFT_CAP = 5.0
DROPOUT_RATE = 0.3


@dataclasses.dataclass(frozen=True)
class Case:
    """One attention call: B, T, S, N, K, H, dtype, features, block sizes.

    ``variant`` picks among the broadcast shapes of bias and mask and the two
    forms of segment ids, so that a grid of cases covers all of them.
    """

    b: int = 2
    t: int = 129
    s: int = 300
    n: int = 6
    k: int = 3
    h: int = 40
    dtype: str = "float32"
    features: tuple[str, ...] = ()
    block: tuple[int, int] | None = (32, 64)
    variant: int = 0
    seed: int = 0

    @property
    def id(self) -> str:
        feats = "+".join(self.features) or "plain"
        blk = "default" if self.block is None else f"{self.block[0]}x{self.block[1]}"
        dt = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}[self.dtype]
        shape = f"B{self.b}T{self.t}S{self.s}N{self.n}K{self.k}H{self.h}"
        return f"{dt}-{shape}-{feats}-blk{blk}-v{self.variant}"

    @property
    def block_sizes(self):
        return None if self.block is None else jaxckpt.BlockSizes(*self.block)


class Inputs(NamedTuple):
    q: jax.Array  # [B, T, N, H]
    k: jax.Array  # [B, S, K, H]
    v: jax.Array  # [B, S, K, H]
    arrays: dict  # traced keyword arguments: bias, mask, lengths, segment_ids, dropout_rng
    static: dict  # static keyword arguments: is_causal, local_window_size, scale, ...
    w: jax.Array  # float32 [B, T, N, H]: loss weights, loss = sum(out * w)


class Result(NamedTuple):
    out: np.ndarray
    lse: np.ndarray
    grads: dict  # "dq", "dk", "dv" and, with a bias, "dbias"


BIAS_SHAPES = ("1NTS", "B1TS", "111S", "BNTS")
MASK_SHAPES = ("B1TS", "1NTS", "BNTS", "B11S")


def device(x, dtype=None) -> jax.Array:
    """``x`` as a device array, converted in NumPy (bit-identical to XLA's rounding) and
    placed with ``jax.device_put``: unlike ``jnp.asarray`` this compiles nothing."""
    return jax.device_put(np.asarray(x, dtype=None if dtype is None else jnp.dtype(dtype)))


def _shape(code: str, b, n, t, s) -> tuple[int, ...]:
    full = {"B": b, "N": n, "T": t, "S": s}
    return tuple(full.get(c, 1) for c in code)


def _lengths(rng: np.random.Generator, size: int, b: int) -> np.ndarray:
    lengths = rng.integers(1, size + 1, size=b)
    lengths[0] = max(1, size - 3) if size > 1 else 1  # at least one strictly short
    return lengths.astype(np.int32)


def _segment_ids(rng: np.random.Generator, b: int, size: int, n_segments: int = 3) -> np.ndarray:
    """Packed sequences: sorted ids, each row a few contiguous segments."""
    return np.sort(rng.integers(0, n_segments, size=(b, size)), axis=1).astype(np.int32)


def random_mask(rng: np.random.Generator, shape, p_true: float = 0.75) -> np.ndarray:
    mask = rng.random(shape) < p_true
    if not mask.any():
        mask.flat[0] = True
    return mask


def feature_kwargs(case: Case, rng: np.random.Generator) -> tuple[dict, dict]:
    """``(arrays, static)`` keyword arguments for the features of ``case``."""
    unknown = set(case.features) - set(FEATURES)
    if unknown:
        raise ValueError(f"unknown features {sorted(unknown)}")
    b, t, s, n, f, dt = case.b, case.t, case.s, case.n, case.features, case.dtype
    arrays, static = {}, {}
    if "bias" in f:
        shape = _shape(BIAS_SHAPES[case.variant % 4], b, n, t, s)
        arrays["bias"] = device(rng.standard_normal(shape), dt)
    if "mask" in f:
        arrays["mask"] = device(random_mask(rng, _shape(MASK_SHAPES[case.variant % 4], b, n, t, s)))
    if "causal" in f:
        static["is_causal"] = True
    if "lengths" in f:
        arrays["query_seq_lengths"] = device(_lengths(rng, t, b))
        arrays["key_value_seq_lengths"] = device(_lengths(rng, s, b))
    if "window" in f:
        static["local_window_size"] = (int(rng.integers(0, 9)), int(rng.integers(0, 9)))
    if "segments" in f:
        q_ids = _segment_ids(rng, b, t)
        if t == s and case.variant % 2 == 0:
            arrays["segment_ids"] = device(q_ids)  # the single-array form
        else:
            arrays["segment_ids"] = (device(q_ids), device(_segment_ids(rng, b, s)))
    if "softcap" in f:
        static["logits_soft_cap"] = SOFT_CAP
        static["scale"] = 4.0 / math.sqrt(case.h)  # logits well past the cap
    if "dropout" in f:
        static["dropout_rate"] = DROPOUT_RATE
        arrays["dropout_rng"] = jax.random.key(1000 + case.seed)
    return arrays, static


def normal(rng: np.random.Generator, shape, dtype, scale: float = 1.0) -> jax.Array:
    return device(scale * rng.standard_normal(shape), dtype)


def build(case: Case) -> Inputs:
    """Random inputs for ``case`` (deterministic in ``case``)."""
    rng = np.random.default_rng([case.seed, case.variant, case.t, case.s, case.h])
    q = normal(rng, (case.b, case.t, case.n, case.h), case.dtype)
    k = normal(rng, (case.b, case.s, case.k, case.h), case.dtype)
    v = normal(rng, (case.b, case.s, case.k, case.h), case.dtype)
    arrays, static = feature_kwargs(case, rng)
    w = normal(rng, (case.b, case.t, case.n, case.h), jnp.float32)
    return Inputs(q, k, v, arrays, static, w)


JAX_NN_ROUTES = frozenset({"xla", "cudnn"})
"""The implementations that call ``jax.nn.dot_product_attention``. Its low-precision path is
not written for strict dtype promotion (it calls ``jnp.promote_types(bf16, f32)`` and mixes
dtypes in its backward), so those calls run under standard promotion; every other one
runs under the suite's strict promotion."""


def promotion_for(fn, implementation) -> str:
    """``"standard"`` for jax.nn and the routes through it, else ``"strict"``."""
    through_jax_nn = fn is jax.nn.dot_product_attention or implementation in JAX_NN_ROUTES
    return "standard" if through_jax_nn else "strict"


def evaluate(fn, inp: Inputs, promotion: str | None = None, **extra) -> Result:
    """Output, lse and gradients (wrt q, k, v, bias) of ``sum(fn(...) * w)``, in one jit,
    under dtype ``promotion`` (default: :func:`promotion_for` the call)."""
    arrays = {name: x for name, x in inp.arrays.items() if name != "bias"}
    diff = {"dq": inp.q, "dk": inp.k, "dv": inp.v}
    if "bias" in inp.arrays:
        diff["dbias"] = inp.arrays["bias"]
    grad_fn = _loss_and_grads(fn, tuple(inp.static.items()), tuple(extra.items()))
    with jax.numpy_dtype_promotion(promotion or promotion_for(fn, extra.get("implementation"))):
        (_, (out, lse)), grads = grad_fn(diff, arrays, inp.w)
    return Result(np.asarray(out), np.asarray(lse), {n: np.asarray(g) for n, g in grads.items()})


@functools.lru_cache(maxsize=512)
def _loss_and_grads(fn, static: tuple, extra: tuple):
    """One jitted ``value_and_grad`` per function and static options (block sizes and the
    implementation among them): a call with the same shapes and options, in any test,
    reuses its trace and its compiled program instead of compiling it again."""

    def loss(diff, arrays, w):
        out, lse = fn(
            diff["dq"],
            diff["dk"],
            diff["dv"],
            diff.get("dbias"),
            **arrays,
            **dict(static),
            **dict(extra),
            return_residual=True,
        )
        return jnp.sum(out.astype(jnp.float32) * w), (out, lse)

    return jax.jit(jax.value_and_grad(loss, has_aux=True))


def features_of(inp: Inputs) -> set[str]:
    """The feature names jaxckpt itself reports for these inputs."""
    p = jaxckpt.attention.normalize(inp.q, inp.k, inp.v, **inp.arrays, **inp.static)
    return jaxckpt.attention.features_used(p)


def visible_np(inp: Inputs) -> np.ndarray:
    """NumPy oracle: bool ``[B, N, T, S]``, True where query t may attend key s."""
    (b, t, n, _), s = inp.q.shape, inp.k.shape[1]
    a, st = inp.arrays, inp.static
    qi, ki = np.arange(t)[:, None], np.arange(s)[None, :]
    vis = np.ones((b, n, t, s), bool)
    if st.get("is_causal"):
        vis &= ki <= qi
    window = st.get("local_window_size")
    if window is not None:
        left, right = (window, window) if isinstance(window, int) else window
        vis &= (ki >= qi - left) & (ki <= qi + right)
    if a.get("query_seq_lengths") is not None:
        vis &= qi < np.asarray(a["query_seq_lengths"])[:, None, None, None]
    if a.get("key_value_seq_lengths") is not None:
        vis &= ki < np.asarray(a["key_value_seq_lengths"])[:, None, None, None]
    if a.get("segment_ids") is not None:
        seg = a["segment_ids"]
        q_ids, kv_ids = (seg, seg) if not isinstance(seg, tuple) else seg
        vis &= np.asarray(q_ids)[:, None, :, None] == np.asarray(kv_ids)[:, None, None, :]
    if a.get("mask") is not None:
        vis &= np.asarray(a["mask"]).reshape((1,) * (4 - a["mask"].ndim) + a["mask"].shape)
    return vis


def seen_rows(inp: Inputs) -> np.ndarray:
    """bool ``[B, T, N]``: rows that see at least one key."""
    return visible_np(inp).any(-1).transpose(0, 2, 1)
