"""Cheap checks of a grammar spec, before anything is compiled.

A compile is bounded in time and memory (`app/engine/grammar_pool.py`), but the
specs that would reach those bounds are mostly recognisable from their shape: they
are large, deeply nested, or list many options. These checks take microseconds to a
few milliseconds and turn such a spec into a 400 naming its field at once, without
occupying a worker. Past them, a spec that still costs too much is stopped by the
compile's own bounds.

- size: the spec's text, at most `--grammar-max-spec-bytes` (a setting);
- nesting: JSON (a schema, a structural tag) at most `MAX_DEPTH` levels deep, checked
  on the text before it is parsed, so a deep string is a 400 and not a RecursionError;
- options: at most `MAX_OPTIONS` values over all `enum` lists of a schema, and at most
  as many options in a `choice`;
- schema keywords: what xgrammar accepts but does not enforce is refused (`not`, ...).
"""

from __future__ import annotations

import itertools
import json
import re
from typing import Any

MAX_DEPTH = 64  # JSON levels; OpenAI's structured outputs allow 10 levels of schema
MAX_OPTIONS = 1000  # enum values in one schema, or options of a choice (OpenAI: 1000)
# JSON Schema keywords xgrammar accepts but does not enforce: refused, not ignored.
UNENFORCED = ("uniqueItems", "not", "if", "then", "else", "dependentSchemas",
              "dependentRequired", "patternProperties", "unevaluatedProperties")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_NOT_BRACKET = re.compile(r"[^\[\]{}]")
_DELTA = str.maketrans("[{]}", "\x01\x01\x02\x02")


def text_depth(text: str) -> int:
    """How deeply the brackets of a JSON text nest (strings skipped), without parsing."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    if brackets.count("[") + brackets.count("{") <= MAX_DEPTH:
        return min(brackets.count("[") + brackets.count("{"), MAX_DEPTH)
    steps = (1 if c == 1 else -1 for c in brackets.translate(_DELTA).encode())
    return max(itertools.accumulate(steps), default=0)


def value_depth(value: Any) -> int:
    """How deeply a parsed JSON value nests, without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, depth)
            if depth > MAX_DEPTH:
                return depth
            stack.extend((x, depth + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


def parse_json(text: str, what: str) -> Any:
    """`json.loads`, refusing by depth first (a ValueError, for a 400)."""
    depth = text_depth(text)
    if depth > MAX_DEPTH:
        raise ValueError(f"{what} nests {depth} levels deep, more than {MAX_DEPTH}")
    return json.loads(text)


def check_depth(value: Any, what: str) -> None:
    depth = value_depth(value)
    if depth > MAX_DEPTH:
        raise ValueError(f"{what} nests more than {MAX_DEPTH} levels deep")


def check_schema(schema: Any, path: str = "") -> None:
    """Refuse what xgrammar would silently not enforce, naming where it is, and more
    than `MAX_OPTIONS` enum values. Iterative: the depth is bounded, but not by this."""
    options = 0
    stack = [(schema, path)]
    while stack:
        node, where_ = stack.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                where = f"{where_}.{key}" if where_ else key
                if key in UNENFORCED:
                    raise ValueError(f"the schema keyword {where!r} is not supported (it "
                                     f"could not be enforced)")
                if key == "multipleOf" and node.get("type") == "number":
                    raise ValueError(f"{where!r}: multipleOf is supported on integers only")
                if key == "$ref" and isinstance(value, str) and not value.startswith("#"):
                    raise ValueError(f"{where!r}: only local references ('#/...') are "
                                     f"supported")
                if key == "enum" and isinstance(value, list):
                    options += len(value)
                    if options > MAX_OPTIONS:
                        raise ValueError(f"the schema has more than {MAX_OPTIONS} enum values "
                                         f"(at {where!r})")
                stack.append((value, where))
        elif isinstance(node, list):
            stack.extend((item, f"{where_}[{i}]") for i, item in enumerate(node))


def tag_schemas(tag: Any):
    """The JSON schemas inside a structural tag (its `json_schema` contents)."""
    stack = [tag]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if node.get("type") == "json_schema" and "json_schema" in node:
                yield node["json_schema"]
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def check_spec(kind: str, spec: str, max_bytes: int) -> None:
    """Every cheap bound of one spec; a ValueError saying which was passed."""
    size = len(spec.encode())
    if size > max_bytes:
        raise ValueError(f"the {kind} spec is {size} bytes, more than the {max_bytes} "
                         f"allowed (--grammar-max-spec-bytes)")
    if kind == "json":
        check_schema(parse_json(spec, "the schema"))
    elif kind == "structural_tag":
        for schema in tag_schemas(parse_json(spec, "the structural tag")):
            check_schema(schema)
    elif kind == "choice":
        options = json.loads(spec)
        if len(options) > MAX_OPTIONS:
            raise ValueError(f"a choice may have at most {MAX_OPTIONS} options, "
                             f"got {len(options)}")
