"""Chat templates: rendered as transformers.AutoTokenizer.apply_chat_template renders them (six
real templates), the ids of encode_chat, and its loss mask on the assistant's turns only."""

import os
import pickle

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import chat_template_cases as cases
import numpy as np
import pytest
import tokenizer_fixtures as tf

from jaxckpt.data import CHAT_ROLES, DataError, load_tokenizer
from jaxckpt.data._chat import check_messages, render_chat

# template -> the flavor whose tokenizer it ships with
PAIRS = {
    "llama3": "llama3",
    "qwen2.5": "qwen2.5",
    "smollm2": "smollm2",
    "gemma": "gemma",
    "mistral": "mistral",
    "phi3": "phi3",
}
CASES = [(t, c) for t in PAIRS for c in cases.conversations_for(t)]

# template -> (what an assistant turn's masked tokens end with, a header text never masked)
END_OF_TURN = {
    "llama3": ("<|eot_id|>", "<|start_header_id|>assistant<|end_header_id|>"),
    "qwen2.5": ("<|im_end|>\n", "<|im_start|>assistant"),
    "smollm2": ("<|im_end|>\n", "<|im_start|>assistant"),
    "gemma": ("<end_of_turn>\n", "<start_of_turn>model"),
    "mistral": ("</s>", "[/INST]"),
    "phi3": ("<|end|>", "<|assistant|>"),
}


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    return {t: load_tokenizer(tf.make_tokenizer_dir(root / t, flavor)) for t, flavor in PAIRS.items()}


@pytest.fixture(scope="module")
def hf_toks(toks):
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return {t: transformers.AutoTokenizer.from_pretrained(tok.name_or_path) for t, tok in toks.items()}


def _gen_prompts(conv):
    return (True,) if conv[-1]["role"] == "user" else (False, True)


def _masked_pieces(tok, ex) -> list[str]:
    """The decoded runs of masked tokens."""
    edges = np.flatnonzero(np.diff(np.r_[0, ex.loss_mask.astype(int), 0]))
    return [tok.decode(ex.ids[a:b]) for a, b in zip(edges[::2], edges[1::2], strict=True)]


# ---------------------------------------------------------------------------------------------
# The oracle: transformers


@pytest.mark.torch
@pytest.mark.parametrize(("template", "conv"), CASES)
def test_rendering_and_ids_equal_transformers(template, conv, toks, hf_toks):
    tok, hf, messages = toks[template], hf_toks[template], cases.CONVERSATIONS[conv]
    for gen in _gen_prompts(messages):
        text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        assert tok.apply_chat_template(messages, add_generation_prompt=gen) == text
        ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen)["input_ids"]
        ex = tok.encode_chat(messages, add_generation_prompt=gen)
        assert ex.ids.tolist() == list(ids)
        assert ex.ids.dtype == np.int32 and ex.loss_mask.dtype == bool and ex.loss_mask.shape == ex.ids.shape


@pytest.mark.torch
@pytest.mark.parametrize(
    "conv",
    [
        [{"role": "system", "content": "Hi"}, {"role": "user", "content": "Hello"}],
        [{"role": "user", "content": "Hello"}, {"role": "user", "content": "Again"}],
        [{"role": "assistant", "content": "I start"}],
    ],
)
def test_gemma_refuses_what_transformers_refuses(conv, toks, hf_toks):
    jinja2 = pytest.importorskip("jinja2")
    with pytest.raises(jinja2.TemplateError) as theirs:
        hf_toks["gemma"].apply_chat_template(conv, tokenize=False)
    with pytest.raises(DataError, match="the chat template refused the conversation: ") as ours:
        toks["gemma"].apply_chat_template(conv)
    assert str(ours.value).endswith(str(theirs.value))
    with pytest.raises(DataError, match="refused"):
        toks["gemma"].encode_chat(conv)


@pytest.mark.torch
@pytest.mark.parametrize("conv", list(cases.CONVERSATIONS))
def test_loss_mask_equals_transformers_assistant_mask(conv, tmp_path, hf_toks):
    """A ChatML template with {% generation %} around what the assistant writes: transformers'
    return_assistant_tokens_mask is the oracle of the loss mask."""
    d = tf.make_tokenizer_dir(tmp_path, "qwen2.5", chat_template="chatml_generation")
    transformers = pytest.importorskip("transformers")
    hf, tok = transformers.AutoTokenizer.from_pretrained(str(d)), load_tokenizer(d)
    messages = cases.CONVERSATIONS[conv]
    for gen in _gen_prompts(messages):
        out = hf.apply_chat_template(
            messages,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
            add_generation_prompt=gen,
        )
        ex = tok.encode_chat(messages, add_generation_prompt=gen)
        assert ex.ids.tolist() == list(out["input_ids"])
        assert ex.loss_mask.astype(int).tolist() == list(out["assistant_masks"])
        assert ex.loss_mask.any()


TOOL_CHAT = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}],
    },
    {"role": "tool", "content": '{"sky": "clear"}'},
    {"role": "assistant", "content": "Clear skies."},
]


@pytest.mark.torch
@pytest.mark.parametrize("template", ["llama3", "qwen2.5"])
def test_tool_calls_and_tool_turns_as_transformers(template, toks, hf_toks):
    tok, hf = toks[template], hf_toks[template]
    assert tok.apply_chat_template(TOOL_CHAT) == hf.apply_chat_template(TOOL_CHAT, tokenize=False)
    ex = tok.encode_chat(TOOL_CHAT)
    assert ex.ids.tolist() == list(hf.apply_chat_template(TOOL_CHAT, tokenize=True)["input_ids"])
    call, reply = _masked_pieces(tok, ex)
    assert (
        '"weather"' in call and "Paris" in call and "clear" not in call and reply.startswith("Clear skies.")
    )


# ---------------------------------------------------------------------------------------------
# The loss mask, read back


@pytest.mark.parametrize(("template", "conv"), CASES)
def test_loss_mask_is_the_assistants_content_and_end_of_turn(template, conv, toks):
    tok, messages = toks[template], cases.CONVERSATIONS[conv]
    end, header = END_OF_TURN[template]
    replies = [m["content"] for m in messages if m["role"] == "assistant"]
    for gen in _gen_prompts(messages):
        ex = tok.encode_chat(messages, add_generation_prompt=gen)
        pieces = _masked_pieces(tok, ex)
        assert len(pieces) == len(replies)
        for piece, reply in zip(pieces, replies, strict=True):
            assert piece.strip().startswith(reply.strip()) and header not in piece
            last = (
                template == "phi3" and piece is pieces[-1] and not gen and messages[-1]["role"] == "assistant"
            )
            assert piece.endswith(end + "<|endoftext|>" if last else end), piece
        text = tok.apply_chat_template(messages, add_generation_prompt=gen)
        np.testing.assert_array_equal(ex.ids, tok.encode(text, add_special_tokens=False))
        user = [m["content"] for m in messages if m["role"] != "assistant"]
        assert not any(u in p for u in user for p in pieces)


def test_a_generation_prompt_is_not_a_target(toks):
    tok = toks["llama3"]
    messages = cases.CONVERSATIONS["trailing_user"]
    ex = tok.encode_chat(messages, add_generation_prompt=True)
    assert tok.decode(ex.ids).endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert not ex.loss_mask[-4:].any()
    assert _masked_pieces(tok, ex) == ["Water boils at 100 degrees.<|eot_id|>"]


def test_a_template_whose_context_is_no_prefix_is_refused(toks):
    """A template that writes the turn count first renders messages[:i] as no prefix."""
    tok = toks["qwen2.5"]
    tok_template, tok.chat_template = (
        tok.chat_template,
        "{{ messages | length }}" + cases.CHAT_TEMPLATES["smollm2"],
    )
    try:
        with pytest.raises(
            DataError, match=r"renders messages\[:1\] with its generation prompt .* assistant message 1"
        ):
            tok.encode_chat(cases.CONVERSATIONS["no_system"])
        assert tok.apply_chat_template(cases.CONVERSATIONS["no_system"]).startswith("4<|im_start|>")
    finally:
        tok.chat_template = tok_template


# ---------------------------------------------------------------------------------------------
# Messages and errors


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ("hello", r"messages must be a list of \{'role', 'content'\} objects, got str"),
        ([], "messages is empty"),
        (["hi"], r"messages\[0\] must be an object with 'role' and 'content', got str"),
        ([{"content": "hi"}], r"messages\[0\] has no 'role' field"),
        ([{"role": "user", "content": "a"}, {"role": "assistant"}], r"messages\[1\] has no 'content' field"),
        ([{"role": "user", "content": None}], r"messages\[0\] has no 'content' field"),
        (
            [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}],
            r"messages\[1\]: unknown role 'bot'; expected one of system, user, assistant, tool",
        ),
        ([{"role": "user", "content": 3}], r"messages\[0\]: 'content' must be a string .*got int"),
    ],
)
def test_bad_messages_name_the_index_and_field(messages, match, toks):
    with pytest.raises(DataError, match=match):
        toks["qwen2.5"].encode_chat(messages)
    with pytest.raises(DataError, match=match):
        check_messages(messages)


def test_a_tokenizer_pickles_with_its_template(toks):
    tok = pickle.loads(pickle.dumps(toks["qwen2.5"]))
    ex, want = (
        tok.encode_chat(cases.CONVERSATIONS["multi_turn"]),
        toks["qwen2.5"].encode_chat(cases.CONVERSATIONS["multi_turn"]),
    )
    np.testing.assert_array_equal(ex.ids, want.ids)
    np.testing.assert_array_equal(ex.loss_mask, want.loss_mask)


def test_roles_and_none_fields():
    assert CHAT_ROLES == ("system", "user", "assistant", "tool")
    assert check_messages([{"role": "tool", "content": "{}", "tool_calls": None}]) == [
        {"role": "tool", "content": "{}"}
    ]
    out = check_messages([{"role": "assistant", "content": "4", "reasoning": "2+2"}])[0]
    assert out["reasoning_content"] == out["thinking"] == "2+2"


def test_no_chat_template_says_so_and_names_the_flag(tmp_path):
    tok = load_tokenizer(tf.make_tokenizer_dir(tmp_path, "gpt2"))
    assert tok.chat_template is None
    with pytest.raises(DataError, match=r"has no chat template, .*--tokenizer PATH can point to"):
        tok.encode_chat([{"role": "user", "content": "hi"}])
    with pytest.raises(DataError, match="has no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_errors_become_data_errors():
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(DataError, match=r"does not compile \(line 1: "):
        render_chat("{% for m in messages %}", msgs)
    with pytest.raises(DataError, match="refused the conversation: no users"):
        render_chat("{{ raise_exception('no users') }}", msgs)
    with pytest.raises(DataError, match=r"failed on the conversation \(TypeError: "):
        render_chat("{{ messages[0].content + 1 }}", msgs)
    with pytest.raises(DataError, match="namespace attribute may not start with '_'"):
        render_chat("{% set ns = namespace(_x=1) %}", msgs)


def test_the_environment_is_transformers(toks):
    msgs = [{"role": "user", "content": "<b>&é</b>"}]
    assert render_chat("{{ messages[0] | tojson }}", msgs) == '{"role": "user", "content": "<b>&é</b>"}'
    assert render_chat("  {% if true %}\n  x{% endif %}", msgs) == "  x"  # trim_blocks, lstrip_blocks
    loop = "{% for m in [1, 2, 3] %}{% if m == 2 %}{% break %}{% endif %}{{ m }}{% endfor %}"
    assert render_chat(loop, msgs) == "1"
    assert render_chat("{% generation %}{{ 'in' }}{% endgeneration %}", msgs) == "in"
    assert len(render_chat("{{ strftime_now('%Y-%m-%d') }}", msgs)) == 10
    assert (
        render_chat("{{ bos_token }}|{{ eos_token }}|{{ tools }}", msgs, variables={"eos_token": "E"})
        == "|E|None"
    )
    assert toks["qwen2.5"].apply_chat_template(msgs).startswith("<|im_start|>system\nYou are Qwen")
