"""Chat templates: render a conversation exactly as transformers does, and find the assistant's
tokens in it for a loss mask.

The Jinja environment is transformers 5's (``utils/chat_template_utils.py``): an
``ImmutableSandboxedEnvironment`` with ``trim_blocks``, ``lstrip_blocks`` and the ``loopcontrols``
extension; a ``tojson`` filter that does not escape HTML; the globals ``raise_exception``,
``strftime_now``, ``dict`` and ``namespace`` (the last two without access to private attributes);
and the ``{% generation %}`` tag, whose body renders as is. A template sees ``messages``,
``add_generation_prompt``, ``tools=None``, ``documents=None`` and the tokenizer's named special
tokens (``bos_token``, ``eos_token``, ...) that are set; unset ones are undefined, not None.
"""

import json
from collections.abc import Callable, Sequence
from datetime import datetime
from functools import lru_cache
from typing import ClassVar

import jinja2
import jinja2.ext
import jinja2.nodes
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment

from jaxckpt.data._example import DataError, Example

CHAT_ROLES = ("system", "user", "assistant", "tool")
"""The roles a message may have; the loss of ``encode_chat`` is on ``"assistant"`` turns only."""

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: renders its body (transformers tracks it for
    ``return_assistant_tokens_mask``; ``chat_example`` finds the assistant's turns without it)."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


class _TemplateDict:
    """``dict(...)`` in a template, without the class itself (as transformers)."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace(...)`` that refuses underscore-prefixed attributes (as transformers)."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a namespace attribute may not start with '_': {name!r}")


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


@lru_cache(maxsize=32)
def compile_template(template: str) -> jinja2.Template:
    """The compiled ``template`` (cached), in transformers' sandboxed environment.

    Raises:
        DataError: if the template does not compile (its line and Jinja's message).

    Example:
        >>> compile_template("{{ messages | length }}").render(messages=[1, 2])
        '2'
    """
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise_exception,
        strftime_now=_strftime_now,
        dict=_TemplateDict(),
        namespace=_TemplateNamespace,
    )
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise DataError(f"the chat template does not compile (line {e.lineno}: {e.message})") from None


def _check_message(i: int, message) -> dict:
    if not isinstance(message, dict):
        raise DataError(
            f"messages[{i}] must be an object with 'role' and 'content', got {type(message).__name__}"
        )
    message = {k: v for k, v in message.items() if v is not None}  # as transformers: None is absent
    for name in ("role", "content"):
        if name not in message:
            raise DataError(
                f"messages[{i}] has no '{name}' field (a message is {{'role': ..., 'content': ...}})"
            )
    role, content = message["role"], message["content"]
    if role not in CHAT_ROLES:
        raise DataError(f"messages[{i}]: unknown role {role!r}; expected one of {', '.join(CHAT_ROLES)}")
    if not isinstance(content, (str, list)):
        raise DataError(
            f"messages[{i}]: 'content' must be a string (or a list of parts), got {type(content).__name__}"
        )
    reasoning = next((message[k] for k in _REASONING_FIELDS if k in message), None)
    if reasoning is not None:  # transformers fills both names a template may read
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def check_messages(messages) -> list[dict]:
    """Validated copies of ``messages``: a non-empty list of ``{"role", "content"}`` objects with
    a role of ``CHAT_ROLES``; keys whose value is None are dropped (as transformers does).

    Raises:
        DataError: naming the message's index and the missing field or the bad role.

    Example:
        >>> check_messages([{"role": "user", "content": "Hi", "name": None}])
        [{'role': 'user', 'content': 'Hi'}]
        >>> check_messages([{"role": "robot", "content": "Hi"}])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        jaxckpt.data._example.DataError: messages[0]: unknown role 'robot'; expected one of system, ...
    """
    if not isinstance(messages, (list, tuple)):
        raise DataError(
            f"messages must be a list of {{'role', 'content'}} objects, got {type(messages).__name__}"
        )
    if not messages:
        raise DataError("messages is empty: a conversation needs at least one message")
    return [_check_message(i, m) for i, m in enumerate(messages)]


def render_chat(
    template: str,
    messages: Sequence[dict],
    *,
    add_generation_prompt: bool = False,
    variables: dict | None = None,
) -> str:
    """``messages`` (already checked) rendered through ``template``, as transformers'
    ``apply_chat_template(..., tokenize=False)``.

    Args:
        template: a Jinja chat template.
        messages: the conversation.
        add_generation_prompt: append the template's header of an assistant turn.
        variables: more names the template sees (the tokenizer's ``bos_token``, ...).

    Raises:
        DataError: the template raised (``raise_exception``: its own message) or failed.

    Example:
        >>> t = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
        >>> render_chat(t, [{"role": "user", "content": "Hi"}])
        '<user>Hi'
    """
    compiled = compile_template(template)
    try:
        return compiled.render(
            messages=list(messages),
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **(variables or {}),
        )
    except jinja2.TemplateError as e:
        raise DataError(
            f"the chat template refused the conversation: {e.message or type(e).__name__}"
        ) from None
    except (TypeError, ValueError, LookupError, AttributeError) as e:
        raise DataError(f"the chat template failed on the conversation ({type(e).__name__}: {e})") from None


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def chat_example(
    messages: Sequence[dict],
    *,
    render: Callable[[Sequence[dict], bool], str],
    encode_batch: Callable[[list[str]], list[np.ndarray]],
    add_generation_prompt: bool = False,
) -> Example:
    """The tokens of a rendered conversation, with the loss on the assistant's turns only.

    ``ids`` are ``encode_batch([render(messages, add_generation_prompt)])[0]`` (tokenized without
    special tokens, as transformers' ``apply_chat_template(tokenize=True)``). Assistant turn ``i``
    starts after the tokens of ``render(messages[:i], True)`` (the context plus the assistant
    header, e.g. ``<|im_start|>assistant\\n``) and ends after those of
    ``render(messages[:i + 1], False)`` where they still agree with the whole conversation: its
    content and the template's end-of-turn markup (``<|eot_id|>``, ``<|im_end|>\\n``, ``</s>``),
    so the model learns to stop; a trailing EOS a template writes only at the very end (Phi-3's)
    is counted only on the last turn. A token that straddles a boundary counts as the assistant's.

    Args:
        messages: checked messages (``check_messages``).
        render: ``(messages, add_generation_prompt) -> str``.
        encode_batch: texts -> their token ids (no special tokens added).
        add_generation_prompt: end with the header of a new assistant turn (not a target).

    Raises:
        DataError: the template does not render a turn's context as a prefix of the conversation.

    Example:
        >>> t = "{% for m in messages %}[{{ m.role }}]{{ m.content }}.{% endfor %}"
        >>> t += "{% if add_generation_prompt %}[assistant]{% endif %}"
        >>> enc = lambda texts: [np.frombuffer(s.encode(), np.uint8).astype(np.int32) for s in texts]
        >>> msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
        >>> render = lambda m, g: render_chat(t, m, add_generation_prompt=g)
        >>> ex = chat_example(msgs, render=render, encode_batch=enc)
        >>> bytes(ex.ids[ex.loss_mask].astype(np.uint8)).decode()
        'Yo.'
    """
    full = render(messages, add_generation_prompt)
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    texts = [full]
    for i in turns:
        context = render(messages[:i], True)
        if not full.startswith(context):
            raise DataError(
                f"the chat template renders messages[:{i}] with its generation prompt as text that does "
                f"not begin the whole conversation, so assistant message {i} cannot be told apart"
            )
        texts += [context, render(messages[: i + 1], False)]
    encoded = encode_batch(texts)
    ids = encoded[0]
    mask = np.zeros(len(ids), bool)
    for k in range(len(turns)):
        start, end = _common_prefix(encoded[1 + 2 * k], ids), _common_prefix(encoded[2 + 2 * k], ids)
        mask[start:end] = True
    return Example(np.asarray(ids, np.int32), mask)
