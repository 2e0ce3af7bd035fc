"""jaxckpt.data's tokenizers: load_tokenizer on the layouts real checkpoints ship (tiny ones built
offline by tokenizer_fixtures), checked against transformers.AutoTokenizer, and ByteTokenizer."""

import json
import os

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import chat_template_cases as cases
import numpy as np
import pytest
import tokenizer_fixtures as tf

from jaxckpt._warnings import JaxckptWarning
from jaxckpt.data import ByteTokenizer, DataError, Tokenizer, load_tokenizer
from jaxckpt.train import _data as byte_data

TEXTS = (
    "Hello world",
    "  two leading spaces, two trailing  ",
    "café naïve Zürich 日本語 🙂 — unseen bytes 🚀",
    "x = f(3) + 42; it's\n\nnew lines\tand a tab",
    "",
    "<|im_start|>user\nHi<|im_end|> <|eot_id|> <s> [INST] hi [/INST] </s>",
)

# flavor -> (bos, eos, pad, stop tokens) as the checkpoint's files name them
EXPECTED = {
    "llama3": ("<|begin_of_text|>", "<|eot_id|>", None, ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")),
    "gpt2": ("<|endoftext|>", "<|endoftext|>", None, ("<|endoftext|>",)),
    "qwen2.5": (None, "<|im_end|>", "<|endoftext|>", ("<|im_end|>", "<|endoftext|>")),
    "smollm2": ("<|im_start|>", "<|im_end|>", "<|im_end|>", ("<|im_end|>",)),
    "mistral": ("<s>", "</s>", None, ("</s>",)),
    "gemma": ("<bos>", "<eos>", "<pad>", ("<eos>", "<end_of_turn>")),
    "phi3": ("<s>", "<|endoftext|>", "<|endoftext|>", ("<|endoftext|>", "<|end|>")),
}
ADDS_BOS = {"llama3", "mistral", "gemma"}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    return {flavor: tf.make_tokenizer_dir(root / flavor, flavor) for flavor in tf.FLAVORS}


@pytest.fixture(scope="module")
def toks(dirs):
    return {flavor: load_tokenizer(d) for flavor, d in dirs.items()}


@pytest.fixture(scope="module")
def auto_tokenizer():
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return transformers.AutoTokenizer.from_pretrained


# ---------------------------------------------------------------------------------------------
# The oracle: transformers.AutoTokenizer on the same directories


@pytest.mark.torch
@pytest.mark.parametrize("flavor", list(tf.FLAVORS))
def test_encode_and_decode_equal_transformers(flavor, dirs, toks, auto_tokenizer):
    hf, tok = auto_tokenizer(str(dirs[flavor])), toks[flavor]
    assert tok.vocab_size == len(hf)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id)
    for text in TEXTS:
        for special in (True, False):
            ours = tok.encode(text, add_special_tokens=special)
            assert ours.dtype == np.int32
            assert ours.tolist() == hf(text, add_special_tokens=special)["input_ids"], (text, special)
            for skip in (False, True):
                assert tok.decode(ours, skip_special_tokens=skip) == hf.decode(
                    ours.tolist(), skip_special_tokens=skip
                )


@pytest.mark.torch
@pytest.mark.parametrize("flavor", ["mistral", "gemma", "llama3"])
def test_add_bos_token_follows_tokenizer_json_as_transformers_5(flavor, tmp_path, auto_tokenizer):
    """transformers 5 drops add_bos_token/add_eos_token when tokenizer.json exists: the
    post-processor decides, also when it adds nothing. We do the same, and warn."""
    d = tf.make_tokenizer_dir(
        tmp_path, flavor, bos_in_post_processor=False, config={"add_bos_token": True, "add_eos_token": True}
    )
    with pytest.warns(
        JaxckptWarning, match="add_bos_token and add_eos_token set to true, but tokenizer.json"
    ):
        tok = load_tokenizer(d)
    hf = auto_tokenizer(str(d))
    for text in TEXTS[:3]:
        assert (
            tok.encode(text).tolist()
            == hf(text)["input_ids"]
            == tok.encode(text, add_special_tokens=False).tolist()
        )


@pytest.mark.torch
def test_a_special_token_missing_from_the_vocabulary_is_added_as_transformers(tmp_path, auto_tokenizer):
    d = tf.make_tokenizer_dir(tmp_path, "gpt2", config={"pad_token": "<|pad|>"})
    tok, hf = load_tokenizer(d), auto_tokenizer(str(d))
    assert tok.vocab_size == len(hf) == tf.build_tokenizer("gpt2").get_vocab_size() + 1
    assert tok.pad_id == hf.pad_token_id == tok.vocab_size - 1
    assert tok.encode("a<|pad|>b").tolist() == hf("a<|pad|>b")["input_ids"]


# ---------------------------------------------------------------------------------------------
# What the files say


@pytest.mark.parametrize("flavor", list(tf.FLAVORS))
def test_special_ids_and_stop_ids_come_from_the_files(flavor, toks):
    tok = toks[flavor]
    bos, eos, pad, stops = EXPECTED[flavor]
    ids = lambda t: None if t is None else tok.token_to_id(t)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (ids(bos), ids(eos), ids(pad))
    assert tok.stop_ids == tuple(map(ids, stops))
    assert (tok.chat_template is not None) == (tf.FLAVORS[flavor].template is not None)
    assert (tok.encode("Hi")[:1].tolist() == [tok.bos_id]) == (flavor in ADDS_BOS)
    assert tok.name_or_path.endswith(flavor)
    assert isinstance(tok, Tokenizer) and flavor in repr(tok)


@pytest.mark.parametrize("flavor", ["llama3", "gpt2", "qwen2.5", "mistral"])
def test_encode_document_adds_bos_as_the_checkpoint_and_one_eos(flavor, toks):
    tok = toks[flavor]
    text = "The quick brown fox."
    doc = tok.encode_document(text)
    assert doc.dtype == np.int32
    np.testing.assert_array_equal(doc[:-1], tok.encode(text))
    assert doc[-1] == tok.eos_id
    eos = tok.decode([tok.eos_id])
    again = tok.encode_document(text + eos)  # already ends with EOS: not doubled
    np.testing.assert_array_equal(again, tok.encode(text + eos))
    assert (again == tok.eos_id).sum() == 1 + (tok.bos_id == tok.eos_id and flavor in ADDS_BOS)


def test_model_max_length_and_the_no_limit_sentinel(tmp_path, toks):
    assert toks["llama3"].model_max_length == 131072
    d = tf.make_tokenizer_dir(tmp_path, "gpt2", config={"model_max_length": int(1e30)})
    assert load_tokenizer(d).model_max_length is None


def test_the_tokenizer_json_file_itself_reads_its_directory(dirs, toks):
    tok = load_tokenizer(dirs["qwen2.5"] / "tokenizer.json")
    assert tok.chat_template == toks["qwen2.5"].chat_template
    assert tok.stop_ids == toks["qwen2.5"].stop_ids


def test_chat_template_jinja_wins_over_the_config(tmp_path):
    d = tf.make_tokenizer_dir(tmp_path, "qwen2.5", template_file=True)
    assert load_tokenizer(d).chat_template == cases.CHAT_TEMPLATES["qwen2.5"]
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{{ 'from the config' }}"
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert load_tokenizer(d).chat_template == cases.CHAT_TEMPLATES["qwen2.5"]


def test_a_list_of_named_templates_gives_the_default(tmp_path):
    named = [
        {"name": "tool_use", "template": "{{ 'tools' }}"},
        {"name": "default", "template": cases.CHAT_TEMPLATES["smollm2"]},
    ]
    d = tf.make_tokenizer_dir(tmp_path, "smollm2", chat_template=False, config={"chat_template": named})
    assert load_tokenizer(d).chat_template == cases.CHAT_TEMPLATES["smollm2"]
    d = tf.make_tokenizer_dir(
        tmp_path / "b", "smollm2", chat_template=False, config={"chat_template": named[:1]}
    )
    with pytest.raises(
        DataError, match=r"tokenizer_config.json: chat_template lists \['tool_use'\] but no .*'default'"
    ):
        load_tokenizer(d)


def test_special_tokens_map_fills_what_the_config_does_not_set(tmp_path):
    d = tf.make_tokenizer_dir(
        tmp_path, "mistral", config={"eos_token": ..., "unk_token": ...}, generation_config=False
    )
    (d / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": {"content": "</s>", "lstrip": False}})
    )
    tok = load_tokenizer(d)
    assert tok.eos_id == tok.token_to_id("</s>") and tok.stop_ids == (tok.eos_id,)


def test_generation_config_gives_ids_the_tokenizer_does_not_name(tmp_path):
    d = tf.make_tokenizer_dir(tmp_path, "qwen2.5", config={"eos_token": ..., "pad_token": ...})
    tok = load_tokenizer(d)
    assert tok.stop_ids == (tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>"))
    assert (tok.eos_id, tok.pad_id) == (tok.stop_ids[0], tok.token_to_id("<|endoftext|>"))


# ---------------------------------------------------------------------------------------------
# Errors


def test_a_directory_without_tokenizer_json_suggests_the_flag(tmp_path):
    with pytest.raises(
        FileNotFoundError, match=r"no tokenizer.json in this directory; .*--tokenizer PATH"
    ) as e:
        load_tokenizer(tmp_path)
    assert str(tmp_path) in str(e.value) and "\n" not in str(e.value)
    (tmp_path / "tokenizer.model").write_bytes(b"\x00spm")
    with pytest.raises(
        FileNotFoundError, match=r"sentencepiece tokenizer.model is not read.*--tokenizer PATH"
    ):
        load_tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError, match="a sentencepiece model is not read"):
        load_tokenizer(tmp_path / "tokenizer.model")
    with pytest.raises(FileNotFoundError, match="no such file or directory"):
        load_tokenizer(tmp_path / "absent", name="--tokenizer")


def test_a_corrupt_tokenizer_json_names_the_file(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": ')
    with pytest.raises(
        DataError, match=r"tokenizer.json: not a tokenizer.json the tokenizers library can read"
    ) as e:
        load_tokenizer(tmp_path)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("file", "content", "match"),
    [
        ("tokenizer_config.json", "{not json", r"tokenizer_config.json: not valid JSON"),
        ("tokenizer_config.json", "[1, 3]", r"tokenizer_config.json: expected a JSON object, got list"),
        (
            "tokenizer_config.json",
            '{"eos_token": 5}',
            r"tokenizer_config.json: eos_token must be a token string",
        ),
        (
            "tokenizer_config.json",
            '{"add_bos_token": "yes"}',
            r"tokenizer_config.json: add_bos_token must be true or false",
        ),
        (
            "tokenizer_config.json",
            '{"chat_template": 3}',
            r"tokenizer_config.json: chat_template must be a string",
        ),
        (
            "tokenizer_config.json",
            '{"model_max_length": "big"}',
            r"tokenizer_config.json: model_max_length must be",
        ),
        (
            "special_tokens_map.json",
            '{"bos_token": ["<s>"]}',
            r"special_tokens_map.json: bos_token must be a token",
        ),
        (
            "generation_config.json",
            '{"eos_token_id": "x"}',
            r"generation_config.json: eos_token_id must be an id or",
        ),
        (
            "generation_config.json",
            '{"pad_token_id": [1]}',
            r"generation_config.json: pad_token_id must be an id,",
        ),
    ],
)
def test_a_bad_config_names_the_file_and_field(tmp_path, file, content, match):
    d = tf.make_tokenizer_dir(tmp_path, "gpt2")
    if file == "tokenizer_config.json" or file == "generation_config.json":
        (d / file).write_text(content)
    else:
        (d / "tokenizer_config.json").write_text("{}")
        (d / file).write_text(content)
    with pytest.raises(DataError, match=match):
        load_tokenizer(d)


def test_decode_and_encode_check_their_arguments(toks):
    tok = toks["gpt2"]
    with pytest.raises(ValueError, match=r"decode: ids must lie in \[0, 385\)"):
        tok.decode([1, 385])
    with pytest.raises(ValueError, match="1-D array of integers"):
        tok.decode([[1, 2]])
    with pytest.raises(ValueError, match="1-D array of integers"):
        tok.decode([1.5])
    with pytest.raises(TypeError, match="encode: text must be a str, got bytes"):
        tok.encode(b"hi")
    assert tok.decode(np.array([], np.int32)) == ""
    assert [a.tolist() for a in tok.encode_batch(["Hi", "you"])] == [
        tok.encode("Hi").tolist(),
        tok.encode("you").tolist(),
    ]


# ---------------------------------------------------------------------------------------------
# ByteTokenizer


@pytest.mark.parametrize("text", ["Hi!", "", "café 🙂\n"])
def test_byte_tokenizer_is_the_train_layers_bytes(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    np.testing.assert_array_equal(ids, byte_data.encode(text))
    assert ids.dtype == np.int32
    np.testing.assert_array_equal(tok.encode_document(text), ids)
    np.testing.assert_array_equal(tok.encode(text, add_special_tokens=False), ids)
    assert tok.decode(ids) == text == byte_data.decode(ids)
    assert [a.tolist() for a in tok.encode_batch([text, "x"])] == [ids.tolist(), [120]]


def test_byte_tokenizer_interface():
    tok = ByteTokenizer()
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id, tok.stop_ids, tok.chat_template) == (
        256,
        None,
        None,
        None,
        (),
        None,
    )
    assert tok.decode([104, 105, 255]) == "hi\ufffd"
    with pytest.raises(ValueError, match=r"\[0, 256\)"):
        tok.decode([256])
    with pytest.raises(DataError, match=r"'bytes' has no chat template.*--tokenizer PATH"):
        tok.encode_chat([{"role": "user", "content": "Hi"}])
