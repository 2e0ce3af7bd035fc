"""Generation: a KV-cache prefill and decode step over ``jaxckpt.nn`` models, greedy and
sampled decoding, from a Hugging Face, converted or trained model directory.

``jaxckpt.generate`` is the function ``generate`` (``jaxckpt/__init__.py`` binds it over
this package's name); import the rest from here: ``from jaxckpt.generate import Generation``.

Example:
    >>> from jaxckpt.generate import Sampling, warp_logits
    >>> Sampling(temperature=0.0).greedy
    True
"""

from jaxckpt.generate._decode import decode_ids
from jaxckpt.generate._generate import FINISH_REASONS, Generation, generate
from jaxckpt.generate._load import load_model, resolve_tokenizer
from jaxckpt.generate._sampling import Knobs, Sampling, next_token, warp_logits

__all__ = [
    "FINISH_REASONS",
    "Generation",
    "Knobs",
    "Sampling",
    "decode_ids",
    "generate",
    "load_model",
    "next_token",
    "resolve_tokenizer",
    "warp_logits",
]
