"""Fuzzed readers (issue 21, section 4): every reader refuses corrupted input with one line that
names the file (and, where it can, the field, line, row or tensor); through the CLI it exits 2
with no traceback and leaves no partial output.

The cases come from ``fuzz_cases`` (shared with ``benchmarks/reliability/bench_fuzz_readers.py``), which also
sorts each outcome (``fuzz_cases.judge``). A corrupted input may still be a valid one (a flipped
byte of tensor data, of a vocabulary word, of a text; a JSON Lines file cut at a line break):
success counts only for a mutation not marked ``detectable``, and only when the format's own
library (safetensors, torch, tokenizers, json, pyarrow; for a checkpoint, the pristine arrays)
reads the mutated file too and ours reads exactly what it reads. ``test_the_judge_can_fail``
shows that each of those checks fails when it should.
"""

import contextlib
import io
import json
import random
import shutil
import uuid
from pathlib import Path

import fuzz_cases as fc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxckpt.cli import main

RANDOMS = st.randoms(use_true_random=False)

# After a failed restore, orbax's abandoned reads finish on a closed event loop and report it
# as unraisable; restore_checkpoint drops those reports, but pytest swaps its own hook in for
# each test (so one may surface as a warning in a later test).
pytestmark = pytest.mark.filterwarnings(
    "ignore:(?s).*Event loop is closed:pytest.PytestUnraisableExceptionWarning"
)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """``pristine(reader_name)``: that reader's pristine input, built once per module."""
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = fc.build(fc.READERS[name], tmp_path_factory.mktemp(name.replace("/", "_")))
        return built[name]

    return get


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("cases")


def _fuzz(name: str, mutation: str, rng: random.Random, pristine, work) -> fc.Outcome:
    outcome = fc.run_case(fc.READERS[name], mutation, rng, pristine(name), work)
    assert outcome.kind in ("error", "valid"), f"{outcome.mutation}: {outcome.what}: {outcome.detail}"
    return outcome


def _mutations(reader: fc.Reader):
    return st.sampled_from(sorted(reader.mutations))


# ---------------------------------------------------------------- every reader, in the library


@settings(max_examples=100, deadline=None)
@given(mutation=_mutations(fc.SAFETENSORS), rng=RANDOMS)
def test_safetensors(mutation, rng, pristine, work):
    _fuzz("safetensors", mutation, rng, pristine, work)


@pytest.mark.torch
@settings(max_examples=60, deadline=None)
@given(mutation=_mutations(fc.TORCH_BIN), rng=RANDOMS)
def test_torch_bin(mutation, rng, pristine, work):
    _fuzz("bin/pt", mutation, rng, pristine, work)


@settings(max_examples=100, deadline=None)
@given(mutation=_mutations(fc.CONFIG), rng=RANDOMS)
def test_config_json(mutation, rng, pristine, work):
    assert _fuzz("config.json", mutation, rng, pristine, work).kind == "error"  # no mutation is valid


@settings(max_examples=80, deadline=None)
@given(mutation=_mutations(fc.TOKENIZER), rng=RANDOMS)
def test_tokenizer_json(mutation, rng, pristine, work):
    _fuzz("tokenizer.json", mutation, rng, pristine, work)


@settings(max_examples=100, deadline=None)
@given(mutation=_mutations(fc.JSONL), rng=RANDOMS)
def test_jsonl(mutation, rng, pristine, work):
    _fuzz("jsonl", mutation, rng, pristine, work)


@settings(max_examples=80, deadline=None)
@given(mutation=_mutations(fc.PARQUET), rng=RANDOMS)
def test_parquet(mutation, rng, pristine, work):
    _fuzz("parquet", mutation, rng, pristine, work)


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(mutation=_mutations(fc.ORBAX), rng=RANDOMS)
def test_orbax_checkpoint(mutation, rng, pristine, work):
    _fuzz("orbax", mutation, rng, pristine, work)


def test_the_judge_can_fail(pristine, work):
    """Each check of ``fuzz_cases.judge`` rejects what it should, and a flipped byte of tensor
    data is read as safetensors itself reads it: changed, not silently repaired."""

    def raises(err):
        def read():
            raise err

        return read

    names = ("model.safetensors",)
    assert fc.judge(raises(ValueError("a/model.safetensors: bad")), None, names, True)[0] == "error"
    for err in (TypeError("a/model.safetensors"), KeyError("x"), ValueError("a/model.safetensors:\nx")):
        assert fc.judge(raises(err), None, names, True)[0] == "other"
    assert fc.judge(raises(ValueError("bad, but which file?")), None, names, True)[0] == "other"
    assert fc.judge(lambda: 1, lambda: 1, names, True)[0] == "other"  # a detectable change accepted
    assert fc.judge(lambda: 1, lambda: 2, names, False)[0] == "other"  # read otherwise than the reference
    assert fc.judge(lambda: 1, raises(ValueError("x")), names, False)[0] == "other"  # the reference refuses
    assert fc.judge(lambda: 1, lambda: 1, names, False)[0] == "valid"

    original = fc.READERS["safetensors"].read(pristine("safetensors"))
    for seed in range(3):
        case = work / f"flip-{uuid.uuid4().hex[:8]}"
        shutil.copytree(pristine("safetensors"), case)
        fc.SAFETENSORS.mutations["flip_data"].apply(random.Random(seed), case)
        got = fc.READERS["safetensors"].read(case)
        assert got == fc.READERS["safetensors"].reference(case) and got != original


# ---------------------------------------------------------------- through the command line


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return fc.build_hf(tmp_path_factory.mktemp("hf") / "llama")


def _cli_error(args: list[str], *names: str, dst: Path | None = None) -> str:
    """Runs ``jaxckpt ARGS``: exit 2, one line on stderr naming ``names``, no traceback, and no
    ``dst`` (nor a temporary one beside it)."""
    err = io.StringIO()
    with (
        contextlib.redirect_stderr(err),
        contextlib.redirect_stdout(io.StringIO()),
        pytest.raises(SystemExit) as exit_,
    ):
        main(args)
    text = err.getvalue()
    assert exit_.value.code == 2, text
    assert "Traceback" not in text, text
    lines = text.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"jaxckpt {args[0]}: error: "), text
    for name in names:
        assert name in lines[0], (name, lines[0])
    if dst is not None:
        assert not dst.exists(), f"{dst} was written"
        assert not [p.name for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}")]
    return lines[0]


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _with_config(hf_dir: Path, work: Path, **changes) -> Path:
    bad = _copy(hf_dir, work / f"hf-{uuid.uuid4().hex[:8]}")
    config = fc.LLAMA_CONFIG | changes  # a field changed to ... is left out
    (bad / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not ...}))
    return bad


def _convert_error(src: Path, *names: str) -> str:
    dst = src.parent / f"{src.name}-out"
    return _cli_error(["convert", str(src), str(dst), "--json"], *names, dst=dst)


def test_new_user_a_config_json_that_is_an_array(hf_dir, work):
    bad = _copy(hf_dir, work / "array")
    (bad / "config.json").write_text("[1, 2]")
    assert "expected a JSON object" in _convert_error(bad, "config.json")


def test_new_user_config_values_of_the_wrong_type(hf_dir, work):
    line = _convert_error(_with_config(hf_dir, work, rms_norm_eps="1e-5"), "config.json", "rms_norm_eps")
    assert "rms_norm_eps='1e-5' must be a positive finite number" in line
    listed = _with_config(hf_dir, work, rope_theta=[10000.0], rope_parameters=...)
    line = _convert_error(listed, "config.json")
    assert "rope_theta=[10000.0] must be a positive finite number" in line
    nested = {"rope_theta": [10000.0], "rope_type": "default"}
    line = _convert_error(_with_config(hf_dir, work, rope_parameters=nested), "config.json")
    assert "rope_parameters.rope_theta=[10000.0]" in line


def test_new_user_a_binary_config_json(hf_dir, work):
    bad = _copy(hf_dir, work / "binary")
    (bad / "config.json").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))
    assert "not UTF-8 text (invalid start byte at byte 0)" in _convert_error(bad, "config.json")
    (bad / "config.json").write_bytes(b'{"model_type": "llama", ')
    assert "not valid JSON (Expecting property name" in _convert_error(bad, "config.json", "line 1")


def test_new_user_a_negative_hidden_size(hf_dir, work):
    line = _convert_error(_with_config(hf_dir, work, hidden_size=-8), "config.json", "hidden_size=-8")
    assert "d_model" not in line


def test_an_implausible_layer_count_fails_at_once(hf_dir, work):
    """10**7 layers would list 10**8 missing tensors (minutes, gigabytes): refused up front."""
    line = _convert_error(_with_config(hf_dir, work, num_hidden_layers=10**7), "num_hidden_layers")
    assert "10000000 layers" in line


def test_a_transformer_config_error_names_the_config_json_field(hf_dir, work):
    line = _convert_error(_with_config(hf_dir, work, num_key_value_heads=2), "config.json")
    assert "n_kv_heads=2 must divide n_heads=5" in line
    assert "n_kv_heads is num_key_value_heads" in line and "n_heads is num_attention_heads" in line


@settings(max_examples=30, deadline=None)
@given(mutation=_mutations(fc.CONFIG), rng=RANDOMS)
def test_convert_refuses_every_corrupted_config_json(mutation, rng, hf_dir, work):
    bad = _copy(hf_dir, work / f"cfg-{uuid.uuid4().hex[:8]}")
    _, names = fc.CONFIG.mutations[mutation].apply(rng, bad)
    _convert_error(bad, *names)


@settings(max_examples=25, deadline=None)
@given(mutation=st.sampled_from(["header_length", "header_json", "offsets", "truncate"]), rng=RANDOMS)
def test_convert_refuses_a_corrupted_safetensors_file(mutation, rng, hf_dir, work):
    bad = _copy(hf_dir, work / f"st-{uuid.uuid4().hex[:8]}")
    _, names = fc.SAFETENSORS.mutations[mutation].apply(rng, bad)
    _convert_error(bad, *names)


@pytest.mark.torch
@settings(max_examples=10, deadline=None)
@given(rng=RANDOMS)
def test_convert_refuses_a_truncated_bin(rng, hf_dir, work):
    import safetensors.torch
    import torch

    bad = _copy(hf_dir, work / f"bin-{uuid.uuid4().hex[:8]}")
    torch.save(safetensors.torch.load_file(bad / "model.safetensors"), bad / fc.BIN)
    (bad / "model.safetensors").unlink()
    _, names = fc.TORCH_BIN.mutations["truncate"].apply(rng, bad)
    _convert_error(bad, *names)


@pytest.fixture(scope="module")
def pristine_arrays(pristine):
    return fc.ORBAX.read(pristine("orbax"))


@pytest.mark.slow
@settings(max_examples=25, deadline=None)
@given(mutation=_mutations(fc.ORBAX), rng=RANDOMS)
def test_convert_to_torch_refuses_a_damaged_checkpoint(mutation, rng, pristine, pristine_arrays, work):
    """Exit 2; or, for a change that leaves every array as it was (a file orbax does not read),
    a complete export."""
    src = _copy(pristine("orbax"), work / f"ckpt-{uuid.uuid4().hex[:8]}")
    change = fc.ORBAX.mutations[mutation]
    what, names = change.apply(rng, src)
    kind, detail = fc.judge(lambda: fc.ORBAX.read(src), lambda: pristine_arrays, names, change.detectable)
    assert kind in ("error", "valid"), f"{what}: {detail}"
    dst = work / f"{src.name}-hf"
    args = ["convert", str(src), str(dst), "--to", "torch", "--json"]
    if kind == "error":
        _cli_error(args, *names, dst=dst)
    else:
        with contextlib.redirect_stdout(io.StringIO()):
            assert main(args) == 0
        assert (dst / "config.json").is_file() and (dst / "model.safetensors").is_file()


def _eval_error(model: Path, data: Path, names, tokenizer: str = "bytes") -> str:
    args = ["eval", str(model), "--data", str(data), "--tokenizer", tokenizer, "--seq", "8", "--batch", "1"]
    return _cli_error(args, *names)


@pytest.mark.slow
@settings(max_examples=12, deadline=None)
@given(mutation=st.sampled_from(["wrong_type", "missing_text", "not_object", "not_utf8"]), rng=RANDOMS)
def test_eval_refuses_a_corrupted_jsonl_file(mutation, rng, pristine, work):
    data = _copy(pristine("jsonl"), work / f"jsonl-{uuid.uuid4().hex[:8]}")
    _, names = fc.JSONL.mutations[mutation].apply(rng, data)
    _eval_error(pristine("orbax"), data / "data.jsonl", names)


@pytest.mark.slow  # 2 s or more with the compile cache warm
@settings(max_examples=8, deadline=None)
@given(mutation=st.sampled_from(["truncate", "columns"]), rng=RANDOMS)
def test_eval_refuses_a_corrupted_parquet_file(mutation, rng, pristine, work):
    data = _copy(pristine("parquet"), work / f"parquet-{uuid.uuid4().hex[:8]}")
    _, names = fc.PARQUET.mutations[mutation].apply(rng, data)
    _eval_error(pristine("orbax"), data / "data.parquet", names)


@settings(max_examples=8, deadline=None)
@given(mutation=st.sampled_from(["truncate", "binary"]), rng=RANDOMS)
def test_eval_refuses_a_corrupted_tokenizer_json(mutation, rng, pristine, work):
    tok = _copy(pristine("tokenizer.json"), work / f"tok-{uuid.uuid4().hex[:8]}")
    _, names = fc.TOKENIZER.mutations[mutation].apply(rng, tok)
    _eval_error(pristine("orbax"), pristine("jsonl") / "data.jsonl", names, tokenizer=str(tok))


def test_a_converted_checkpoint_whose_config_disagrees_with_its_arrays(pristine, work):
    """orbax restores an array saved from numpy in its stored shape, whatever the target's:
    restore_checkpoint compares them (a smaller vocab_size in jaxckpt.json was read silently)."""
    src = _copy(pristine("orbax"), work / "vocab")
    meta = json.loads((src / "jaxckpt.json").read_text())
    meta["config"]["vocab_size"] = 5
    (src / "jaxckpt.json").write_text(json.dumps(meta))
    line = _cli_error(["convert", str(src), str(work / "vocab-hf"), "--to", "torch"], "vocab")
    assert "embed" in line and "(301, 25), not (5, 25)" in line
