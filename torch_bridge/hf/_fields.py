"""The classes of ``config.json`` fields, as data, and the check that sorts a config into them.

Every field of a Hugging Face config is in one of three classes:

1. **used**: the family's reader reads it (``USED``, per layout);
2. **known not to change the numbers**: accepted silently: ``HARMLESS`` at any value
   (names, ids, output flags, generation defaults), ``FAMILY_HARMLESS`` for one family
   (fields transformers' class for it ignores), ``OFF_AT`` at the values where the
   feature is off (``rope_interleaved: false``, ``sliding_window: null``), and ``NOTED``:
   training-only fields (dropout) accepted with a note in the report;
3. **known to change the numbers in a way jaxckpt does not implement**: refused by name
   with the reason: ``REFUSED`` always, ``OFF_AT`` at any other value.

A field in none of the classes is *unknown*: ``check_fields`` lists it (the report's
``unknown_fields``), warns once (``JaxckptWarning``), and loading goes on; ``strict=True``
refuses it instead. The ground truth behind this leniency is ``verify=True``, which
compares the logits with transformers'.
"""

import dataclasses
import warnings
from collections.abc import Callable, Mapping

from jaxckpt._warnings import JaxckptWarning


def _names(text: str) -> frozenset[str]:
    return frozenset(text.split())


NAMES_AND_IDS = _names(
    """
    _name_or_path name_or_path _commit_hash architectures model_type transformers_version
    torch_dtype dtype use_bfloat16 bos_token_id eos_token_id pad_token_id unk_token_id
    sep_token_id cls_token_id mask_token_id decoder_start_token_id tokenizer_class id2label
    label2id num_labels problem_type finetuning_task task_specific_params prefix
    initializer_range initializer_factor is_llama_config
    """
)
"""Names, ids, labels and the initialisation scale: the trained weights and the forward pass
do not read them."""

RUNTIME = _names(
    """
    use_cache cache_implementation return_dict use_return_dict output_attentions
    output_hidden_states torchscript chunk_size_feed_forward is_encoder_decoder is_decoder
    tie_encoder_decoder cross_attention_hidden_size attn_implementation _attn_implementation
    _attn_implementation_autoset _attn_implementation_internal experts_implementation
    _experts_implementation tie_last_hidden_states gradient_checkpointing pretraining_tp
    xla_device keys_to_ignore_at_inference
    """
)
"""How transformers runs the model (kernels, caches, outputs, ``pretraining_tp``'s sliced
matmuls), not what it computes."""

GENERATION = _names(
    """
    assistant_confidence_threshold assistant_lookbehind bad_words_ids begin_suppress_tokens
    diversity_penalty do_sample early_stopping encoder_no_repeat_ngram_size
    encoder_repetition_penalty epsilon_cutoff eta_cutoff exponential_decay_length_penalty
    forced_bos_token_id forced_eos_token_id length_penalty max_length min_length
    no_repeat_ngram_size num_assistant_tokens num_assistant_tokens_schedule num_beam_groups
    num_beams num_return_sequences output_scores remove_invalid_values repetition_penalty
    return_dict_in_generate suppress_tokens target_lookbehind temperature top_k top_p typical_p
    max_new_tokens min_p
    """
)
"""Sampling defaults that older configs carry (transformers moves them to the generation config)."""

GPT2_HEADS = frozenset(
    {"summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels", "n_ctx"}
)  # fmt: skip
"""GPT-2's sequence-summary head (not the language model) and the legacy ``n_ctx``."""

HARMLESS = NAMES_AND_IDS | RUNTIME | GENERATION
"""Class 2 at any value, for every family."""

FAMILY_HARMLESS: dict[str, frozenset] = {
    "gpt2": GPT2_HEADS,
    "gemma2": frozenset({"hidden_act"}),  # the MLP reads hidden_activation; hidden_act is Gemma 1's
    "gemma3": frozenset({"hidden_act", "_sliding_window_pattern"}),  # the latter: derived, layer_types decide
    "gemma3-multimodal": _names(
        """vision_config mm_tokens_per_image boi_token_index eoi_token_index image_token_index
        boi_token_id eoi_token_id image_token_id"""
    ),
    "qwen2": frozenset({"attention_bias"}),  # Qwen2's q/k/v bias and bias-free o are fixed in its code
    "smollm3": frozenset({"max_window_layers"}),  # a Qwen2 leftover SmolLM3's code never reads
}
"""Class 2 for one layout only: fields that transformers' class for it ignores."""


def _noted_dropout(field: str, value) -> str | None:
    return f"{field}={value} is not applied: jaxckpt models have no dropout" if value else None


def _noted_remote_code(field: str, value) -> str | None:
    return (
        f"{field} names remote code; jaxckpt reads the built-in architecture of the model_type, as "
        "transformers does without trust_remote_code"
    )


NOTED: dict[str, Callable[[str, object], str | None]] = {
    **dict.fromkeys(
        """attention_dropout attn_pdrop resid_pdrop embd_pdrop embedding_dropout hidden_dropout
        hidden_dropout_prob attention_probs_dropout_prob dropout summary_first_dropout mlp_dropout""".split(),  # noqa: SIM905
        _noted_dropout,
    ),
    "auto_map": _noted_remote_code,
}
"""Class 2 with a note in the report: training-only fields (dropout) and ``auto_map``."""


@dataclasses.dataclass(frozen=True)
class OffAt:
    """A field that changes nothing at the values ``off`` accepts, and is refused at others.

    Attributes:
        off: ``value -> True`` when the feature is off. why: the reason it is refused otherwise.

    Example:
        >>> OffAt(lambda v: not v, "interleaved RoPE pairs").off(False)
        True
    """

    off: Callable[[object], bool]
    why: str


def _falsy(value) -> bool:
    return not value


def _none(value) -> bool:
    return value is None


def _one(value) -> bool:
    return value is None or value == 1


def _all_full(value) -> bool:
    return value is None or all(kind == "full_attention" for kind in value)


OFF_AT: dict[str, OffAt] = {
    "rope_interleaved": OffAt(_falsy, "interleaved (GPT-J style) RoPE pairs; jaxckpt rotates halves"),
    "use_sliding_window": OffAt(_falsy, "a sliding window this family's attention does not have"),
    "sliding_window": OffAt(_none, "a sliding window this family's attention does not have"),
    "layer_types": OffAt(_all_full, "per-layer attention kinds this family does not have"),
    "rope_scaling": OffAt(_falsy, "RoPE scaling in a family without RoPE"),
    "rope_parameters": OffAt(_falsy, "RoPE parameters in a family without RoPE"),
    "partial_rotary_factor": OffAt(_one, "a partial rotary dim this family does not have"),
    "attention_bias": OffAt(_falsy, "attention biases this family does not have"),
    "mlp_bias": OffAt(_falsy, "MLP biases this family does not have"),
    "lm_head_bias": OffAt(_falsy, "a bias on the output head"),
    "use_bidirectional_attention": OffAt(_falsy, "bidirectional (non-causal) attention"),
    "use_mrope": OffAt(_falsy, "multimodal rotary positions (Qwen2-VL)"),
    "add_cross_attention": OffAt(_falsy, "cross-attention layers"),
    "reorder_and_upcast_attn": OffAt(_falsy, "fp32-upcast attention reordering"),
    "scale_attn_by_inverse_layer_idx": OffAt(_falsy, "attention scaled by 1/layer index"),
    "pruned_heads": OffAt(_falsy, "pruned attention heads"),
    "full_attn_mod": OffAt(_one, "every full_attn_mod-th layer full, the others sparse (remote code)"),
    "interpolate_factor": OffAt(_one, "RoPE position interpolation (remote code)"),
}
"""Class 2 at the values where the feature is off, class 3 at any other (with the reason)."""

REFUSED: dict[str, str] = {
    "quantization_config": "quantized weights; dequantize first (transformers from_pretrained, then "
    "save_pretrained unquantized)",
    "compression_config": "compressed weights; decompress first (transformers from_pretrained, then "
    "save_pretrained)",
    "per_layer_config": "per-layer overrides of the architecture",
}
"""Class 3: refused at any value."""

ROPE_KEYS = _names(
    """
    rope_type type rope_theta partial_rotary_factor factor original_max_position_embeddings
    low_freq_factor high_freq_factor beta_fast beta_slow mscale mscale_all_dim truncate
    attention_factor short_factor long_factor
    """
)
"""The keys of a ``rope_parameters`` / ``rope_scaling`` dict that the RoPE reader knows."""

_SIZES = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"}
_SIZES |= {"num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps"}
_SIZES |= {"tie_word_embeddings"}
_ROPE = {"rope_theta", "rope_parameters", "rope_scaling", "original_max_position_embeddings"}
_DECODER = frozenset(_SIZES | _ROPE | {"hidden_act"})
_QWEN_WINDOW = {"use_sliding_window", "sliding_window", "max_window_layers", "layer_types"}
_GEMMA = (_DECODER - {"hidden_act"}) | {"hidden_activation", "attention_bias", "query_pre_attn_scalar"}
_GEMMA |= {"sliding_window", "layer_types", "final_logit_softcapping", "attn_logit_softcapping"}

USED: dict[str, frozenset] = {
    "llama": _DECODER | {"attention_bias", "mlp_bias"},
    "mistral": _DECODER | {"sliding_window"},
    "qwen2": _DECODER | _QWEN_WINDOW,
    "qwen3": _DECODER | _QWEN_WINDOW | {"attention_bias"},
    "gemma2": frozenset(_GEMMA),
    "gemma3": frozenset(_GEMMA | {"rope_local_base_freq", "sliding_window_pattern"}),
    "gemma3-multimodal": frozenset({"text_config", "tie_word_embeddings"}),
    "phi3": _DECODER | {"partial_rotary_factor", "sliding_window"},
    "smollm3": _DECODER
    | _QWEN_WINDOW - {"max_window_layers"}
    | {"attention_bias", "mlp_bias"}
    | {"no_rope_layers", "no_rope_layer_interval"},
    "gpt2": _names(
        """vocab_size n_embd n_layer n_head n_inner n_positions layer_norm_epsilon activation_function
        scale_attn_weights tie_word_embeddings"""
    ),
}
"""Class 1, per layout (a family name, or ``gemma3-multimodal`` for the outside of a
multimodal Gemma 3 config): the fields its reader reads."""


@dataclasses.dataclass
class FieldCheck:
    """What ``check_fields`` found besides the used and silently harmless fields.

    Attributes:
        notes: class-2 fields worth a line in the report (a non-zero dropout).
        unknown: fields in no class, as ``name=value`` strings.

    Example:
        >>> FieldCheck().unknown
        []
    """

    notes: list[str] = dataclasses.field(default_factory=list)
    unknown: list[str] = dataclasses.field(default_factory=list)


def refusal(field: str, value, why: str) -> ValueError:
    """The error for a field jaxckpt cannot honour: its name, its value and the reason.

    Example:
        >>> str(refusal("quantization_config", {"bits": 4}, "quantized weights"))
        "quantization_config={'bits': 4} is not supported by jaxckpt (quantized weights)"
    """
    return ValueError(f"{field}={value!r} is not supported by jaxckpt ({why})")


def classify(hf: Mapping, layout: str) -> FieldCheck:
    """Sorts the fields of ``hf`` (a config of ``layout``, a key of ``USED``) into the classes.

    Raises:
        ValueError: for a class-3 field (named, with its value and the reason).

    Example:
        >>> found = classify({"model_type": "llama", "foo": 1, "attention_dropout": 0.1}, "llama")
        >>> found.unknown, found.notes
        (['foo=1'], ['attention_dropout=0.1 is not applied: jaxckpt models have no dropout'])
    """
    found = FieldCheck()
    used = USED[layout] | FAMILY_HARMLESS.get(layout, frozenset())
    for field, value in hf.items():
        if field in REFUSED:
            raise refusal(field, value, REFUSED[field])
        if field in used:
            continue
        if field in OFF_AT:
            if not OFF_AT[field].off(value):
                raise refusal(field, value, f"{OFF_AT[field].why}; not implemented for {layout}")
        elif field in NOTED:
            note = NOTED[field](field, value)
            if note:
                found.notes.append(note)
        elif field not in HARMLESS:
            found.unknown.append(f"{field}={value!r}")
    for field in ("rope_parameters", "rope_scaling"):
        if field in USED[layout]:
            found.unknown += _unknown_rope_keys(field, hf.get(field))
    return found


def _unknown_rope_keys(field: str, params) -> list[str]:
    if not isinstance(params, Mapping):
        return []
    nested = {k: v for k, v in params.items() if k in ("full_attention", "sliding_attention")}
    groups = {f"{field}.{k}": v for k, v in nested.items()} if nested else {field: params}
    out = []
    for where, group in groups.items():
        if isinstance(group, Mapping):
            out += [f"{where}.{k}={v!r}" for k, v in group.items() if k not in ROPE_KEYS]
    return out


def report_unknown(unknown: list[str], source: str, strict: bool) -> None:
    """Warns once about the unknown fields of ``source`` or, when ``strict``, refuses them.

    Raises:
        ValueError: when ``strict`` and there are unknown fields (all named).

    Example:
        >>> report_unknown([], "config.json", strict=True)  # nothing unknown: nothing to say
    """
    if not unknown:
        return
    listed = ", ".join(unknown)
    if strict:
        raise ValueError(
            f"{source}: unknown config field(s) {listed}: jaxckpt cannot tell whether they change the "
            "numbers; strict=True refuses them (without it they are listed in the report and ignored)"
        )
    warnings.warn(
        f"{source}: config field(s) {listed} are not known to jaxckpt and are ignored; check the "
        "numbers with verify=True, or refuse such fields with strict=True",
        JaxckptWarning,
        stacklevel=4,
    )
