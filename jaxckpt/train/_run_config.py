"""``RunConfig``: one frozen value that describes a training run, beside the model's
``TransformerConfig``.

``train(model_config, run)`` trains it, ``jaxckpt.plan.Workload.from_run(model_config, run)``
plans it, and ``jaxckpt train --config run.yaml`` reads it from a file. Its parts are
``DataConfig`` (what it reads), ``OptimizerConfig`` (how it updates), ``CheckpointConfig``
(where it saves) and the memory choices (``remat``, ``attention``, ``budget``, ``mlp_chunk``,
``compress``), which live here and not in the model's config: they change memory and time,
and the loss never (``compress`` stores the kept activations int8 / fp8: the forward pass is
exact, the gradients change slightly). (The MLP reads its tiling from the model's config:
``RunConfig.model_config`` puts the run's ``mlp_chunk`` there; the trained remat spec is
``RunConfig.remat_spec``, with the run's compression.)

Every check runs once, when the value is built, and names the field (``batch=0 must be a
positive int``, ``checkpoint.every=0 ...``); checks that need the model or the devices
(``seq`` against ``max_len``, the batch against the mesh) run when ``train`` starts.
"""

import dataclasses
import os
from collections.abc import Mapping

from jaxckpt._checks import known_fields, require_positive_int
from jaxckpt._sizes import parse_size
from jaxckpt.attention import check_strategy
from jaxckpt.data import DEFAULT_SHUFFLE_BUFFER, check_fraction
from jaxckpt.remat import AUTO, FORMATS, Layered, RematSpec, Tag, compressed
from jaxckpt.remat import get as get_remat
from jaxckpt.train._nonfinite import check_on_nonfinite, optimizer_for
from jaxckpt.train._optimizers import OptimizerConfig

PathLike = "str | os.PathLike | None"


def _text(value):
    """A path as the string a file records (``None`` stays ``None``)."""
    return os.fspath(value) if isinstance(value, os.PathLike) else value


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    """What a run reads: its training data, tokenizer and held-out data.

    Attributes:
        path: a data file or directory (``.txt``, ``.jsonl``, ``.json``, ``.parquet``); None:
            the built-in corpus. Records are ``{"text"}``, ``{"messages"}`` (loss on the
            assistant's turns) or ``{"prompt", "completion"}`` (loss on the completion).
        tokenizer: ``"bytes"``, or a directory holding ``tokenizer.json`` (or that file);
            None: ``init_from``'s own tokenizer, or bytes without ``init_from``.
        text_per_line: ``.txt`` data holds one document per non-empty line.
        eval_path: held-out data in a separate file.
        eval_split: or the fraction in (0, 1) of ``path``'s records (of its bytes, for
            byte windows) held out of training.
        eval_every: evaluate after every ``eval_every`` steps, and after the last (with
            held-out data and no ``eval_every``: after the last only).
        shuffle_buffer: records per shuffle window of a packed stream.

    Raises:
        ValueError: for both ``eval_path`` and ``eval_split``, a split outside (0, 1), or
            ``eval_every`` without held-out data (naming the field).

    Example:
        >>> DataConfig(eval_split=0.1).holds_out
        True
        >>> DataConfig(eval_every=2)
        Traceback (most recent call last):
        ...
        ValueError: data.eval_every=2 needs held-out data: give data.eval_path= or data.eval_split=
    """

    path: PathLike = None
    tokenizer: PathLike = None
    text_per_line: bool = False
    eval_path: PathLike = None
    eval_split: "float | None" = None
    eval_every: "int | None" = None
    shuffle_buffer: int = DEFAULT_SHUFFLE_BUFFER

    def __post_init__(self):
        if self.eval_path is not None and self.eval_split is not None:
            raise ValueError("data.eval_path= and data.eval_split= are two ways to hold data out: give one")
        check_fraction("RunConfig", "data.eval_split", self.eval_split)
        if self.eval_every is not None:
            require_positive_int("data.eval_every", self.eval_every)
            if not self.holds_out:
                raise ValueError(
                    f"data.eval_every={self.eval_every} needs held-out data: give data.eval_path= or "
                    "data.eval_split="
                )
        require_positive_int("data.shuffle_buffer", self.shuffle_buffer)

    @property
    def holds_out(self) -> bool:
        """Whether the run evaluates on held-out data."""
        return self.eval_path is not None or self.eval_split is not None

    def record(self) -> dict:
        """How ``jaxckpt.json`` records the data (the keys a resumed run is compared on)."""
        return {
            "data": _text(self.path),
            "text_per_line": self.text_per_line,
            "eval_data": _text(self.eval_path),
            "eval_split": self.eval_split,
            "shuffle_buffer": self.shuffle_buffer,
        }

    def to_dict(self) -> dict:
        """The fields, JSON-ready (paths as strings)."""
        return {f.name: _text(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, fields: Mapping) -> "DataConfig":
        """The value ``to_dict`` wrote; a ValueError names any unknown field."""
        return cls(**known_fields(cls, fields, "RunConfig.data"))


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Where and when a run saves, and what it does with checkpoints already there.

    Attributes:
        dir: where to save (at the end, and every ``every`` steps); None: no checkpoints.
        every: save after every ``every`` steps too.
        resume: continue from the latest checkpoint in ``dir``.
        force: replace existing checkpoints in ``dir``.

    Example:
        >>> CheckpointConfig(resume=True)
        Traceback (most recent call last):
        ...
        ValueError: checkpoint.resume=True needs checkpoint.dir=
    """

    dir: PathLike = None
    every: "int | None" = None
    resume: bool = False
    force: bool = False

    def __post_init__(self):
        if self.every is not None:
            require_positive_int("checkpoint.every", self.every)
        if self.resume and self.dir is None:
            raise ValueError("checkpoint.resume=True needs checkpoint.dir=")

    def to_dict(self) -> dict:
        """The fields, JSON-ready (the directory as a string)."""
        return {f.name: _text(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, fields: Mapping) -> "CheckpointConfig":
        """The value ``to_dict`` wrote; a ValueError names any unknown field."""
        return cls(**known_fields(cls, fields, "RunConfig.checkpoint"))


def _spec_to_dict(spec: RematSpec) -> dict:
    """A ``RematSpec`` as plain values: its tags by name, its compressed tags as a
    ``{tag: format}`` dict (``_spec_from_dict`` reads it back)."""
    out = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
    for name in ("save", "offload"):
        out[name] = sorted(tag.value for tag in getattr(spec, name))
    out["compress"] = {tag.value: fmt for tag, fmt in spec.compress.items()}
    return out


def _spec_from_dict(fields: Mapping) -> RematSpec:
    """The ``RematSpec`` that ``_spec_to_dict`` wrote; a ValueError names a bad field or tag."""
    fields = known_fields(RematSpec, fields, "RunConfig.remat")
    try:
        tags = {name: frozenset(Tag(v) for v in fields.get(name, ())) for name in ("save", "offload")}
        formats = {Tag(tag): fmt for tag, fmt in dict(fields.get("compress") or {}).items()}
    except ValueError as err:
        raise ValueError(f"RunConfig.remat: {err}; valid tags: {[t.value for t in Tag]}") from err
    return RematSpec(**{**fields, **tags, "compress": formats})


def _layered_to_dict(spec: Layered) -> dict:
    """A ``remat.Layered`` spec as ``{"groups": [{"layers": count, **spec}, ...]}`` in stack
    order (``_layered_from_dict`` reads it back)."""
    return {"groups": [{"layers": count, **_spec_to_dict(group)} for count, group in spec.groups]}


def _layered_from_dict(fields: Mapping) -> Layered:
    """The ``remat.Layered`` that ``_layered_to_dict`` wrote; a ValueError names a bad group."""
    extra = sorted(set(fields) - {"groups"})
    if extra:
        raise ValueError(f"RunConfig.remat: a per-layer spec has only 'groups'; unknown: {', '.join(extra)}")
    groups = fields["groups"]
    if isinstance(groups, str | Mapping) or not isinstance(groups, list | tuple):
        raise ValueError(f"RunConfig.remat.groups must be a list of {{layers, ...}} dicts, got {groups!r}")
    out = []
    for i, group in enumerate(groups):
        if not isinstance(group, Mapping) or "layers" not in group:
            raise ValueError(f"RunConfig.remat.groups[{i}] must be a dict with 'layers', got {group!r}")
        rest = {k: v for k, v in group.items() if k != "layers"}
        out.append((group["layers"], _spec_from_dict(rest)))
    try:
        return Layered(tuple(out))
    except (TypeError, ValueError) as err:
        raise ValueError(f"RunConfig.remat: {err}") from None


def _compress_tags(value) -> "tuple[str, ...] | None":
    """``compress_tags`` as a sorted tuple of tag names: given as tags, names, or one
    comma-separated string (``"mlp_up,mlp_gate"``, as ``--compress-tags`` writes it)."""
    if value is None:
        return None
    names = value.split(",") if isinstance(value, str) else list(value)
    names = [str(name).strip() for name in names if str(name).strip()]
    unknown = [name for name in names if name not in Tag._value2member_map_]
    if unknown or not names:
        raise ValueError(
            f"compress_tags={value!r} must name tags of {', '.join(t.value for t in Tag)}"
            + (f"; unknown: {', '.join(unknown)}" if unknown else "")
        )
    return tuple(sorted(set(names)))


_PARTS = {"data": DataConfig, "checkpoint": CheckpointConfig, "optimizer": OptimizerConfig}
"""The nested parts of a ``RunConfig``: given as the object or as its dict."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    """One training run: its sizes, data, optimizer, checkpoints, mesh and memory choices.

    The model is the other value (``nn.TransformerConfig``): ``train(model_config, run)``.

    Attributes:
        steps: total number of steps; a resumed run continues up to it.
        batch, seq, micro_batches: each step sees ``micro_batches x batch`` windows of
            ``seq`` tokens (``batch`` is global, over every device).
        seed: parameter init and data order.
        data: a ``DataConfig`` (or its dict).
        optimizer: an ``OptimizerConfig`` (or its dict): AdamW by default.
        checkpoint: a ``CheckpointConfig`` (or its dict).
        init_from: take the parameters from a jaxckpt checkpoint directory (trained, or
            converted by ``jaxckpt convert``) or a Hugging Face directory.
        mesh: data parallel + FSDP (+ context parallelism): a ``jax.sharding.Mesh``, or axis
            sizes such as ``{"data": 2, "fsdp": 4}`` / ``"data=2,fsdp=4"`` /
            ``"fsdp=2,seq=4"`` (``seq``: every activation split along the sequence); None: one
            device (in a multi-process run: ``data`` = the processes, ``fsdp`` = each one's devices).
        context_parallel: on a mesh with a ``seq`` axis, how the attention spans the shards:
            ``"all_gather"`` (K/V gathered) or ``"ring"`` (K/V passed around the ring);
            ``jaxckpt.attention.CONTEXT_PARALLEL_STRATEGIES``.
        on_nonfinite: ``"stop"`` (raise ``NonFiniteError`` at the first non-finite loss)
            or ``"skip"`` (skip such steps and count them).
        remat: a ``jaxckpt.remat`` preset name, ``RematSpec`` or ``remat.Layered`` (one spec
            per group of layers: ``to_dict`` writes its ``groups``), or ``"auto"``: the
            planner (``jaxckpt.plan.resolve_auto``) picks the spec of least recompute that
            fits ``budget`` before training.
        attention: the ``flash_attention`` implementation (None: automatic).
        budget: device memory for ``remat="auto"``: bytes, or text such as ``"30GiB"``.
        mlp_chunk: tile the MLP over chunks of this many tokens
            (``nn.TransformerConfig.mlp_chunk``) in the model ``model_config(config)``, which
            ``jaxckpt train`` builds and ``plan.Workload.from_run`` plans; None: the model
            config's own choice.
        compress: ``"int8"`` or ``"fp8"``: store what the remat spec keeps compressed
            (``remat.compressed(spec, compress)``; ``remat_spec`` is the spec trained). The
            forward pass is exact; the gradients change slightly. Under ``remat="auto"`` the
            planner plans with it and the resolved spec carries it. None: no compression.
        compress_tags: with ``compress``, compress only these tags (names, or a
            comma-separated string), each one the spec keeps.
        progress: draw a progress bar.

    Raises:
        ValueError: naming the field, for a size that is not a positive int, an unknown
            remat spec or ``on_nonfinite``, ``remat="auto"`` without a budget, a bad part, an
            unknown ``compress`` format, ``compress_tags`` without ``compress``, or a
            compressed tag the spec does not keep (or a spec that keeps nothing, ``none``).

    Example:
        >>> from jaxckpt import train
        >>> run = train.RunConfig(steps=100, batch=8, seq=512, checkpoint={"dir": "ckpt", "every": 50})
        >>> run.checkpoint.every, run.optimizer.name, run.remat
        (50, 'adamw', 'full')
        >>> train.RunConfig.from_dict(run.to_dict()) == run
        True
        >>> train.RunConfig(steps=1, batch=0, seq=8)
        Traceback (most recent call last):
        ...
        ValueError: batch=0 must be a positive int
    """

    steps: int
    batch: int
    seq: int
    micro_batches: int = 1
    seed: int = 0
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    init_from: PathLike = None
    mesh: object = None
    context_parallel: str = "all_gather"
    on_nonfinite: str = "stop"
    remat: "str | RematSpec | Layered" = "full"
    attention: "str | None" = None
    budget: "int | str | None" = None
    mlp_chunk: "int | None" = None
    compress: "str | None" = None
    compress_tags: "tuple[str, ...] | str | None" = None
    progress: bool = True

    def __post_init__(self):
        for name in ("steps", "batch", "seq", "micro_batches"):
            require_positive_int(name, getattr(self, name))
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed={self.seed!r} must be an int")
        for name, cls in _PARTS.items():
            value = getattr(self, name)
            if isinstance(value, Mapping):
                object.__setattr__(self, name, cls(**known_fields(cls, value, f"RunConfig.{name}")))
            elif not isinstance(value, cls):
                raise TypeError(
                    f"RunConfig: {name} must be a {cls.__name__} or its dict, got {type(value).__name__}"
                )
        check_on_nonfinite(self.on_nonfinite)
        check_strategy(self.context_parallel, "context_parallel")
        if self.mlp_chunk is not None:
            require_positive_int("mlp_chunk", self.mlp_chunk)
        if self.budget is not None:
            object.__setattr__(self, "budget", parse_size(self.budget, "budget"))
        if self.remat == AUTO:
            if self.budget is None:
                raise ValueError("remat='auto' needs budget= (bytes, or e.g. '30GiB')")
        else:
            get_remat(self.remat)
        self._check_compress()

    def _check_compress(self) -> None:
        if self.compress is not None and self.compress not in FORMATS:
            raise ValueError(f"compress={self.compress!r} must be one of {', '.join(FORMATS)}")
        object.__setattr__(self, "compress_tags", _compress_tags(self.compress_tags))
        if self.compress_tags is not None and self.compress is None:
            raise ValueError(
                f"compress_tags={','.join(self.compress_tags)} needs compress= (the format: "
                f"{', '.join(FORMATS)})"
            )
        if self.compress is not None and self.remat != AUTO:
            _ = self.remat_spec  # the spec's own check, naming the field

    @property
    def remat_spec(self) -> "RematSpec | Layered":
        """The spec the run trains: ``remat`` as a ``RematSpec`` (after the planner has resolved
        ``"auto"``), with what it keeps compressed under ``compress`` (``remat.compressed``).

        Raises:
            ValueError: naming ``compress_tags=`` for a tag the spec does not keep or cannot
                compress, and ``compress=`` for a spec that keeps nothing (``none``).

        Example:
            >>> from jaxckpt import train
            >>> run = train.RunConfig(steps=1, batch=1, seq=8, remat="save_attn", compress="int8")
            >>> run.remat_spec.compress
            {'attn_out': 'int8', 'layer_input': 'int8'}
            >>> try:  # full keeps only the layer input
            ...     train.RunConfig(steps=1, batch=1, seq=8, compress="fp8", compress_tags="mlp_up")
            ... except ValueError as err:
            ...     print(str(err).split(";")[0])
            compress_tags=mlp_up: RematSpec.compress: tag 'mlp_up' is recomputed, not kept
        """
        spec = get_remat(self.remat)
        if self.compress is None:
            return spec
        if not spec.enabled:
            raise ValueError(
                f"compress={self.compress!r} compresses what the remat spec keeps, and remat='none' "
                "keeps everything at full precision (no remat): pick an enabled spec, e.g. remat='full'"
            )
        try:
            return compressed(spec, self.compress, self.compress_tags)
        except ValueError as err:
            kept = ", ".join(sorted(t.value for t in compressed(spec, self.compress).compress))
            raise ValueError(
                f"compress_tags={','.join(self.compress_tags or ())}: {err} (of the tags it can compress, "
                f"remat={self.remat!r} keeps {kept})"
            ) from None

    def model_config(self, config):
        """The model this run trains: ``config`` (an ``nn.TransformerConfig``) with the run's
        ``mlp_chunk`` when it sets one (a memory choice: the numbers stay the model's).

        Example:
            >>> from jaxckpt import nn, train
            >>> run = train.RunConfig(steps=1, batch=2, seq=4096, mlp_chunk=1024)
            >>> run.model_config(nn.TransformerConfig.preset("tiny")).mlp_chunk
            1024
        """
        return config if self.mlp_chunk is None else config.replace(mlp_chunk=self.mlp_chunk)

    @property
    def step_optimizer(self) -> OptimizerConfig:
        """The optimizer the train step runs: ``optimizer``, with the in-step skip of
        non-finite steps under ``on_nonfinite="skip"`` (whose select costs memory). ``train``
        trains it and ``plan.Workload.from_run`` plans it."""
        return optimizer_for(self.optimizer, self.on_nonfinite)

    def replace(self, **changes) -> "RunConfig":
        """A copy with ``changes`` applied (and checked). Nested parts take dicts of changes:
        ``run.replace(checkpoint={"resume": True})`` keeps the part's other fields."""
        for name in _PARTS:
            if isinstance(changes.get(name), Mapping):
                changes[name] = dataclasses.replace(getattr(self, name), **changes[name])
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """The fields as plain values, nested parts as dicts (``from_dict`` reads them back).

        A ``RematSpec`` is written as a dict (its tags by name), a ``remat.Layered`` as its
        ``groups`` (each such a dict with its ``layers``) and a ``jax.sharding.Mesh`` as its
        axis sizes.

        Example:
            >>> from jaxckpt import remat, train
            >>> spec = remat.Layered(((2, "save_attn"), (2, "full")))
            >>> run = train.RunConfig(steps=1, batch=1, seq=8, remat=spec)
            >>> [g["layers"] for g in run.to_dict()["remat"]["groups"]]
            [2, 2]
            >>> train.RunConfig.from_dict(run.to_dict()) == run
            True
        """
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name in _PARTS:
            out[name] = out[name].to_dict()
        if isinstance(self.remat, RematSpec):
            out["remat"] = _spec_to_dict(self.remat)
        elif isinstance(self.remat, Layered):
            out["remat"] = _layered_to_dict(self.remat)
        if self.mesh is not None and not isinstance(self.mesh, str | Mapping):
            out["mesh"] = dict(self.mesh.shape)
        out["init_from"] = _text(self.init_from)
        return out

    @classmethod
    def from_dict(cls, fields: Mapping) -> "RunConfig":
        """The run ``to_dict`` wrote (nested parts as dicts).

        Raises:
            ValueError: naming any field that ``RunConfig`` (or its part) does not have.
        """
        fields = known_fields(cls, fields, "RunConfig")
        remat = fields.get("remat")
        if isinstance(remat, Mapping):
            fields["remat"] = _layered_from_dict(remat) if "groups" in remat else _spec_from_dict(remat)
        return cls(**fields)
