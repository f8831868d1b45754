"""Request fields → the one `StructuredOutput` a request may carry, compiled before queueing.

Accepted spellings, each naming the field in a 400 when its grammar does not compile:
OpenAI's `response_format` (`json_object`, `json_schema` with `json_schema.schema`,
`structural_tag`); vLLM's `structured_outputs` (`json`, `regex`, `choice`, `grammar`,
`json_object`, `structural_tag`) and its older `guided_json`, `guided_regex`,
`guided_choice`, `guided_grammar`; SGLang's `sampling_params.json_schema`, `regex`,
`ebnf` on `/generate`. A request gives at most one.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from typing import Any

from starlette.requests import Request

from app.engine.grammar import StructuredOutput
from app.server.errors import APIError
from app.server.state import engine
from app.server.streaming import ClientDisconnected


def _schema(value: Any, param: str) -> StructuredOutput:
    try:
        return StructuredOutput.json_schema(value)
    except (ValueError, TypeError) as e:
        raise APIError(400, f"{param} is not a JSON schema: {e}", param) from e


def from_openai(req) -> tuple[StructuredOutput, str] | None:
    """The structured output an OpenAI-style body asks for, and the field that asked."""
    found: list[tuple[StructuredOutput, str]] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append((StructuredOutput("json_object"), "response_format"))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None:
            raise APIError(400, "response_format of type json_schema needs json_schema",
                           "response_format.json_schema")
        found.append((_schema(rf.json_schema.schema_, "response_format.json_schema.schema"),
                      "response_format.json_schema.schema"))
    elif rf is not None and rf.type == "structural_tag":
        tag = rf.model_dump(exclude={"json_schema"}, exclude_none=True)
        found.append((StructuredOutput("structural_tag", json.dumps(tag)), "response_format"))
    so = req.structured_outputs
    if so is not None:
        for name, value in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                            ("grammar", so.grammar), ("structural_tag", so.structural_tag)):
            if value is not None:
                param = f"structured_outputs.{name}"
                found.append((_schema(value, param) if name == "json" else
                              StructuredOutput(name, json.dumps(value) if name == "choice"
                                               else value), param))
        if so.json_object:
            found.append((StructuredOutput("json_object"), "structured_outputs.json_object"))
    for name, kind in (("guided_json", "json"), ("guided_regex", "regex"),
                       ("guided_choice", "choice"), ("guided_grammar", "grammar")):
        value = getattr(req, name)
        if value is not None:
            found.append((_schema(value, name) if kind == "json" else
                          StructuredOutput(kind, json.dumps(value) if kind == "choice"
                                           else value), name))
    return _one(found)


def from_sglang(sp) -> tuple[StructuredOutput, str] | None:
    found = []
    if sp.json_schema is not None:
        found.append((_schema(sp.json_schema, "sampling_params.json_schema"),
                      "sampling_params.json_schema"))
    if sp.regex is not None:
        found.append((StructuredOutput("regex", sp.regex), "sampling_params.regex"))
    if sp.ebnf is not None:
        found.append((StructuredOutput("grammar", sp.ebnf), "sampling_params.ebnf"))
    return _one(found)


def _one(found: list[tuple[StructuredOutput, str]]) -> tuple[StructuredOutput, str] | None:
    if len(found) > 1:
        names = ", ".join(param for _, param in found)
        raise APIError(400, f"give at most one structured output, got {names}", found[1][1])
    if found and found[0][0].kind == "choice" and not json.loads(found[0][0].spec):
        raise APIError(400, "a choice needs at least one option", found[0][1])
    return found[0] if found else None


async def _left(request: Request) -> None:
    """Returns when the client has gone (its body was read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def compiled(request: Request, wanted: tuple[StructuredOutput, str] | None
                   ) -> StructuredOutput | None:
    """Compile the grammar (off the loop, bounded, cached) before anything is queued; a
    spec past a bound or that does not compile is a 400 naming its field. The compiled
    grammar travels with the spec to the engine. A client that leaves while its grammar
    compiles stops the compile (when no other request waits for the same one)."""
    if wanted is None:
        return None
    so, param = wanted
    engine(request).inputs.need_tokenizer(param)  # a grammar is over the vocabulary's text
    grammars = engine(request).core.grammars
    grammars.check(so, param)
    done = grammars.cached(so)
    if done is None:
        task = asyncio.ensure_future(grammars.compile(so, param, checked=True))
        watcher = asyncio.create_task(_left(request))
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            raise ClientDisconnected()
        done = task.result()
    return dataclasses.replace(so, compiled=done)
