"""Bad inputs raise ValueError/TypeError that name the argument and show the shapes.

Every check runs eagerly and under ``jax.jit`` (validation happens at trace time),
and for both ``flash_attention`` and ``attention_reference``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxckpt
from jaxckpt.attention import available_implementations

B, T, S, N, K, H = 2, 7, 9, 6, 3, 16


def _arr(shape, dtype=jnp.float32):
    """Converted in NumPy and placed with device_put: jnp.asarray would compile a program
    for each of the module's shapes at import."""
    return jax.device_put(np.random.default_rng(len(shape)).standard_normal(shape).astype(dtype))


def _qkv(q_shape=(B, T, N, H), kv_shape=(B, S, K, H), dtype=jnp.float32):
    return _arr(q_shape, dtype), _arr(kv_shape, dtype), _arr(kv_shape, dtype)


# name -> (q, k, v, kwargs, exception, substrings the message must contain)
BAD_INPUTS = {
    "rank_mismatch": (*_qkv(kv_shape=(S, K, H)), {}, ValueError, ["(2, 7, 6, 16)", "(9, 3, 16)"]),
    "rank_5": (*_qkv(q_shape=(1, B, T, N, H), kv_shape=(1, B, S, K, H)), {}, ValueError, ["rank"]),
    "head_dim_mismatch": (
        *_qkv(kv_shape=(B, S, K, 8)),
        {},
        ValueError,
        ["head dim", "(2, 7, 6, 16)", "(2, 9, 3, 8)"],
    ),
    "heads_not_multiple": (
        *_qkv(q_shape=(B, T, 5, H)),
        {},
        ValueError,
        ["N=5", "K=3", "(2, 7, 5, 16)"],
    ),
    "batch_mismatch": (*_qkv(kv_shape=(3, S, K, H)), {}, ValueError, ["batch", "(3, 9, 3, 16)"]),
    "key_value_mismatch": (
        _arr((B, T, N, H)),
        _arr((B, S, K, H)),
        _arr((B, 11, K, H)),
        {},
        ValueError,
        ["value", "(2, 11, 3, 16)"],
    ),
    "mask_not_broadcastable": (
        *_qkv(),
        {"mask": jnp.ones((B, N, T, 5), bool)},
        ValueError,
        ["mask", "(2, 6, 7, 5)", "(2, 6, 7, 9)"],
    ),
    "mask_rank_5": (*_qkv(), {"mask": jnp.ones((1, B, N, T, S), bool)}, ValueError, ["mask"]),
    "bias_not_broadcastable": (
        *_qkv(),
        {"bias": _arr((3, 1, T, S))},
        ValueError,
        ["bias", "(3, 1, 7, 9)", "(2, 6, 7, 9)"],
    ),
    "float_mask": (*_qkv(), {"mask": jnp.ones((B, 1, T, S))}, TypeError, ["mask", "float32"]),
    "integer_bias": (*_qkv(), {"bias": jnp.ones((T, S), jnp.int32)}, TypeError, ["bias", "int32"]),
    "dropout_without_rng": (*_qkv(), {"dropout_rate": 0.2}, ValueError, ["dropout_rng"]),
    "dropout_rate_one": (
        *_qkv(),
        {"dropout_rate": 1.0, "dropout_rng": jax.random.key(0)},
        ValueError,
        ["dropout_rate"],
    ),
    "negative_window": (*_qkv(), {"local_window_size": (-1, 2)}, ValueError, ["local_window_size"]),
    "bad_window_type": (*_qkv(), {"local_window_size": "wide"}, TypeError, ["local_window_size"]),
    "integer_query": (*_qkv(dtype=jnp.int32), {}, TypeError, ["query", "int32"]),
    "mixed_dtypes": (
        _arr((B, T, N, H)),
        _arr((B, S, K, H), jnp.bfloat16),
        _arr((B, S, K, H), jnp.bfloat16),
        {},
        TypeError,
        ["float32", "bfloat16"],
    ),
    "lengths_wrong_shape": (
        *_qkv(),
        {"query_seq_lengths": jnp.ones((B, 1), jnp.int32)},
        ValueError,
        ["query_seq_lengths", "(2, 1)", "(2,)"],
    ),
    "float_lengths": (
        *_qkv(),
        {"key_value_seq_lengths": jnp.ones((B,))},
        TypeError,
        ["key_value_seq_lengths", "float32"],
    ),
    "single_segment_ids_t_ne_s": (
        *_qkv(),
        {"segment_ids": jnp.zeros((B, T), jnp.int32)},
        ValueError,
        ["segment_ids", "T=7", "S=9"],
    ),
    "segment_ids_wrong_shape": (
        *_qkv(),
        {"segment_ids": (jnp.zeros((B, T), jnp.int32), jnp.zeros((B, T), jnp.int32))},
        ValueError,
        ["segment_ids", "(2, 7)", "(2, 9)"],
    ),
    "negative_soft_cap": (*_qkv(), {"logits_soft_cap": -1.0}, ValueError, ["logits_soft_cap"]),
}


def _check_message(excinfo, substrings):
    message = str(excinfo.value)
    missing = [s for s in substrings if s not in message]
    assert not missing, f"message lacks {missing}: {message!r}"


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("fn", [jaxckpt.flash_attention, jaxckpt.attention_reference], ids=["flash", "ref"])
@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_raises_a_teaching_error(name, fn, jit):
    q, k, v, kwargs, exc, substrings = BAD_INPUTS[name]
    arrays = {n: x for n, x in kwargs.items() if isinstance(x, jax.Array)}
    static = {n: x for n, x in kwargs.items() if n not in arrays}
    call = lambda q, k, v, arrays: fn(q, k, v, **arrays, **static)
    with pytest.raises(exc) as excinfo:
        (jax.jit(call) if jit else call)(q, k, v, arrays)
    _check_message(excinfo, substrings)


def test_unknown_implementation_lists_the_available_ones():
    with pytest.raises(ValueError) as excinfo:
        jaxckpt.flash_attention(*_qkv(), implementation="flashy")
    _check_message(excinfo, ["flashy", *available_implementations()])


def test_implementation_must_be_a_string():
    with pytest.raises(TypeError) as excinfo:
        jaxckpt.flash_attention(*_qkv(), implementation=3)
    _check_message(excinfo, ["implementation"])


def test_cudnn_on_cpu_is_a_clear_error():
    if jax.default_backend() == "gpu":
        pytest.skip("cuDNN is available on this GPU backend")
    with pytest.raises(ValueError) as excinfo:
        jaxckpt.flash_attention(*_qkv(dtype=jnp.bfloat16), implementation="cudnn")
    _check_message(excinfo, ["cudnn", "GPU", jax.default_backend()])


@pytest.mark.parametrize(
    ("kwargs", "feature"),
    [
        ({"logits_soft_cap": 5.0}, "softcap"),
        ({"dropout_rate": 0.1, "dropout_rng": jax.random.key(0)}, "dropout"),
    ],
)
def test_implementation_lacking_a_feature_says_which(kwargs, feature):
    with pytest.raises(NotImplementedError) as excinfo:
        jaxckpt.flash_attention(*_qkv(), implementation="xla", **kwargs)
    _check_message(excinfo, ["xla", feature])


@pytest.mark.parametrize("block_sizes", [(32, 64), {"block_q": 32}, 64])
def test_block_sizes_of_wrong_type(block_sizes):
    with pytest.raises(TypeError) as excinfo:
        jaxckpt.flash_attention(*_qkv(), block_sizes=block_sizes)
    _check_message(excinfo, ["block_sizes", "BlockSizes", type(block_sizes).__name__])


@pytest.mark.parametrize(
    ("args", "field"),
    [((0, 8), "block_q"), ((8, -1), "block_k"), ((8.0, 8), "block_q"), ((8, True), "block_k")],
)
def test_block_sizes_must_be_positive_ints(args, field):
    with pytest.raises((ValueError, TypeError)) as excinfo:
        jaxckpt.BlockSizes(*args)
    _check_message(excinfo, [field])


@pytest.mark.parametrize(
    ("shape", "blocks", "expected"),
    [
        ((B, 64, N, H), jaxckpt.BlockSizes(48, 16), ["powers of two", "fwd=(48, 16)"]),
        ((B, 64, N, H), jaxckpt.BlockSizes(8, 64), ["powers of two", ">= 16"]),
        ((B, T, N, 264), None, ["head dims up to 256", "H=264", "blockwise"]),
    ],
)
def test_pallas_for_a_gpu_refuses_what_triton_cannot_take(shape, blocks, expected):
    """Traced for a GPU the Pallas kernel is Triton's: blocks are powers of two >= 16, H <= 256.
    (The interpreter, on this CPU, takes any block: the contract suite uses odd ones.)"""
    q = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((shape[0], shape[1], K, shape[3]), jnp.bfloat16)
    run = lambda q, k, v: jaxckpt.flash_attention(q, k, v, block_sizes=blocks, implementation="pallas")
    with jaxckpt.attention.compiling_for("gpu"), pytest.raises(ValueError) as excinfo:
        jax.eval_shape(run, q, kv, kv)
    _check_message(excinfo, expected)
    assert jax.eval_shape(run, q, kv, kv).shape == shape  # the interpreter takes them


def _shard_mapped_pallas(check_vma: bool):
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    q, k, v = _qkv()
    mesh = Mesh(np.array(jax.devices()[:1]), ("tp",))
    attend = lambda q, k, v: jaxckpt.flash_attention(q, k, v, is_causal=True, implementation="pallas")
    spec = P(None, None, "tp")
    sharded = jax.shard_map(attend, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=check_vma)
    # The expectation under jit too (eager == jit is tested in test_attention_tracing.py).
    return jax.jit(jax.grad(lambda q: sharded(q, k, v).sum()))(q), jax.jit(
        jax.grad(lambda q: jaxckpt.attention_reference(q, k, v, is_causal=True).sum())
    )(q)


def test_interpreted_pallas_in_shard_map_says_check_vma_or_blockwise():
    """JAX's Pallas interpreter fails on varying-axis types; the GPU kernel does not
    (``tests/attention/test_gpu_compile_pallas.py``). Without check_vma it runs and is exact."""
    with pytest.raises(NotImplementedError) as excinfo:
        _shard_mapped_pallas(check_vma=True)
    _check_message(excinfo, ["Pallas interpreter", "check_vma=False", "blockwise"])
    got, want = _shard_mapped_pallas(check_vma=False)
    np.testing.assert_allclose(got, want, atol=1e-5)
