"""Byte-level data: tokenizer round trip, the shipped corpus, deterministic random windows."""

import numpy as np
import pytest

from jaxckpt.train._data import VOCAB_SIZE, ByteBatches, decode, default_corpus_path, encode, load_tokens


@pytest.mark.parametrize("text", ["", "plain ASCII\n", "café — naïve ☃ 日本語 🎭", "a\x00b\x7f"])
def test_encode_decode_round_trip(text):
    tokens = encode(text)
    assert tokens.dtype == np.int32 and tokens.ndim == 1
    assert len(tokens) == len(text.encode("utf-8"))
    assert tokens.size == 0 or (tokens.min() >= 0 and tokens.max() < VOCAB_SIZE)
    assert decode(tokens) == text


def test_decode_replaces_invalid_utf8_and_accepts_lists():
    assert decode([104, 105, 0xC3]) == "hi\ufffd"
    assert decode(encode("é")[:1]) == "\ufffd"


def test_encode_decode_errors_name_the_argument():
    with pytest.raises(TypeError, match="text must be a str"):
        encode(b"bytes")
    with pytest.raises(ValueError, match=r"\[0, 256\)"):
        decode([65, 256])
    with pytest.raises(ValueError, match=r"\[0, 256\)"):
        decode([-1])
    with pytest.raises(TypeError, match="integers"):
        decode([1.5, 2.0])
    with pytest.raises(ValueError, match="1-D"):
        decode([[65, 66]])


def test_default_corpus_is_shipped_and_sized():
    path = default_corpus_path()
    assert path.is_file() and path.name == "shakespeare.txt"
    tokens = load_tokens()
    assert tokens.dtype == np.int32 and tokens.ndim == 1
    assert 100_000 < len(tokens) <= 1_000_000
    assert len(tokens) == path.stat().st_size
    text = decode(tokens)
    assert text.startswith("First Citizen:\n")
    assert text.endswith("\n") and text.isascii()


def test_load_tokens_reads_a_given_file_as_bytes(tmp_path):
    f = tmp_path / "tiny.txt"
    f.write_text("héllo\n", encoding="utf-8")
    np.testing.assert_array_equal(load_tokens(f), encode("héllo\n"))
    np.testing.assert_array_equal(load_tokens(str(f)), encode("héllo\n"))


def test_load_tokens_errors(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(FileNotFoundError, match=r"nope\.txt") as err:
        load_tokens(missing)
    assert str(err.value).startswith("path=") and "give a text file" in str(err.value)
    with pytest.raises(FileNotFoundError, match=r"^data='.*nope\.txt' does not exist"):
        load_tokens(missing, name="data")  # a caller's own name for the argument (train's data=)
    with pytest.raises(ValueError, match="directory"):
        load_tokens(tmp_path)
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        load_tokens(empty)
    with pytest.raises(TypeError, match="path"):
        load_tokens(3)


def _data(**kw):
    args = {"batch": 3, "seq": 7, "seed": 11, "micro_batches": 5, **kw}
    return ByteBatches(np.arange(1000, dtype=np.int32), **args)


def test_batch_shape_and_dtype():
    b = _data().batch_at(0)
    assert b.shape == (5, 3, 8) and b.dtype == np.int32
    single = _data(micro_batches=1).batch_at(0)
    assert single.shape == (1, 3, 8)


def test_rows_are_contiguous_windows_of_the_corpus():
    data = _data()
    for step in range(4):
        b = data.batch_at(step)
        assert (np.diff(b, axis=-1) == 1).all()
        assert b.min() >= 0 and b.max() < 1000


def test_windows_reach_both_ends_of_a_short_corpus():
    data = ByteBatches(np.arange(9, dtype=np.int32), batch=3, seq=7, micro_batches=5)
    firsts = {int(x) for step in range(20) for x in data.batch_at(step)[..., 0].ravel()}
    assert firsts == {0, 1}


def test_batches_are_a_pure_function_of_seed_and_step():
    a, b = _data(), _data()
    np.testing.assert_array_equal(a.batch_at(6), b.batch_at(6))
    np.testing.assert_array_equal(a.batch_at(6), a.batch_at(6))
    np.testing.assert_array_equal(a.batch_at(np.int64(6)), a.batch_at(6))
    assert not np.array_equal(a.batch_at(6), a.batch_at(7))
    assert not np.array_equal(a.batch_at(6), _data(seed=12).batch_at(6))


def test_resume_sees_the_same_batches():
    uninterrupted = [_data().batch_at(s) for s in range(6)]
    first_half = [_data().batch_at(s) for s in range(3)]
    resumed = [_data().batch_at(s) for s in range(3, 6)]
    for want, got in zip(uninterrupted, first_half + resumed, strict=True):
        np.testing.assert_array_equal(want, got)


def test_byte_corpus_tokens_stay_in_vocab():
    data = ByteBatches(load_tokens(), batch=3, seq=7, micro_batches=5)
    b = data.batch_at(1)
    assert b.min() >= 0 and b.max() < VOCAB_SIZE
    assert isinstance(decode(b[0, 0]), str)


def test_seq_too_long_names_seq_and_corpus_length():
    with pytest.raises(ValueError, match=r"seq=9.*got 10"):
        ByteBatches(np.arange(10, dtype=np.int32), batch=3, seq=9)
    ByteBatches(np.arange(10, dtype=np.int32), batch=3, seq=8)


@pytest.mark.parametrize(
    ("kw", "exc", "pattern"),
    [
        ({"batch": 0}, ValueError, "batch=0 must be positive"),
        ({"batch": -3}, ValueError, "batch=-3 must be positive"),
        ({"batch": 2.5}, TypeError, "batch=2.5 must be an int"),
        ({"batch": True}, TypeError, "batch=True must be an int"),
        ({"seq": 0}, ValueError, "seq=0 must be positive"),
        ({"micro_batches": 0}, ValueError, "micro_batches=0 must be positive"),
        ({"micro_batches": "5"}, TypeError, "micro_batches='5' must be an int"),
        ({"seed": -1}, ValueError, "seed=-1 must be >= 0"),
    ],
)
def test_bad_sizes(kw, exc, pattern):
    with pytest.raises(exc, match=pattern):
        _data(**kw)


def test_bad_tokens_and_step():
    with pytest.raises(TypeError, match="1-D integer"):
        ByteBatches(np.zeros(100, dtype=np.float32), batch=3, seq=7)
    with pytest.raises(TypeError, match="1-D integer"):
        ByteBatches(np.zeros((10, 10), dtype=np.int32), batch=3, seq=7)
    with pytest.raises(ValueError, match="step must be >= 0"):
        _data().batch_at(-1)
    with pytest.raises(TypeError, match="step must be an int"):
        _data().batch_at(1.0)
