"""Invertible conversion rules: one torch tensor <-> one or more jaxckpt parameters.

A ``Rule`` says where a torch tensor goes. Read forward (torch -> jax), the tensor is
transposed if the rule says so, split along its last axis into the rule's targets
(widths taken from the targets' shapes), and each part is written into its target, at
layer ``i`` of the stacked block parameters when the key holds ``{i}``. Read backward
(jax -> torch), the same rule gathers the parts, concatenates them and transposes back.
One table therefore serves both directions, and the round trip is bit-identical.
"""

import dataclasses
from collections.abc import Mapping

import numpy as np

LAYER = "{i}"
"""The placeholder of the layer index in a per-layer rule's torch key."""


@dataclasses.dataclass(frozen=True)
class Rule:
    """One torch tensor and the jaxckpt parameter(s) it holds.

    Attributes:
        torch: the state_dict key; ``{i}`` marks a per-layer tensor, whose targets have a
            leading layer axis (the scanned blocks).
        jax: the dotted parameter path(s) in the model's state; two or more split the
            tensor along its last axis (after the transpose), e.g. GPT-2's fused ``c_attn``.
        transpose: a ``torch.nn.Linear`` weight is ``[out, in]``; jaxckpt kernels are
            ``[in, out]``. (GPT-2's ``Conv1D`` is already ``[in, out]``.)

    Example:
        >>> rule = Rule("h.{i}.attn.c_attn.weight", ("attn.q.kernel", "attn.k.kernel", "attn.v.kernel"))
        >>> rule.key(3), rule.per_layer
        ('h.3.attn.c_attn.weight', True)
    """

    torch: str
    jax: tuple[str, ...] | str
    transpose: bool = False

    def __post_init__(self):
        if isinstance(self.jax, str):
            object.__setattr__(self, "jax", (self.jax,))

    @property
    def per_layer(self) -> bool:
        """Whether the key holds the layer placeholder ``{i}``."""
        return LAYER in self.torch

    def key(self, layer: int | None) -> str:
        """The torch key at ``layer`` (ignored for a rule that is not per layer)."""
        return self.torch.replace(LAYER, str(layer)) if self.per_layer else self.torch

    def torch_shape(self, targets: Mapping[str, tuple[int, ...]]) -> tuple[int, ...]:
        """The torch tensor's shape, from the shapes of the targets (``path -> shape``)."""
        shapes = [targets[path][1:] if self.per_layer else targets[path] for path in self.jax]
        shape = (*shapes[0][:-1], sum(s[-1] for s in shapes)) if shapes[0] else ()
        return shape[::-1] if self.transpose else shape

    def to_jax(self, tensor: np.ndarray, targets: Mapping[str, np.ndarray], layer: int | None) -> None:
        """Writes ``tensor`` into ``targets`` (casting to each target's dtype)."""
        if self.transpose:
            tensor = tensor.T
        start = 0
        for path in self.jax:
            target = targets[path][layer] if self.per_layer else targets[path]
            width = target.shape[-1] if target.ndim else 1
            target[...] = tensor[..., start : start + width] if len(self.jax) > 1 else tensor
            start += width

    def to_torch(self, params: Mapping[str, np.ndarray], layer: int | None) -> np.ndarray:
        """The torch tensor gathered from ``params`` (a contiguous array, built with one copy:
        fused parts are transposed into their place in the output, in their common dtype)."""
        parts = [params[path][layer] if self.per_layer else params[path] for path in self.jax]
        if len(parts) == 1:
            return np.ascontiguousarray(parts[0].T if self.transpose else parts[0])
        if not self.transpose:
            return np.ascontiguousarray(np.concatenate(parts, axis=-1))
        views = [p.T for p in parts]
        out = np.empty((sum(v.shape[0] for v in views), *views[0].shape[1:]), np.result_type(*parts))
        return np.concatenate(views, axis=0, out=out)


@dataclasses.dataclass(frozen=True)
class Table:
    """An architecture's rules, and the torch keys that carry nothing we need.

    Attributes:
        rules: the conversion rules. Rules whose targets the model does not have (a bias
            when the config has none, the head when it is tied) are left out by ``bind``.
        ignore: regular expressions (``re.fullmatch``) of keys that hold no parameter:
            buffers such as GPT-2's causal mask, or a tied head saved twice.
        optional_prefix: a prefix that some checkpoints leave out of the table's keys (GPT-2
            saved from ``GPT2Model`` lacks ``transformer.``). Written back in full.
        aliases: ``(checkpoint prefix, table prefix)`` pairs: a key starting with the first
            is read as if it started with the second (Gemma 3's multimodal checkpoints
            nest the language model under ``model.language_model.``). Written back as the
            table's.

    Example:
        >>> from torch_bridge import Rule, Table
        >>> rules = (Rule("w.{i}", "blocks.w"), Rule("head.weight", "head.kernel", transpose=True))
        >>> table = Table(rules=rules)
        >>> list(table.bind({"blocks.w": (2, 3), "head.kernel": (3, 4)}, n_layers=2))
        ['w.0', 'w.1', 'head.weight']
    """

    rules: tuple[Rule, ...]
    ignore: tuple[str, ...] = ()
    optional_prefix: str = ""
    aliases: tuple[tuple[str, str], ...] = ()

    def bind(self, targets: Mapping[str, tuple], n_layers: int) -> dict[str, tuple[Rule, int | None]]:
        """``{torch key: (rule, layer)}`` for every tensor the model with these target
        shapes needs, in table order."""
        plan = {}
        for rule in self.rules:
            if not all(path in targets for path in rule.jax):
                continue
            for layer in range(n_layers) if rule.per_layer else (None,):
                plan[rule.key(layer)] = (rule, layer)
        return plan

    def resolve(self, key: str, plan: Mapping[str, object]) -> str:
        """``key`` as the table writes it: with ``optional_prefix`` added, or an alias's
        prefix replaced, when only that form is in ``plan``."""
        if key in plan:
            return key
        candidates = [self.optional_prefix + key] if self.optional_prefix else []
        candidates += [table + key[len(ours) :] for ours, table in self.aliases if key.startswith(ours)]
        return next((c for c in candidates if c in plan), key)
