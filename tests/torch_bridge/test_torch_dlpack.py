"""torch_bridge.interop._dlpack: zero-copy torch <-> JAX conversion, its copies and its errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch_bridge.interop._dlpack import DLPACK_DTYPES, tensor_to_numpy, to_jax, to_torch, torch_dtype  # noqa: E402

pytestmark = pytest.mark.torch

ALIGN = 64  # bytes: JAX's CPU client aliases only 64-byte aligned buffers


def _values(name: str, n: int = 7) -> np.ndarray:
    """n distinct-ish values of dtype `name`, built by numpy (an independent reference)."""
    dtype = jnp.dtype(name)
    if dtype == np.bool_:
        return np.arange(n) % 2 == 0
    return np.arange(n).astype(dtype)


def _tensor(values: np.ndarray):
    """A torch-allocated (hence 64-byte aligned) tensor holding `values`, via its bit pattern.

    numpy's own buffers are only 16-byte aligned, so ``from_numpy`` alone would not do.
    """
    dtype = torch_dtype(values.dtype)
    if values.dtype.itemsize == 1 and values.dtype != np.bool_:
        return torch.from_numpy(values.view(np.uint8)).clone().view(dtype)
    if values.dtype == jnp.bfloat16:
        return torch.from_numpy(values.view(np.int16)).clone().view(dtype)
    return torch.from_numpy(values).clone()


def _ptr(array: jax.Array) -> int:
    return array.unsafe_buffer_pointer()


@pytest.mark.parametrize("name", ["float32", "bfloat16", "int32", "bool", "float16", "int8", "uint8"])
def test_round_trip_is_zero_copy(name):
    expected = _values(name)
    t = _tensor(expected)
    a = to_jax(t)
    assert a.dtype == jnp.dtype(name) and a.shape == (7,)
    np.testing.assert_array_equal(np.asarray(a), expected)
    assert _ptr(a) == t.data_ptr()
    back = to_torch(a)
    assert back.dtype == t.dtype and back.data_ptr() == t.data_ptr()
    np.testing.assert_array_equal(tensor_to_numpy(back), expected)


@pytest.mark.parametrize("name", sorted(DLPACK_DTYPES))
def test_every_listed_dtype_round_trips(name):
    """32-bit-canonical dtypes alias both ways; 64-bit ones become 32-bit (a copy) without x64."""
    values = _values(name, 5)
    t = _tensor(values)
    a = to_jax(t)
    canonical = jax.dtypes.canonicalize_dtype(values.dtype)
    assert a.dtype == canonical
    assert np.asarray(a).tobytes() == values.astype(canonical).tobytes()  # bits: e8m0 has NaN for 0
    assert (_ptr(a) == t.data_ptr()) == (canonical == values.dtype)
    back = to_torch(a)
    assert back.data_ptr() == _ptr(a)
    assert tensor_to_numpy(back).tobytes() == np.asarray(a).tobytes()


def test_float64_is_zero_copy_with_x64():
    with jax.enable_x64(True):
        t = torch.linspace(0, 1, 5, dtype=torch.float64)
        a = to_jax(t)
        assert a.dtype == jnp.float64 and _ptr(a) == t.data_ptr()
        assert to_torch(a).data_ptr() == t.data_ptr()


def test_bf16_values_survive_both_ways():
    x = jnp.linspace(-3.0, 3.0, 7, dtype=jnp.bfloat16)
    t = to_torch(x)
    assert t.dtype == torch.bfloat16
    np.testing.assert_array_equal(t.float().numpy(), np.asarray(x.astype(jnp.float32)))
    y = to_jax(t * 2)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x * 2))


def test_unaligned_tensor_is_copied_with_right_values():
    base = torch.arange(3 * 7, dtype=torch.float32)
    assert base.data_ptr() % ALIGN == 0
    unaligned = base[1:8]  # starts 4 bytes into an aligned buffer
    a = to_jax(unaligned)
    np.testing.assert_array_equal(np.asarray(a), np.arange(1, 8, dtype=np.float32))
    assert _ptr(a) != unaligned.data_ptr()
    aligned = base[ALIGN // 4 : ALIGN // 4 + 5]  # 64 bytes in: aligned again, zero copy
    assert _ptr(to_jax(aligned)) == aligned.data_ptr()


def test_transposed_tensor_is_zero_copy():
    t = torch.arange(3 * 5 * 7, dtype=torch.float32).reshape(3, 5, 7).permute(2, 0, 1)
    assert not t.is_contiguous()
    a = to_jax(t)
    assert a.shape == (7, 3, 5) and _ptr(a) == t.data_ptr()
    np.testing.assert_array_equal(np.asarray(a), t.numpy())
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda x: x * 2)(a)), t.numpy() * 2)


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.arange(15.0)[::2],
        lambda: torch.arange(35.0).reshape(5, 7)[:, :3],
        lambda: torch.arange(5.0).reshape(5, 1).expand(5, 3),
    ],
    ids=["step", "column-slice", "expand"],
)
def test_non_dense_tensor_is_made_contiguous(make):
    t = make()
    a = to_jax(t)
    np.testing.assert_array_equal(np.asarray(a), t.numpy())


def test_requires_grad_tensor_is_detached_without_copy():
    t = torch.linspace(0, 1, 5, requires_grad=True)
    a = to_jax(t)
    assert _ptr(a) == t.data_ptr()
    np.testing.assert_allclose(np.asarray(a), t.detach().numpy())
    assert t.requires_grad  # the caller's tensor is untouched


def test_conjugate_view_is_resolved():
    t = torch.tensor([1 + 2j, 3 - 4j, 5j], dtype=torch.complex64).conj()
    np.testing.assert_array_equal(np.asarray(to_jax(t)), np.array([1 - 2j, 3 + 4j, -5j]))


@pytest.mark.parametrize("shape", [(), (0, 3), (3, 1, 5)])
def test_odd_shapes_round_trip(shape):
    t = torch.ones(shape)
    a = to_jax(t)
    assert a.shape == shape
    assert tuple(to_torch(a).shape) == shape


def test_to_jax_rejects_non_tensors():
    with pytest.raises(TypeError, match=r"to_jax: tensor must be a torch\.Tensor, got ndarray"):
        to_jax(np.ones(3))
    with pytest.raises(TypeError, match=r"tensor must be a torch\.Tensor, got ArrayImpl"):
        to_jax(jnp.ones(3))


def test_to_torch_rejects_non_arrays_and_tracers():
    with pytest.raises(TypeError, match=r"to_torch: array must be a jax\.Array, got ndarray"):
        to_torch(np.ones(3))
    with pytest.raises(TypeError, match=r"array must be a jax\.Array, got Tensor"):
        to_torch(torch.ones(3))
    with pytest.raises(TypeError, match=r"array is a traced value.*call_torch"):
        jax.jit(to_torch)(jnp.ones(3))


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_dtypes_dlpack_cannot_carry_raise_naming_the_dtype():
    with pytest.raises(TypeError, match=r"tensor\.dtype=torch\.complex32"):
        to_jax(torch.zeros(3, dtype=torch.complex32))
    with pytest.raises(TypeError, match=r"array\.dtype=int4"):
        to_torch(jnp.zeros(3, jnp.int4))
    assert torch_dtype(jnp.int4) is None


def test_tensor_to_numpy_is_zero_copy_for_bf16():
    t = torch.linspace(0, 1, 7, dtype=torch.bfloat16, requires_grad=True)
    n = tensor_to_numpy(t)
    assert n.dtype == jnp.bfloat16 and n.ctypes.data == t.data_ptr()
    np.testing.assert_array_equal(n.astype(np.float32), t.detach().float().numpy())
