"""Chat templates rendered as transformers renders them, with jinja2 alone.

`models/tokenizer_json.py` serves a model's tokenizer without importing transformers
(a large share of the server's start-up); this is the other half of what the server asked
transformers for: the conversation as the model's template writes it. The rules are
transformers 5's (`apply_chat_template` and `render_jinja_template`), restated for what
a server passes (JSON-shaped messages, tools and documents), and tests hold the two
renderers to the same text on every template the tests carry:

- the environment: a sandbox that cannot change its inputs, `trim_blocks` and
  `lstrip_blocks`, loop controls, a `tojson` that keeps non-ASCII text and does not
  escape HTML, `raise_exception`, `strftime_now`, a `namespace` refusing names that
  start with `_`, and the `{% generation %}` block (rendered as its body);
- the inputs: plain JSON data only (a template is untrusted code), keys whose value is
  None dropped from each message (OpenAI sends `content: null` beside `tool_calls`),
  a message's reasoning passed under all three names templates read;
- `continue_final_message`: the text ends where the last message's content does, so
  the model goes on writing that message;
- a model with several named templates renders with `tool_use` when tools are given,
  else `default`; a `chat_template` argument may name one or be a template itself.

A template is code, and code can loop or allocate without end: the server renders in
worker processes (`models/render_worker.py`) that it can kill. The one bound checked
here is the output's length (`max_output_chars`): the text is built piece by piece and
the render stops once it is longer, instead of finishing a text no model could take.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class OutputTooLong(ValueError):
    """The template wrote more than `max_output_chars` characters."""


def select_template(own: str | dict[str, str] | None, override: str | None = None,
                    tools: object = None) -> str:
    """The template text to render: `override` (a name of one of `own`'s or a template),
    else `own` itself or the one of its named templates that fits."""
    if isinstance(own, dict):
        if override is not None:
            return own.get(override, override)
        if tools is not None and "tool_use" in own:
            return own["tool_use"]
        if "default" in own:
            return own["default"]
        raise ValueError(f"this model has several chat templates ({sorted(own)}) and none "
                         "is named 'default'; pass chat_template")
    if override is not None:
        return override
    if not own:
        raise ValueError("this model's tokenizer has no chat template; start the server "
                         "with --chat-template FILE")
    return own


def render_chat(template: str, messages: Sequence[Mapping[str, Any]], *,
                tools: Sequence[Mapping[str, Any]] | None = None,
                documents: Sequence[Mapping[str, Any]] | None = None,
                add_generation_prompt: bool = False,
                continue_final_message: bool = False, max_output_chars: int | None = None,
                **variables: Any) -> str:
    """One conversation through `template`; `variables` (the special tokens, a request's
    chat_template_kwargs) are the template's too. Past `max_output_chars` characters of
    output the render stops with `OutputTooLong`."""
    if not messages:
        raise ValueError("Cannot apply chat template to an empty conversation. Provide at "
                         "least one message.")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt are not compatible")
    for d in documents or ():
        if not isinstance(d, Mapping):
            raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
    chat = [_with_reasoning_aliases(m) for m in map(_message, messages)]
    final = None
    if continue_final_message:
        final = chat[-1].get("content")
        if not isinstance(final, str) or "content" not in template:
            raise ValueError("continue_final_message is set but the final message has no "
                             "text content the template reads")
        chat[-1]["content"] = final + _CONTINUE_TAG
    pieces = _compiled(template).generate(
        messages=chat, tools=_plain(tools), documents=_plain(documents),
        add_generation_prompt=add_generation_prompt, **_plain(variables))
    text = _joined(pieces, max_output_chars)
    if final is None:
        return text
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise ValueError("continue_final_message is set but the chat template dropped part "
                         "of the final message")
    at = text.rindex(tag)
    return text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG \
        else text[:at].rstrip()


def _joined(pieces: Iterable[str], max_chars: int | None) -> str:
    """The rendered text, as `Template.render` joins it, stopping past `max_chars`."""
    if max_chars is None:
        return "".join(pieces)
    out, size = [], 0
    for piece in pieces:
        size += len(piece)
        if size > max_chars:
            raise OutputTooLong(f"the chat template wrote more than {max_chars} characters")
        out.append(piece)
    return "".join(out)


def _message(m: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(m, Mapping):
        raise TypeError(f"Chat messages should be dicts, but got {m!r}.")
    return {k: _plain(v) for k, v in m.items() if v is not None}


def _with_reasoning_aliases(m: dict[str, Any]) -> dict[str, Any]:
    reasoning = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
    return m if reasoning is None else {"thinking": reasoning, **m,
                                         "reasoning_content": reasoning}


def _plain(value: Any) -> Any:
    """JSON data rebuilt from its base types; anything else becomes an inert string."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for base in (bool, str, int, float):
        if isinstance(value, base):
            return base(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return f"<{type(value).__name__}>"


class _Namespace(jinja2.utils.Namespace):
    """Jinja's `namespace`, refusing the underscore names that reach CPython's insides."""

    def __init__(*args: Any, **kwargs: Any):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, "
                f"but got {name!r}.")


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (training templates mark the assistant's
    tokens with it): rendered as its body, as transformers does unless it is asked for
    the assistant mask."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body) \
            .set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


class _Dict:
    """The template's `dict`: calls and `fromkeys` only, no class to climb out through."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any) -> dict:
        return dict.fromkeys(*args)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@lru_cache(maxsize=16)
def _compiled(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                       dict=_Dict(), namespace=_Namespace)
    return env.from_string(template)
