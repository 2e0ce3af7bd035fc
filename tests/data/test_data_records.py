"""encode_record: the three record shapes (text, messages, prompt/completion), their loss masks,
with a checkpoint's tokenizer and with ByteTokenizer, and the errors that name the record."""

import chat_template_cases as cases
import numpy as np
import pytest
import tokenizer_fixtures as tf

from jaxckpt.data import (
    RECORD_SHAPES,
    ByteTokenizer,
    DataError,
    Example,
    encode_record,
    load_tokenizer,
    record_shape,
)

CHAT = cases.CONVERSATIONS["multi_turn"]


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    root = tmp_path_factory.mktemp("records")
    hf = {f: load_tokenizer(tf.make_tokenizer_dir(root / f, f)) for f in ("llama3", "qwen2.5", "mistral")}
    return {**hf, "bytes": ByteTokenizer()}


def _check(ex):
    assert isinstance(ex, Example)
    assert ex.ids.dtype == np.int32 and ex.loss_mask.dtype == bool and ex.ids.shape == ex.loss_mask.shape


@pytest.mark.parametrize("name", ["llama3", "qwen2.5", "mistral", "bytes"])
def test_text_is_a_document_with_the_loss_everywhere(name, toks):
    tok = toks[name]
    ex = encode_record({"text": "The quick brown fox.", "id": 3, "meta": {"x": 1}}, tok, where="a.jsonl:1")
    _check(ex)
    np.testing.assert_array_equal(ex.ids, tok.encode_document("The quick brown fox."))
    assert ex.loss_mask.all()
    assert (ex.ids[-1] == tok.eos_id) == (name != "bytes")


@pytest.mark.parametrize("name", ["llama3", "qwen2.5", "mistral"])
def test_messages_are_a_chat_with_the_loss_on_the_assistant(name, toks):
    tok = toks[name]
    ex = encode_record({"messages": CHAT, "source": "x"}, tok, where="a.jsonl:2")
    _check(ex)
    want = tok.encode_chat(CHAT)
    np.testing.assert_array_equal(ex.ids, want.ids)
    np.testing.assert_array_equal(ex.loss_mask, want.loss_mask)
    targets = tok.decode(ex.ids[ex.loss_mask])
    assert "Seven is prime." in targets and "Two, the only even prime." in targets
    assert "Name a prime" not in targets and "terse assistant" not in targets


def test_messages_with_the_byte_tokenizer_say_there_is_no_template(toks):
    with pytest.raises(DataError, match=r"^chat.jsonl:4: the tokenizer 'bytes' has no chat template"):
        encode_record({"messages": CHAT}, toks["bytes"], where="chat.jsonl:4")


@pytest.mark.parametrize("name", ["llama3", "qwen2.5", "mistral", "bytes"])
def test_prompt_completion_has_the_loss_on_the_completion_and_eos(name, toks):
    tok = toks[name]
    record = {"prompt": "What is 2+2?", "completion": " Four.", "extra": None}
    ex = encode_record(record, tok, where="pc.jsonl:9")
    _check(ex)
    prompt, completion = tok.encode("What is 2+2?"), tok.encode(" Four.", add_special_tokens=False)
    eos = [] if tok.eos_id is None else [tok.eos_id]
    assert ex.ids.tolist() == prompt.tolist() + completion.tolist() + eos
    assert ex.loss_mask.tolist() == [False] * len(prompt) + [True] * (len(completion) + len(eos))
    assert (prompt[:1].tolist() == [tok.bos_id]) == (name in ("llama3", "mistral"))
    assert tok.decode(ex.ids[ex.loss_mask], skip_special_tokens=True).strip() == "Four."


def test_record_shape_tells_the_shapes_apart():
    assert record_shape({"text": "a", "n": 1}) == "text"
    assert record_shape({"messages": []}) == "messages"
    assert record_shape({"prompt": "a", "completion": "b"}) == "prompt_completion"
    assert set(RECORD_SHAPES) == {"text", "messages", "prompt_completion"}


@pytest.mark.parametrize(
    ("record", "match"),
    [
        (["text"], r"^d.jsonl:5: a record must be a JSON object, got list$"),
        (
            {"txt": "a", "id": 1},
            r"^d.jsonl:5: a record needs the fields of one of .*found the fields \['id', 'txt'\]$",
        ),
        (
            {"prompt": "a"},
            r'"text": str\}; \{"messages": list\}; \{"prompt": str, "completion": str\}; found',
        ),
        ({"text": "a", "messages": []}, r"^d.jsonl:5: .*it has the fields of text and messages$"),
        ({"text": 3}, r"^d.jsonl:5: 'text' must be a str, got int$"),
        ({"messages": "hi"}, r"^d.jsonl:5: 'messages' must be a list, got str$"),
        ({"prompt": "a", "completion": ["b"]}, r"^d.jsonl:5: 'completion' must be a str, got list$"),
        ({"messages": [{"role": "bot", "content": "b"}]}, r"^d.jsonl:5: messages\[0\]: unknown role 'bot'"),
        ({"messages": [{"role": "user"}]}, r"^d.jsonl:5: messages\[0\] has no 'content' field"),
        ({"messages": []}, r"^d.jsonl:5: messages is empty"),
    ],
)
def test_bad_records_name_where_and_what(record, match, toks):
    with pytest.raises(DataError, match=match):
        encode_record(record, toks["qwen2.5"], where="d.jsonl:5")
