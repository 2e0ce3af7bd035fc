"""Where a run's first parameters come from: a random init, a jaxckpt checkpoint (trained
or converted by ``jaxckpt convert``), or a Hugging Face directory through torch_bridge."""

import os
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from jaxckpt._checks import require_finite
from jaxckpt._plugins import MODEL_SOURCES, plugin
from jaxckpt.nn import Transformer, TransformerConfig, from_params
from jaxckpt.train._checkpoint import META, read_meta, restore_checkpoint
from jaxckpt.train._optimizers import OptimizerConfig
from jaxckpt.train._step import Trainer

PARAMS_KIND = "params"
"""``jaxckpt.json``'s ``kind`` for a checkpoint that holds parameters only (converted)."""

FREE_ON_INIT = frozenset({"dtype", "param_dtype", "mlp_chunk"})
"""Config fields a run may change from its source: neither shapes nor the model's maths (the
MLP's tile is how it is computed, not what)."""


def is_hf_dir(path: Path) -> bool:
    """Whether ``path`` is a Hugging Face model directory (it has ``config.json``)."""
    return (path / "config.json").is_file()


def _hf_reader(path: Path, name: str):
    try:
        return plugin(MODEL_SOURCES, "hf")
    except (LookupError, ImportError) as err:
        raise ValueError(f"{name}={str(path)!r} is a Hugging Face directory; reading it needs {err}") from err


def source_config(path: "str | os.PathLike", *, name: str = "path") -> TransformerConfig:
    """The config of the model stored at ``path``: a jaxckpt checkpoint directory (its
    ``jaxckpt.json``) or a Hugging Face directory (its ``config.json``).

    Args:
        path: the directory.
        name: the argument name errors give ``path`` under: a caller that took it as,
            say, ``init_from`` passes ``name="init_from"`` (as ``initial_model`` does).

    Raises:
        FileNotFoundError: when ``path`` does not exist.
        ValueError: when it holds neither.

    Example:
        >>> import tempfile
        >>> from jaxckpt import nn, train
        >>> cfg = nn.TransformerConfig.preset("tiny", n_layers=1, d_model=32, n_heads=2, ffn_dim=48)
        >>> d = tempfile.mkdtemp()
        >>> run = train.RunConfig(steps=1, batch=2, seq=16, checkpoint={"dir": d}, progress=False)
        >>> _ = train.train(cfg, run)
        >>> train.source_config(d) == cfg
        True
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{name}={str(path)!r} does not exist")
    if is_hf_dir(path):
        try:
            return _hf_reader(path, name).config(path)
        except ValueError as err:
            raise ValueError(f"{name}={str(path)!r} (a Hugging Face directory): {err}") from err
    meta = read_meta(path)
    if "config" not in meta:
        raise ValueError(
            f"{name}={str(path)!r} has no {META} with a config: give a jaxckpt checkpoint directory "
            "(saved by training, or written by jaxckpt convert) or a Hugging Face directory"
        )
    return TransformerConfig.from_dict(meta["config"])


def source_hf_fields(path: "str | os.PathLike | None") -> dict:
    """The Hugging Face fields (token ids and names, generation defaults) that a model's
    ``config.json`` carries beyond its config, kept so an export writes them back: read
    from a Hugging Face directory, or from a jaxckpt directory's ``jaxckpt.json``.

    Example:
        >>> source_hf_fields(None)
        {}
    """
    if path is None:
        return {}
    path = Path(path)
    if is_hf_dir(path):
        return _hf_reader(path, "init_from").hf_fields(path)
    return read_meta(path).get("hf_fields") or {}


def _check_compatible(source: TransformerConfig, config: TransformerConfig, path: Path) -> None:
    ours, theirs = config.to_dict(), source.to_dict()
    # Adapters, or a quantized store, may be put on a source that has none.
    free = FREE_ON_INIT | {name for name in ("lora", "quantize_base") if getattr(source, name) is None}
    keys = [k for k in ours if k not in free and ours[k] != theirs.get(k)]
    differ = [f"{k}: {theirs.get(k)!r} there, {ours[k]!r} here" for k in keys]
    if differ:
        raise ValueError(
            f"init_from={str(path)!r} holds a different model ({'; '.join(differ)}); use the model "
            f"it holds, or one that differs from it only in {', '.join(sorted(FREE_ON_INIT))}"
        )


def _stored_as(params: dict, config: TransformerConfig) -> dict:
    """``params`` cast to ``config``'s storage dtypes: the adapters' own, the base's."""
    adapter = config.lora and jnp.dtype(config.lora.dtype)

    def cast(path, a):
        is_adapter = any(getattr(k, "key", None) == "lora" for k in path)
        return a.astype(adapter if is_adapter else config.storage_dtype)

    return jax.tree_util.tree_map_with_path(cast, params)


def check_init_from(config: TransformerConfig, init_from: "str | os.PathLike") -> None:
    """Raises what ``initial_model`` would about ``init_from`` (a missing or unreadable
    directory, or a model other than ``config``) without loading any weight.

    Example:
        >>> check_init_from(TransformerConfig.preset("tiny"), "no/such/dir")
        Traceback (most recent call last):
        ...
        FileNotFoundError: init_from='no/such/dir' does not exist
    """
    path = Path(init_from)
    _check_compatible(source_config(path, name="init_from"), config, path)


def initial_model(
    config: TransformerConfig,
    seed: int,
    init_from: "str | os.PathLike | None",
    optimizer=None,
    *,
    attention: "str | None" = None,
) -> Transformer:
    """The model a run starts from: random (``seed``) or the parameters at ``init_from``.

    A trained checkpoint gives its model's parameters (its optimizer state is not
    used); a converted one (``jaxckpt convert``) or a Hugging Face directory gives its
    parameters, cast to ``config.param_dtype``. No random initialisation is done then,
    but for LoRA adapters (``config.lora``) put on a base that has none: those start
    from ``seed``.
    A trained checkpoint's state is read with the optimizer it was trained with (its
    ``jaxckpt.json``); ``optimizer`` (an ``OptimizerConfig``) stands in for one that
    recorded none. Every layer attends with ``attention`` (``Transformer.set_attention``).

    Raises:
        ValueError: when the stored model differs from ``config`` in anything but its
            dtypes (each difference is named), or a parameter it holds
            has a NaN or an Inf (``require_finite``: the directory and the tensor are named;
            a Hugging Face directory's tensors are checked as torch_bridge reads them).

    Example:
        >>> from jaxckpt import nn, train
        >>> cfg = nn.TransformerConfig.preset("tiny", n_layers=1)
        >>> train.initial_model(cfg, seed=0, init_from=None).config == cfg
        True
    """
    model = _initial_model(config, seed, init_from, optimizer)
    model.set_attention(attention)
    return model


def _initial_model(config: TransformerConfig, seed: int, init_from, optimizer) -> Transformer:
    if init_from is None:
        return Transformer(config, rngs=nnx.Rngs(seed))
    path = Path(init_from)
    source = source_config(path, name="init_from")
    _check_compatible(source, config, path)
    if (config.lora, config.quantize_base) != (source.lora, source.quantize_base):
        # Adapters (initialised from seed) or a quantized store put on the source's parameters.
        base = initial_model(config.replace(lora=source.lora, quantize_base=None), seed, path, optimizer)
        params = nnx.to_pure_dict(nnx.state(base, nnx.Param))
        return from_params(Transformer, config, _stored_as(params, config), seed=seed)
    if is_hf_dir(path):
        params = _hf_reader(path, "init_from").params(path, config)
    elif read_meta(path).get("kind") == PARAMS_KIND:
        abstract = nnx.state(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))), nnx.Param)
        params = nnx.to_pure_dict(restore_checkpoint(path, abstract)[1])
        require_finite(params, str(path))
    else:
        # The checkpoint's own optimizer shapes its state (older ones saved none: the run's).
        saved = read_meta(path).get("optimizer")
        optimizer = optimizer if saved is None else OptimizerConfig.from_dict({**saved, "offload": False})
        trainer = Trainer(Transformer(config, rngs=nnx.Rngs(seed)), optimizer=optimizer)
        _, state = restore_checkpoint(path, trainer.state)
        model = nnx.merge(trainer.graphdef, state)[0]
        require_finite(nnx.to_pure_dict(nnx.state(model, nnx.Param)), str(path))  # not the optimizer's
        return model
    return from_params(Transformer, config, params)
