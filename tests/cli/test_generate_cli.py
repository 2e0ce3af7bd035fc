"""``jaxckpt generate MODEL_DIR --prompt TEXT``: on a trained checkpoint (byte-level, or with a
tokenizer named by ``--tokenizer``), and, with torch, on a Hugging Face directory, the same
model converted, and a fine-tuned one, against transformers' ``generate`` and tokenizer;
``--json``, ``--chat``, and bad input as one line with exit status 2."""

import importlib
import json
import re

import pytest
import tokenizer_fixtures as tf

from jaxckpt import data, nn, train
from jaxckpt.cli import main
from jaxckpt.generate import generate, load_model

VOCAB = 401  # > the tiny BPE tokenizers' ~390 ids, odd
MAX_LEN = 48
CHATML = (  # SmolLM2's template without its default system prompt (which would not fit MAX_LEN)
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _run(capsys, *argv) -> dict:
    assert main(["generate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _fails(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A one-step byte-level training run's checkpoint directory."""
    d = tmp_path_factory.mktemp("trained")
    sizes = dict(n_layers=1, d_model=24, n_heads=3, n_kv_heads=1, ffn_dim=40)
    cfg = nn.TransformerConfig.preset("tiny", **sizes, vocab_size=VOCAB, max_len=MAX_LEN)
    train.train(cfg, train.RunConfig(steps=1, batch=1, seq=9, checkpoint={"dir": d}, progress=False))
    return d


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    return tf.make_tokenizer_dir(tmp_path_factory.mktemp("tok"), "smollm2", chat_template=CHATML)


@pytest.mark.slow
def test_json_on_a_trained_checkpoint_equals_the_python_api(trained, capsys):
    out = _run(capsys, str(trained), "--prompt", "To be", "--max-new-tokens", "5")
    assert sorted(out) == ["completion", "finish_reason", "new_token_ids", "prompt"]
    assert out["prompt"] == "To be" and out["finish_reason"] == "length" and len(out["new_token_ids"]) == 5
    tok = data.ByteTokenizer()  # the checkpoint says it was trained on bytes
    ours = generate(load_model(trained), "To be", tokenizer=tok, max_new_tokens=5)
    assert out == ours.to_dict()
    assert out["completion"] == tok.decode([i for i in out["new_token_ids"] if i < 256])


@pytest.mark.slow  # 2 s or more with the compile cache warm
def test_sampling_flags_and_text_output(trained, capsys):
    flags = (str(trained), "--prompt", "abc", "--max-new-tokens", "4", "--temperature", "0.8")
    flags += ("--top-k", "7", "--top-p", "0.9", "--seed", "5")
    first, again = _run(capsys, *flags), _run(capsys, *flags)
    assert first == again
    assert main(["generate", *flags]) == 0
    captured = capsys.readouterr()
    assert captured.out == first["completion"] + "\n"
    assert captured.err == "[4 new tokens, finish_reason=length]\n"


def test_chat_renders_the_template_with_the_generation_prompt(trained, chat_tokenizer, capsys):
    out = _run(capsys, str(trained), "--prompt", "hello world", "--chat", "--tokenizer", str(chat_tokenizer),
               "--max-new-tokens", "3")  # fmt: skip
    tok = data.load_tokenizer(chat_tokenizer)
    text = tok.apply_chat_template([{"role": "user", "content": "hello world"}], add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    ids = tok.encode(text, add_special_tokens=False)
    ours = generate(load_model(trained), ids, tokenizer=tok, max_new_tokens=3)
    assert out["new_token_ids"] == ours.new_token_ids and out["prompt"] == "hello world"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--temperature", "-1"), r"--temperature -1\.0 must be a number >= 0"),
        (("--top-k", "0"), r"--top-k 0 must be an int >= 1"),
        (("--top-p", "1.5"), r"--top-p 1\.5 must be in \(0, 1\]"),
        (("--max-new-tokens", "0"), r"--max-new-tokens 0 must be an int >= 1"),
        (("--max-new-tokens", "47"), r"prompt of 2 tokens \+ --max-new-tokens 47 .* max_len=48: at most 46"),
        (("--dtype", "float64"), r"dtype"),
        (("--chat",), r"has no chat template"),
    ],
)
def test_bad_flags_are_one_line(trained, capsys, flags, message):
    err = _fails(capsys, str(trained), "--prompt", "Hi", *flags)
    assert err.startswith("jaxckpt generate: error: ")
    assert re.search(message, err), err


def test_a_prompt_longer_than_max_len_is_one_line(trained, capsys):
    err = _fails(capsys, str(trained), "--prompt", "x" * 50)
    assert err == "jaxckpt generate: error: prompt of 50 tokens is longer than the model's max_len=48\n"


def test_a_missing_model_dir_is_one_line(tmp_path, capsys):
    err = _fails(capsys, str(tmp_path / "nope"), "--prompt", "Hi")
    assert "does not exist" in err and "nope" in err


# ----------------------------------------------------------------------------- with torch

NEW = 6


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny Qwen3 (torch) saved with a tiny SmolLM2-style tokenizer next to it."""
    pytest.importorskip("torch")
    tm = importlib.import_module("torch_models")
    d = tmp_path_factory.mktemp("hf")
    model = tm.tiny_family("qwen3")
    tm.save(model, d, "safetensors")
    tf.make_tokenizer_dir(d, "smollm2", vocab_size=280, chat_template=CHATML)
    return model, d


def _transformers(torch_model, ids, eos):
    import torch

    mask = torch.ones(1, len(ids), dtype=torch.long)
    with torch.no_grad():
        out = torch_model.generate(torch.as_tensor([ids]), do_sample=False, max_new_tokens=NEW,
                                   eos_token_id=list(eos), pad_token_id=0, attention_mask=mask)  # fmt: skip
    return out[0, len(ids) :].tolist()


@pytest.mark.torch
def test_hf_dir_equals_transformers_text_and_ids(hf_dir, capsys):
    transformers = pytest.importorskip("transformers")
    torch_model, d = hf_dir
    theirs_tok = transformers.AutoTokenizer.from_pretrained(d)
    ids = theirs_tok("hello world")["input_ids"]
    stops = data.load_tokenizer(d).stop_ids
    theirs = _transformers(torch_model, ids, stops)
    out = _run(capsys, str(d), "--prompt", "hello world", "--max-new-tokens", str(NEW))
    assert out["new_token_ids"] == theirs
    assert out["finish_reason"] == ("eos" if theirs[-1] in stops else "length")
    assert out["completion"] == theirs_tok.decode(theirs, skip_special_tokens=True)


@pytest.mark.torch
def test_chat_on_an_hf_dir_equals_transformers(hf_dir, capsys):
    transformers = pytest.importorskip("transformers")
    torch_model, d = hf_dir
    messages = [{"role": "user", "content": "the quick brown fox"}]
    ids = transformers.AutoTokenizer.from_pretrained(d).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    theirs = _transformers(torch_model, list(ids), data.load_tokenizer(d).stop_ids)
    out = _run(capsys, str(d), "--prompt", "the quick brown fox", "--chat", "--max-new-tokens", str(NEW))
    assert out["new_token_ids"] == theirs


@pytest.mark.torch
def test_a_converted_dir_generates_as_its_source(hf_dir, tmp_path, capsys):
    _, d = hf_dir
    assert main(["convert", str(d), str(tmp_path / "jax"), "--json"]) == 0
    capsys.readouterr()
    flags = ("--prompt", "hello world", "--max-new-tokens", str(NEW))
    assert _run(capsys, str(tmp_path / "jax"), *flags) == _run(capsys, str(d), *flags)


@pytest.mark.torch
def test_an_hf_dir_without_a_tokenizer_asks_for_one(hf_dir, tmp_path, capsys):
    _, d = hf_dir
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((d / name).read_bytes())
    err = _fails(capsys, str(bare), "--prompt", "Hi")
    assert "has no tokenizer" in err and "--tokenizer" in err
    ids = generate(bare, [1, 2, 3], max_new_tokens=2)  # ids need no tokenizer
    assert ids.completion is None and len(ids.new_token_ids) == 2


@pytest.mark.torch
@pytest.mark.slow
def test_a_fine_tuned_checkpoint_generates(hf_dir, tmp_path, capsys):
    _, d = hf_dir
    cfg = train.source_config(d)
    run = train.RunConfig(
        steps=1, batch=1, seq=9, init_from=d, checkpoint={"dir": tmp_path / "ft"}, progress=False
    )
    train.train(cfg, run)
    out = _run(capsys, str(tmp_path / "ft"), "--prompt", "hello world", "--max-new-tokens", str(NEW))
    python = generate(load_model(tmp_path / "ft"), "hello world", tokenizer=d, max_new_tokens=NEW)
    assert out == python.to_dict()
