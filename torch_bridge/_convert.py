"""``convert_state_dict`` (torch -> jaxckpt) and ``export_state_dict`` (back), one tensor
at a time, with a ``ConversionReport`` of everything that did not map cleanly."""

import dataclasses
import functools
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from jaxckpt._checks import require_finite
from jaxckpt.nn import Block, Transformer, TransformerConfig
from torch_bridge._archs import Architecture, architecture
from torch_bridge._table import Rule
from torch_bridge.interop import numpy_dtype, tensor_to_numpy

LIST_AT_MOST = 8  # entries of each kind an error message lists

KEPT_DTYPES = frozenset(np.dtype(d) for d in (np.float32, ml_dtypes.bfloat16, np.float16))
"""The float dtypes a parameter keeps when no dtype is asked for (``keep_dtypes=True``): the
modules cast each parameter to the compute dtype at use, so fp32 norm scales next to bf16
kernels run. Any other dtype (float64, integers, float8) is cast to ``config.param_dtype``."""


@dataclasses.dataclass
class ConversionReport:
    """What a conversion found besides the tensors it converted.

    Attributes:
        converted: torch tensors converted.
        missing: keys the model needs that the checkpoint lacks.
        unexpected: keys the checkpoint has that no rule reads and none ignores.
        mismatched: ``(key, expected shape, found shape)``.
        files: the weight file of each mismatched tensor, when the checkpoint is sharded
            (a ``TensorSource`` over several files).
        dtype_changes: ``(key, from dtype, to dtype)``: every tensor that was cast.
        ignored: keys known to hold no parameter (buffers, a tied head saved twice).
        notes: config fields not carried over, e.g. dropout.
        unknown_fields: config fields in no known class (``name=value``): ignored, and
            warned about once (``strict=True`` refuses them instead).
        verified_max_abs_diff: with ``verify=True``, the largest absolute difference
            between the converted model's fp32 logits and transformers'; None: not verified.
        verify_tolerance: the tolerance that difference was held to.

    Example:
        >>> from torch_bridge import ConversionReport
        >>> ConversionReport(converted=3, missing=["lm_head.weight"]).problems()
        ['1 missing tensor(s): lm_head.weight']
        >>> ConversionReport(converted=3, missing=["lm_head.weight"]).problems(allow_missing=True)
        []
    """

    converted: int = 0
    missing: list[str] = dataclasses.field(default_factory=list)
    unexpected: list[str] = dataclasses.field(default_factory=list)
    mismatched: list[tuple[str, tuple, tuple]] = dataclasses.field(default_factory=list)
    files: dict[str, str] = dataclasses.field(default_factory=dict)
    dtype_changes: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)
    ignored: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    unknown_fields: list[str] = dataclasses.field(default_factory=list)
    verified_max_abs_diff: float | None = None
    verify_tolerance: float | None = None

    def problems(self, allow_missing: bool = False) -> list[str]:
        """One line per kind of problem; empty when the conversion is clean."""
        out = []
        for name, items in (("unexpected", self.unexpected), ("missing", self.missing)):
            if items and not (name == "missing" and allow_missing):
                out.append(f"{len(items)} {name} tensor(s): {listing(items)}")
        if self.mismatched:
            where = {k: f" in {Path(f).name}" for k, f in self.files.items()}
            shapes = [
                f"{k} expected {tuple(e)} found {tuple(f)}" + where.get(k, "") for k, e, f in self.mismatched
            ]
            out.append(f"{len(shapes)} shape mismatch(es): {listing(shapes)}")
        return out

    def check(self, allow_missing: bool = False, source: str = "state_dict") -> None:
        """Raises a ValueError naming the problem tensors (strict unless ``allow_missing``)."""
        problems = self.problems(allow_missing)
        if problems:
            hint = " (pass allow_missing=True to keep missing parameters at zero)" if self.missing else ""
            raise ValueError(f"{source}: cannot convert: " + "; ".join(problems) + hint)

    def to_dict(self) -> dict:
        """The report as JSON-friendly values."""
        return dataclasses.asdict(self)


def listing(items: list[str]) -> str:
    """``items`` joined by commas, at most ``LIST_AT_MOST`` of them and how many more."""
    more = f", ... ({len(items) - LIST_AT_MOST} more)" if len(items) > LIST_AT_MOST else ""
    return ", ".join(items[:LIST_AT_MOST]) + more


def model_class(arch: Architecture) -> type:
    """``nn.Block`` for the seed block, else ``nn.Transformer``."""
    return Block if arch.block else Transformer


def target_shapes(arch: Architecture, config: TransformerConfig) -> dict[str, jax.ShapeDtypeStruct]:
    """Dotted parameter path -> abstract array of the model ``config`` describes (no
    parameter is allocated).

    Example:
        >>> from jaxckpt import nn
        >>> import torch_bridge
        >>> cfg = nn.TransformerConfig.preset("tiny", n_layers=2)
        >>> shapes = torch_bridge.target_shapes(torch_bridge.architecture("llama"), cfg)
        >>> shapes["embed.embedding"].shape
        (256, 128)
    """
    return dict(_target_shapes(arch, config))


@functools.lru_cache(maxsize=16)
def _target_shapes(arch: Architecture, config: TransformerConfig) -> tuple:
    """``target_shapes``'s items, traced once per (arch, config): a conversion asks for them
    at each of its steps (read, check, save), and tracing the model is most of a small one."""
    cls = model_class(arch)
    model = nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0)))
    return tuple(flatten(nnx.to_pure_dict(nnx.state(model, nnx.Param))).items())


def flatten(tree: Mapping) -> dict:
    """A nested dict as ``{"a.b.c": leaf}``."""
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return {".".join(str(getattr(k, "key", k)) for k in path): leaf for path, leaf in leaves}


def unflatten(flat: Mapping[str, object]) -> dict:
    """``{"a.b": x}`` -> ``{"a": {"b": x}}`` (the inverse of ``flatten``)."""
    out: dict = {}
    for path, leaf in flat.items():
        *parents, last = path.split(".")
        node = out
        for name in parents:
            node = node.setdefault(name, {})
        node[last] = leaf
    return out


ALIGNMENT = 64
"""Bytes: ``jax.device_put`` on CPU wraps a numpy buffer this aligned without copying it."""


def zeros_aligned(shape: tuple[int, ...], dtype) -> np.ndarray:
    """``np.zeros`` whose data starts on a ``ALIGNMENT``-byte boundary, so that moving it
    into JAX on CPU is zero-copy (the model is never held twice).

    Example:
        >>> zeros_aligned((3, 5), np.float32).ctypes.data % ALIGNMENT
        0
    """
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.zeros(nbytes + ALIGNMENT, np.uint8)
    offset = -raw.ctypes.data % ALIGNMENT
    return raw[offset : offset + nbytes].view(dtype).reshape(shape)


def as_numpy(value) -> np.ndarray:
    """A numpy view of a torch tensor (bf16 through an int16 view), or ``np.asarray``."""
    if hasattr(value, "detach"):  # a torch tensor, without importing torch here
        return tensor_to_numpy(value)
    return np.asarray(value)


def _shape(state_dict: Mapping, key: str) -> tuple[int, ...]:
    shape = getattr(state_dict, "shape", None)
    return tuple(shape(key)) if callable(shape) else tuple(np.shape(state_dict[key]))


def _dtype(state_dict: Mapping, key: str) -> np.dtype:
    """The numpy dtype of tensor ``key``: from the header of a ``TensorSource``, else the value's."""
    dtype = getattr(state_dict, "dtype", None)
    if callable(dtype):
        return np.dtype(dtype(key))
    value = state_dict[key]
    found = numpy_dtype(value.dtype) if hasattr(value, "detach") else None
    return found if found is not None else as_numpy(value).dtype


def common_dtype(dtypes: Iterable) -> np.dtype:
    """The dtype that holds every one of ``dtypes`` exactly (JAX's standard promotion:
    bf16 with fp16 is fp32).

    Example:
        >>> str(common_dtype([ml_dtypes.bfloat16, np.float16])), str(common_dtype([np.float16]))
        ('float32', 'float16')
    """
    with jax.numpy_dtype_promotion("standard"):
        return np.dtype(functools.reduce(jnp.promote_types, sorted(set(map(np.dtype, dtypes)), key=str)))


def _source_name(state_dict: Mapping) -> str:
    """How errors name a checkpoint: its one file, or the directory of its shards."""
    files = getattr(state_dict, "files", ())
    if not files:
        return "state_dict"
    return str(files[0]) if len(files) == 1 else str(Path(files[0]).parent)


def _kept_dtypes(state_dict: Mapping, wanted: Mapping[str, str], plan: Mapping, shapes: Mapping) -> dict:
    """Parameter path -> the dtype it is stored in when tensors keep their dtypes: each
    tensor's own if in ``KEPT_DTYPES``, else the config's; the common dtype when the tensors
    of one parameter (the layers of a stack) differ."""
    found: dict[str, set] = {}
    for key, full in wanted.items():
        rule, _ = plan[full]
        dtype = _dtype(state_dict, key)
        for path in rule.jax:
            own = dtype if dtype in KEPT_DTYPES else np.dtype(shapes[path].dtype)
            found.setdefault(path, set()).add(own)
    return {path: common_dtype(dtypes) for path, dtypes in found.items()}


def convert_state_dict(
    state_dict: Mapping,
    arch: "str | Architecture",
    config: TransformerConfig,
    *,
    allow_missing: bool = False,
    keep_dtypes: bool = False,
    on_tensor: Callable[[str, int], None] | None = None,
) -> tuple[dict, ConversionReport]:
    """Converts a torch state_dict to jaxckpt parameters, one tensor at a time.

    Shapes are checked first (from headers, for a ``TensorSource``), so a mismatch
    fails before any data is read. Each tensor is then read once and written into its
    place in the stacked parameters, cast to ``config.param_dtype`` (bf16 stays bf16
    when the config says bf16) or, with ``keep_dtypes``, in its own dtype when that is
    one of ``KEPT_DTYPES`` (fp32 norms stay fp32 beside bf16 matrices). Every cast is
    listed in the report's ``dtype_changes``.

    Args:
        state_dict: key -> torch tensor or numpy array; or a streaming ``TensorSource``.
        arch: ``"llama"``, ``"gpt2"``, ``"seed-block"`` or an ``Architecture``.
        config: the model's config (see ``config_from_hf``).
        allow_missing: keep missing parameters at zero instead of raising.
        keep_dtypes: keep each fp32/bf16/fp16 tensor's dtype; cast the others (float64,
            integers, float8) to ``config.param_dtype``. A stacked parameter whose layers'
            tensors differ in dtype takes their common dtype (``common_dtype``).
        on_tensor: called as ``on_tensor(key, nbytes)`` after each tensor (progress bars).

    Returns:
        ``(params, report)``: params as the nested dict of numpy arrays that
        ``nnx.replace_by_pure_dict`` takes for the model's ``nnx.Param`` state.

    Raises:
        ValueError: naming the checkpoint (its file, or the directory of its shards), and
            the unexpected, missing (unless allowed) and mismatched tensors (with both
            shapes, and the shard file of each in a sharded checkpoint); or naming the file
            and the first tensor that holds a NaN or an Inf (``require_finite``, checked as
            each tensor is read: a corrupt checkpoint is refused, never converted).

    Example:
        >>> import numpy as np
        >>> from torch_bridge import convert_state_dict, seed_block_config
        >>> cfg = seed_block_config(4, 2)
        >>> sd = {"ln1.weight": np.ones(4, np.float16), "ln1.bias": np.zeros(4)}
        >>> params, report = convert_state_dict(sd, "seed-block", cfg, allow_missing=True, keep_dtypes=True)
        >>> params["attn_norm"]["scale"].tolist(), len(report.missing)
        ([1.0, 1.0, 1.0, 1.0], 14)
        >>> params["attn_norm"]["scale"].dtype, report.dtype_changes
        (dtype('float16'), [('ln1.bias', 'float64', 'float32')])
    """
    arch = architecture(arch) if isinstance(arch, str) else arch
    shapes = target_shapes(arch, config)
    plan = arch.table.bind({p: s.shape for p, s in shapes.items()}, config.n_layers)
    report = ConversionReport()
    wanted: dict[str, str] = {}  # checkpoint key -> table key
    file_of = getattr(state_dict, "file_of", None) if len(getattr(state_dict, "files", ())) > 1 else None
    for key in state_dict.keys():  # noqa: SIM118  (a TensorSource is not a dict)
        full = arch.table.resolve(key, plan)
        if full in plan:
            rule, _ = plan[full]
            expected = rule.torch_shape({p: shapes[p].shape for p in rule.jax})
            found = _shape(state_dict, key)
            if found != expected:
                report.mismatched.append((key, expected, found))
                if file_of is not None:
                    report.files[key] = str(file_of(key))
            wanted[key] = full
        elif any(re.fullmatch(pattern, key) for pattern in arch.table.ignore):
            report.ignored.append(key)
        else:
            report.unexpected.append(key)
    report.missing = [key for key in plan if key not in set(wanted.values())]
    report.check(allow_missing, source=_source_name(state_dict))
    kept = _kept_dtypes(state_dict, wanted, plan, shapes) if keep_dtypes else {}
    params = {path: zeros_aligned(s.shape, kept.get(path, s.dtype)) for path, s in shapes.items()}
    for key, value in state_dict.items():
        if key not in wanted:
            continue
        array = as_numpy(value)
        require_finite({key: array}, str(file_of(key)) if file_of is not None else _source_name(state_dict))
        rule, layer = plan[wanted[key]]
        target = params[rule.jax[0]].dtype
        if array.dtype != target:
            report.dtype_changes.append((key, str(array.dtype), str(target)))
        rule.to_jax(array, params, layer)
        report.converted += 1
        if on_tensor is not None:
            on_tensor(key, array.nbytes)
        del array, value  # one tensor in memory at a time
    return unflatten(params), report


def export_order(
    arch: "str | Architecture", config: TransformerConfig, shapes: dict | None = None
) -> list[tuple[str, Rule, int | None]]:
    """``(torch key, rule, layer)`` of every tensor ``export_state_dict`` writes, in Hugging
    Face order: the embeddings, then layer by layer, then the final norm and head.
    ``shapes`` is ``target_shapes(arch, config)`` when the caller already has it. Nothing is
    allocated: with ``Rule.torch_shape`` it sizes a checkpoint before writing it.

    Example:
        >>> from jaxckpt import nn
        >>> import torch_bridge
        >>> order = torch_bridge.export_order("llama", nn.TransformerConfig.preset("tiny", n_layers=2))
        >>> [key for key, _, _ in order][:2]
        ['model.embed_tokens.weight', 'model.layers.0.input_layernorm.weight']
    """
    arch = architecture(arch) if isinstance(arch, str) else arch
    shapes = target_shapes(arch, config) if shapes is None else shapes
    plan = arch.table.bind({p: s.shape for p, s in shapes.items()}, config.n_layers)
    first_layered = next((i for i, r in enumerate(arch.table.rules) if r.per_layer), 0)

    def position(item):
        _, (rule, layer) = item
        index = arch.table.rules.index(rule)
        phase = 1 if rule.per_layer else (0 if index < first_layered else 2)
        return (phase, layer or 0, index)

    return [(key, rule, layer) for key, (rule, layer) in sorted(plan.items(), key=position)]


def export_state_dict(
    params: "Mapping | nnx.State", arch: "str | Architecture", config: TransformerConfig
) -> Iterator[tuple[str, np.ndarray]]:
    """The torch state_dict of jaxckpt ``params``, one ``(key, array)`` at a time.

    The inverse of ``convert_state_dict``: the same rules read backward, so a round
    trip is bit-identical. Arrays keep the parameters' dtype.

    Args:
        params: the model's ``nnx.Param`` state, or its pure dict.

    Example:
        >>> from flax import nnx
        >>> from jaxckpt.nn import Block
        >>> from torch_bridge import export_state_dict, seed_block_config
        >>> cfg = seed_block_config(4, 2)
        >>> params = nnx.state(Block(cfg, rngs=nnx.Rngs(0)), nnx.Param)
        >>> [(k, a.shape) for k, a in export_state_dict(params, "seed-block", cfg)][2]
        ('q_proj.weight', (4, 4))
    """
    if isinstance(params, nnx.State):
        params = nnx.to_pure_dict(params)
    flat = {path: np.asarray(leaf) for path, leaf in flatten(params).items()}
    for key, rule, layer in export_order(arch, config):
        yield key, rule.to_torch(flat, layer)
