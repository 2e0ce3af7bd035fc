"""Fine-tune, export, generate: a Hugging Face LLaMA with its tokenizer is converted, fine-tuned
on a jsonl of the three record shapes, exported back with ``jaxckpt convert CKPT OUT --to
torch``, and transformers (the oracle) loads the export and generates the same greedy tokens as
``jaxckpt generate`` does from the checkpoint and from the export, plain and ``--chat``.

The module fixture ``base`` converts (the quick, unmarked check generates from it); the ``slow``
test trains 3 steps, exports, generates and runs the ``_check_*`` of each part of the criterion.
"""

import contextlib
import io
import json
import os

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tokenizer_fixtures import corpus_lines, make_tokenizer_dir  # noqa: E402

import jaxckpt  # noqa: E402
from jaxckpt.cli import main  # noqa: E402
from jaxckpt.data import load_tokenizer  # noqa: E402

pytestmark = pytest.mark.torch

PROMPT = "The quick brown fox jumps"
NEW = 8
TEXTS = (PROMPT, "hello world 42, café Zürich", "x = f(3) + 42; y != z?")
# A short template on Llama 3's header tokens (the Llama 3.2 one's system turn is longer than
# this model's max_len); its generation prompt opens the assistant's header.
CHAT = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
STOPS = ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")  # the llama3 fixture's generation_config.json


def _run(*argv) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([*argv, "--json"]) == 0
    return json.loads(out.getvalue())


def _records(n: int) -> list[dict]:
    """``n`` records from the corpus, the three shapes in turn."""
    shapes = (
        lambda line: {"text": line},
        lambda line: {"prompt": line[:11], "completion": line[11:]},
        lambda line: {
            "messages": [{"role": "user", "content": line[:13]}, {"role": "assistant", "content": line[13:]}]
        },
    )
    return [shapes[i % 3](line) for i, line in enumerate(corpus_lines(n))]


def _hf_model(tok) -> "transformers.LlamaForCausalLM":
    """A random LLaMA (GQA: 3 query heads, 1 kv head) over exactly the tokenizer's ids."""
    torch.manual_seed(5)
    config = transformers.LlamaConfig(
        vocab_size=len(tok),
        hidden_size=21,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=3,
        num_key_value_heads=1,
        head_dim=10,
        max_position_embeddings=64,
        rope_theta=500.0,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(config).to(torch.float32).eval()


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> dict:
    """The "downloaded" model: a Hugging Face directory (weights, tokenizer, chat template,
    generation config with three stop ids), and its ``jaxckpt convert``."""
    root = tmp_path_factory.mktemp("finetune_export")
    hf = root / "hf"
    make_tokenizer_dir(hf, "llama3", vocab_size=300, chat_template=CHAT)
    tok = transformers.AutoTokenizer.from_pretrained(hf)
    generation = (hf / "generation_config.json").read_bytes()
    _hf_model(tok).save_pretrained(hf)
    (hf / "generation_config.json").write_bytes(generation)  # save_pretrained wrote the model's
    _run("convert", str(hf), str(root / "conv"))
    return dict(root=root, hf=hf, conv=root / "conv", tok=tok)


def _pipeline(base) -> dict:
    """Fine-tunes ``conv`` for 3 steps, exports the checkpoint, generates from both."""
    root = base["root"]
    with open(root / "data.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in _records(37))
    ckpt, out = root / "ckpt", root / "out"
    trained = _run(
        "train", "--init-from", str(base["conv"]), "--data", str(root / "data.jsonl"), "--seq", "32",
        "--batch", "2", "--steps", "3", "--checkpoint-dir", str(ckpt), "--eval-split", "0.2",
    )  # fmt: skip
    exported = _run("convert", str(ckpt), str(out), "--to", "torch")
    generate = {
        (name, chat): _run("generate", str(d), "--prompt", PROMPT, "--max-new-tokens", str(NEW), *chat)
        for name, d, chat in (("ckpt", ckpt, ()), ("out", out, ()), ("ckpt", ckpt, ("--chat",)))
    }
    return dict(base, ckpt=ckpt, out=out, trained=trained, exported=exported, generate=generate)


def _greedy(model, ids: list[int], **kwargs) -> list[int]:
    with torch.no_grad():
        result = model.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            do_sample=False, max_new_tokens=NEW, **kwargs,
        )  # fmt: skip
    return result[0, len(ids) :].tolist()


def test_a_converted_model_generates_as_transformers(base):
    """The quick check (no training): ``jaxckpt generate`` of the converted directory gives
    the original's greedy tokens in transformers, from the same prompt ids."""
    ids = base["tok"](PROMPT).input_ids
    assert ids == load_tokenizer(base["conv"]).encode(PROMPT).tolist()
    g = _run("generate", str(base["conv"]), "--prompt", PROMPT, "--max-new-tokens", str(NEW))
    model = transformers.AutoModelForCausalLM.from_pretrained(base["hf"]).eval()
    assert g["new_token_ids"] == _greedy(model, ids)
    assert g["finish_reason"] == _finish(model, g["new_token_ids"])


def _finish(model, new: list[int]) -> str:
    """transformers' reason to stop: a stop id ends ``new``, else it ran to ``NEW``."""
    stops = model.generation_config.eos_token_id
    if new[-1] in stops:
        return "eos"
    assert len(new) == NEW
    return "length"


def _check_files(run):
    """The export has config.json, the weights and the tokenizer files; training evaluated."""
    names = {p.name for p in run["out"].iterdir()}
    assert {"config.json", "model.safetensors", *TOKENIZER_FILES} <= names
    assert run["exported"]["tokenizer_files"] == list(TOKENIZER_FILES)
    config = json.loads((run["out"] / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["vocab_size"] == len(run["tok"])
    assert [e["step"] for e in run["trained"]["eval"]] == [3]
    assert run["trained"]["data"]["kind"] == "packed" and run["trained"]["data"]["tokenizer"] == "files"


def _check_tokenizer(run):
    """transformers reads the exported tokenizer as the original (and as ours)."""
    original, back = run["tok"], transformers.AutoTokenizer.from_pretrained(run["out"])
    ours = load_tokenizer(run["ckpt"])
    for text in TEXTS:
        assert back(text).input_ids == original(text).input_ids == ours.encode(text).tolist()
    messages = [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": "over it"}]
    assert back.apply_chat_template(messages, tokenize=False) == original.apply_chat_template(
        messages, tokenize=False
    )
    assert (back.bos_token, back.eos_token, len(back)) == (
        original.bos_token,
        original.eos_token,
        len(original),
    )
    generation = transformers.GenerationConfig.from_pretrained(run["out"])
    assert generation.eos_token_id == [original.convert_tokens_to_ids(t) for t in STOPS]


def _check_trained_weights(run, exported_model):
    """The export is of the trained model, not of the base it started from."""
    base = transformers.AutoModelForCausalLM.from_pretrained(run["hf"]).state_dict()
    trained = exported_model.state_dict()
    assert base.keys() == trained.keys()
    changed = [k for k in base if not torch.equal(base[k], trained[k])]
    assert len(changed) == len(base)  # every tensor moved (Adam moves each parameter)
    assert exported_model.dtype == torch.float32


def _check_greedy(run, exported_model):
    """Same prompt ids, and the same greedy tokens from the checkpoint, the export and transformers."""
    ids = transformers.AutoTokenizer.from_pretrained(run["out"])(PROMPT).input_ids
    assert ids == load_tokenizer(run["ckpt"]).encode(PROMPT).tolist()
    ckpt, out = run["generate"][("ckpt", ())], run["generate"][("out", ())]
    assert ckpt == out
    assert ckpt["new_token_ids"] == _greedy(exported_model, ids)
    assert ckpt["finish_reason"] == _finish(exported_model, ckpt["new_token_ids"])


def _check_stop_id(run, exported_model):
    """The greedy tokens' fourth as the only stop id: both stop on it, at its first place."""
    ids = run["tok"](PROMPT).input_ids
    stop = run["generate"][("ckpt", ())]["new_token_ids"][3]
    g = jaxckpt.generate(run["ckpt"], PROMPT, max_new_tokens=NEW, stop_ids=[stop])
    expected = _greedy(exported_model, ids, eos_token_id=stop)
    assert g.new_token_ids == expected and expected[-1] == stop and g.finish_reason == "eos"


def _check_chat(run, exported_model):
    """``--chat``'s prompt is transformers' apply_chat_template, and it generates as transformers."""
    back = transformers.AutoTokenizer.from_pretrained(run["out"])
    messages = [{"role": "user", "content": PROMPT}]
    ids = back.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    ours = load_tokenizer(run["ckpt"])
    text = ours.apply_chat_template(messages, add_generation_prompt=True)
    assert text == back.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert np.asarray(ours.encode(text, add_special_tokens=False)).tolist() == list(ids)
    chat = run["generate"][("ckpt", ("--chat",))]
    assert chat["new_token_ids"] == _greedy(exported_model, list(ids))
    assert chat["finish_reason"] == _finish(exported_model, chat["new_token_ids"])


@pytest.mark.slow
def test_a_fine_tuned_checkpoint_exports_and_generates_as_transformers(base):
    """The issue's criterion. One test, so that the pipeline runs once whatever worker it is on."""
    run = _pipeline(base)
    exported_model = transformers.AutoModelForCausalLM.from_pretrained(run["out"]).eval()
    _check_files(run)
    _check_tokenizer(run)
    _check_trained_weights(run, exported_model)
    _check_greedy(run, exported_model)
    _check_stop_id(run, exported_model)
    _check_chat(run, exported_model)
