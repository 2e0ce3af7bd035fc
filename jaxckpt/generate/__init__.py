"""Generation: a KV-cache prefill and decode step over ``jaxckpt.nn`` models, greedy and
sampled decoding, from a Hugging Face, converted or trained model directory."""

__all__: list[str] = []
