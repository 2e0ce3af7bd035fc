"""``jaxckpt convert`` carries the tokenizer files both ways (HF -> jaxckpt -> HF), so each
directory is self-contained; transformers' ``AutoTokenizer`` is the oracle."""

import contextlib
import io
import json
import os

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

import torch_models as tm  # noqa: E402

from jaxckpt.cli import main  # noqa: E402
from jaxckpt.data import TOKENIZER_FILES, copy_tokenizer_files  # noqa: E402

pytestmark = pytest.mark.torch

TEXTS = ("hello world", "the lazy dog jumps", "unseen: Zebra ünïcode 42!")
CHAT = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}<|im_end|>\n{% endfor %}"
MESSAGES = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world"}]
EOS_IDS = [2, 3]  # </s> and <|im_end|>: generation_config.json's list, config.json has one id


def _tokenizer() -> "transformers.PreTrainedTokenizerFast":
    """A byte-level BPE of 260 tokens (< tm.VOCAB), trained offline on a few lines."""
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=263,
        special_tokens=["<unk>", "<s>", "</s>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["hello world", "the quick brown fox", "jumps over the lazy dog"] * 3, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.chat_template = CHAT
    return fast


def _run(*argv) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([*argv, "--json"]) == 0
    return json.loads(out.getvalue())


def _fails(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    assert exit_info.value.code == 2
    return capsys.readouterr().err


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict:
    """A tiny LLaMA with its tokenizer, chat template and generation config; converted to
    jaxckpt and back once for the module."""
    root = tmp_path_factory.mktemp("tok")
    hf = root / "hf"
    model = tm.tiny_llama()
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=1, eos_token_id=EOS_IDS, do_sample=True, temperature=0.7
    )
    model.save_pretrained(hf)
    _tokenizer().save_pretrained(hf)
    jax_dir, back = root / "jax", root / "back"
    to_jax = _run("convert", str(hf), str(jax_dir))
    to_torch = _run("convert", str(jax_dir), str(back), "--to", "torch")
    return {"hf": hf, "jax": jax_dir, "back": back, "to_jax": to_jax, "to_torch": to_torch}


def _present(directory) -> list[str]:
    return [name for name in TOKENIZER_FILES if (directory / name).is_file()]


def test_convert_to_jax_copies_the_tokenizer_files(dirs):
    expected = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"]
    assert _present(dirs["hf"]) == expected  # transformers 5 writes the template as a .jinja
    assert dirs["to_jax"]["tokenizer_files"] == expected and "tokenizer_note" not in dirs["to_jax"]
    for name in expected:
        assert (dirs["jax"] / name).read_bytes() == (dirs["hf"] / name).read_bytes()
    assert dirs["to_torch"]["tokenizer_files"] == expected and "tokenizer_note" not in dirs["to_torch"]
    assert not [p.name for p in dirs["jax"].parent.iterdir() if p.name.startswith(".")]  # no temp left


def test_the_exported_directory_tokenizes_as_the_original(dirs):
    original = transformers.AutoTokenizer.from_pretrained(dirs["hf"])
    back = transformers.AutoTokenizer.from_pretrained(dirs["back"])
    for text in TEXTS:
        assert back(text).input_ids == original(text).input_ids
        assert back.decode(back(text).input_ids) == text
    assert back.chat_template == original.chat_template == CHAT
    assert back.apply_chat_template(MESSAGES, tokenize=False) == original.apply_chat_template(
        MESSAGES, tokenize=False
    )
    assert (back.bos_token, back.eos_token, back.unk_token) == ("<s>", "</s>", "<unk>")
    assert back.all_special_tokens == original.all_special_tokens and len(back) == len(original)


def test_the_sources_generation_config_wins(dirs):
    """write_hf writes no generation_config.json of its own: the copied one is the
    source's, so its eos list and sampling defaults survive (config.json has one eos id)."""
    assert json.loads((dirs["back"] / "config.json").read_text())["eos_token_id"] == 2
    generation = transformers.GenerationConfig.from_pretrained(dirs["back"])
    assert generation.eos_token_id == EOS_IDS and generation.temperature == 0.7 and generation.do_sample
    model = transformers.AutoModelForCausalLM.from_pretrained(dirs["back"])
    assert model.generation_config.eos_token_id == EOS_IDS and model.generation_config.temperature == 0.7


def test_human_output_lists_the_files(dirs, tmp_path, capsys):
    assert main(["convert", str(dirs["jax"]), str(tmp_path / "out"), "--to", "torch"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    files = "tokenizer.json, tokenizer_config.json, chat_template.jinja, generation_config.json"
    assert f"tokenizer files: {files}" in out
    assert _present(tmp_path / "out") == _present(dirs["jax"])


@pytest.mark.parametrize("to", ["jax", "torch"])
def test_a_failure_after_the_copy_leaves_no_output(dirs, tmp_path, capsys, monkeypatch, to):
    module = {"jax": "torch_bridge._cli", "torch": "torch_bridge._save"}[to]

    def copy_then_fail(src, dst):
        assert copy_tokenizer_files(src, dst)
        raise OSError("disk full (injected after the tokenizer copy)")

    monkeypatch.setattr(f"{module}.copy_tokenizer_files", copy_then_fail)
    src = dirs["hf"] if to == "jax" else dirs["jax"]
    err = _fails(capsys, "convert", str(src), str(tmp_path / "dst"), "--to", to)
    assert "injected" in err and list(tmp_path.iterdir()) == []  # no dst, no temporary


def test_an_existing_destination_is_left_as_it_was(dirs, tmp_path, capsys):
    (tmp_path / "dst").mkdir()
    (tmp_path / "dst" / "keep.txt").write_text("old")
    err = _fails(capsys, "convert", str(dirs["jax"]), str(tmp_path / "dst"), "--to", "torch")
    assert "--force" in err
    assert [p.name for p in tmp_path.iterdir()] == ["dst"]
    assert [p.name for p in (tmp_path / "dst").iterdir()] == ["keep.txt"]


def test_a_source_without_tokenizer_files_converts_and_says_so(tmp_path, capsys):
    tm.tiny_gpt2().save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "generation_config.json").unlink()  # save_pretrained writes one
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "jax")]) == 0
    out = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    assert f"no tokenizer files in {tmp_path / 'hf'}: generate/train will need --tokenizer" in out
    assert _present(tmp_path / "jax") == []
    back = _run("convert", str(tmp_path / "jax"), str(tmp_path / "back"), "--to", "torch")
    assert back["tokenizer_files"] == [] and back["tokenizer_note"].startswith("no tokenizer files in")
    assert _present(tmp_path / "back") == []
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back")


def test_save_hf_tokenizer_from(dirs, tmp_path):
    from torch_bridge import load_hf, read_checkpoint, save_hf

    model = load_hf(dirs["hf"])
    fields = read_checkpoint(dirs["hf"]).hf_fields
    out = save_hf(model, tmp_path / "out", hf_fields=fields, tokenizer_from=dirs["jax"])
    assert _present(out) == _present(dirs["hf"])
    tok, original = (transformers.AutoTokenizer.from_pretrained(d) for d in (out, dirs["hf"]))
    assert tok(TEXTS[2]).input_ids == original(TEXTS[2]).input_ids
    (tmp_path / "empty").mkdir()
    refused = {tmp_path / "empty": "holds no tokenizer files", tmp_path / "nope": "not a directory"}
    for bad, what in refused.items():
        with pytest.raises(ValueError, match=what) as info:
            save_hf(model, tmp_path / "refused", tokenizer_from=bad)
        assert "tokenizer_from=" in str(info.value)
    assert not (tmp_path / "refused").exists()


@pytest.mark.slow
def test_a_trained_checkpoint_exports_its_tokenizer(dirs, tmp_path):
    from jaxckpt.nn import TransformerConfig
    from jaxckpt.train import RunConfig, read_meta, train

    config = TransformerConfig.from_dict(read_meta(dirs["jax"])["config"])
    trained = tmp_path / "trained"
    run = RunConfig(
        steps=1, batch=1, seq=8, checkpoint={"dir": trained}, init_from=dirs["jax"], progress=False
    )
    train(config, run)
    if not _present(trained):  # until train copies them from --init-from itself
        copy_tokenizer_files(dirs["jax"], trained)
    result = _run("convert", str(trained), str(tmp_path / "hf"), "--to", "torch")
    assert result["tokenizer_files"] == _present(dirs["hf"])
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tok.apply_chat_template(MESSAGES, tokenize=False).startswith("<s>user: hello<|im_end|>")
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
