"""The HTTP server: Starlette on uvicorn (uvloop + httptools), one process, one loop.

The model loads in a thread after the socket is open, so /health answers 503
while starting instead of refusing connections. SIGTERM/SIGINT drain: new
requests get 503, in-flight ones may finish for `--shutdown-timeout` seconds,
the rest end with an error event, then the process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from app.config import EngineConfig, ServerSettings
from app.engine.async_engine import AsyncEngine
from app.engine.core import EngineCore
from app.engine.kv_events import KVEventsConfig, exposure_warning
from app.server import (
    anthropic,
    lora_routes,
    native,
    openai,
    openai_chat,
    openai_completions,
    responses,
    web_ui,
)
from app.server.auth import authorize
from app.server.body_checks import check_body
from app.server.errors import APIError, api_error
from app.server.hosts import HostCheckMiddleware
from app.server.http_protocol import with_header_timeout
from app.server.request_id import HEADER, RequestIdMiddleware
from app.server.response_store import ResponseStore
from app.server.state import State, state
from app.server.streaming import ClientDisconnected

log = logging.getLogger("ridgeline.server")

Handler = Callable[[Request, Any], Awaitable[Response]]


async def read_json(request: Request, limit: int, timeout: float | None = None) -> Any:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise APIError(413, f"request body of {length} bytes exceeds the {limit}-byte limit")
    body = bytearray()

    async def read() -> None:
        async for chunk in request.stream():
            body.extend(chunk)
            if len(body) > limit:
                raise APIError(413, f"request body exceeds the {limit}-byte limit")

    try:
        await asyncio.wait_for(read(), timeout)
    except asyncio.TimeoutError as e:  # a body trickled in slower than the deadline
        raise APIError(408, f"request body not received within {timeout} s", None,
                       "invalid_request_error", "request_timeout") from e
    try:
        return json.loads(body, parse_constant=_no_constants)
    except RecursionError as e:
        raise APIError(400, "malformed JSON body: nested too deeply") from e
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"malformed JSON body: {e}") from e


def _no_constants(name: str) -> Any:
    """JSON has no NaN or Infinity (Python's json accepts them): a number must be finite."""
    raise ValueError(f"{name} is not valid JSON")


def _require_json(request: Request) -> None:
    """A body must be declared JSON. Browsers send `text/plain` cross-origin without a
    preflight (a CORS "simple request"); refusing it keeps a web page from driving a
    server on localhost."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/json" and not kind.endswith("+json"):
        raise APIError(415, f"the body must be JSON (Content-Type: application/json), "
                       f"got {kind or 'no Content-Type'!r}", None, "invalid_request_error",
                       "unsupported_media_type")


def _error(e: APIError, request: Request,
           shape: Callable[[APIError], dict] | None = None) -> JSONResponse:
    """The error's answer; its reason noted for the request's access line."""
    request.state.error = e.message[:300]
    return JSONResponse(shape(e) if shape else e.body(), status_code=e.status,
                        headers=e.headers)


def endpoint(handler: Handler, needs_body: bool = True, operator: bool = False,
             anthropic_api: bool = False) -> Callable[[Request], Awaitable[Response]]:
    """Every route but /health and /metrics: API key (the admin key for an `operator`
    route, `auth.py`), readiness, body, error mapping. `anthropic_api`: errors in
    Anthropic's shape, and the key may come as `x-api-key`."""
    shape = anthropic.anthropic_error if anthropic_api else None

    async def route(request: Request) -> Response:
        st = state(request)
        try:
            authorize(request, st.settings, operator, "x-api-key" if anthropic_api else None)
            st.ready_engine()
            body = None
            if needs_body:
                _require_json(request)
                body = await read_json(request, st.settings.max_body_bytes,
                                       st.settings.header_timeout)
                request.state.body_entries = check_body(body, st.settings)
            return await handler(request, body)
        except ClientDisconnected:
            return Response(status_code=499)  # nobody is listening; nginx's code for it
        except Exception as e:
            error = api_error(e, st.settings.retry_after_seconds)
            if error is None:
                log.exception("unexpected error", extra={"path": request.url.path})
                error = APIError(500, f"internal error: {type(e).__name__}", None,
                                 "server_error")
            return _error(error, request, shape)
    return route


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """404 for an unknown route, 405 for a wrong method: JSON like every other error."""
    message = {404: f"no route {request.url.path}",
               405: f"{request.method} is not allowed on {request.url.path}"}
    return _error(APIError(exc.status_code, message.get(exc.status_code, str(exc.detail)),
                           None, "invalid_request_error", headers=exc.headers), request)


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    """The last resort: a bug outside a route's own handling is still a JSON 500."""
    log.error("unexpected error", exc_info=exc, extra={"path": request.url.path})
    response = _error(APIError(500, f"internal error: {type(exc).__name__}", None,
                               "server_error"), request)
    if "request_id" in request.scope.get("state", {}):  # answered outside the middleware
        response.headers[HEADER] = request.scope["state"]["request_id"]
    return response


async def health(request: Request) -> Response:
    """200 while the engine can serve, else 503; the body says why, and shows the block
    pool's O(1) invariant (`kv_blocks.consistent`) so a leak is visible from outside."""
    st = state(request)
    engine = st.engine
    ok = engine is not None and engine.healthy and not st.draining
    inputs_stuck = engine.inputs.stuck() if ok else None
    ok = ok and inputs_stuck is None
    body: dict[str, Any] = {"status": "ok" if ok else "unavailable"}
    if st.draining:
        body["reason"] = "draining"
    elif st.load_error is not None:
        body["reason"] = "model failed to load"
    elif engine is None:
        body["reason"] = "loading"
    elif inputs_stuck is not None:
        body["reason"] = inputs_stuck
    elif not ok:
        body["reason"] = "engine stopped" if engine.dead is not None else "step stalled"
    if engine is not None:
        body["kv_blocks"] = engine.core.block_report()
    return JSONResponse(body, status_code=200 if ok else 503)


async def reset_prefix_cache(request: Request, body: None) -> JSONResponse:
    """Forget the prefix cache (vLLM's and SGLang's endpoint): after a weight swap, or
    to measure without it."""
    return JSONResponse({"dropped_blocks": state(request).engine.core.reset_prefix_cache()})


async def plan(request: Request, body: None) -> JSONResponse:
    """The memory plan, the device's measured peaks and the live roofline position
    (`app/engine/plan.py`); `ridgeline plan` prints the same for a model not served."""
    return JSONResponse(state(request).engine.plan())


async def metrics(request: Request) -> Response:
    engine = state(request).engine
    if engine is None:
        return Response(b"", media_type="text/plain; version=0.0.4; charset=utf-8")
    data, content_type = engine.metrics.render(request.headers.get("accept", ""))
    return Response(data, headers={"Content-Type": content_type})


ROUTES = [
    Route("/health", health, methods=["GET"]),
    Route("/metrics", metrics, methods=["GET"]),
    Route("/v1/models", endpoint(openai.models, needs_body=False), methods=["GET"]),
    Route("/v1/completions", endpoint(openai_completions.completions), methods=["POST"]),
    Route("/v1/chat/completions", endpoint(openai_chat.chat_completions), methods=["POST"]),
    Route("/v1/chat/completions/render", endpoint(openai_chat.chat_render), methods=["POST"]),
    Route("/v1/messages", endpoint(anthropic.messages, anthropic_api=True), methods=["POST"]),
    Route("/v1/messages/count_tokens", endpoint(anthropic.count_tokens, anthropic_api=True),
          methods=["POST"]),
    Route("/v1/completions/render", endpoint(openai_completions.completions_render),
          methods=["POST"]),
    Route("/v1/responses", endpoint(responses.create), methods=["POST"]),
    Route("/v1/responses/{response_id}", endpoint(responses.retrieve, needs_body=False),
          methods=["GET"]),
    Route("/v1/responses/{response_id}", endpoint(responses.delete, needs_body=False),
          methods=["DELETE"]),
    Route("/generate", endpoint(native.generate), methods=["POST"]),
    Route("/tokenize", endpoint(native.tokenize), methods=["POST"]),
    Route("/detokenize", endpoint(native.detokenize), methods=["POST"]),
    Route("/tokenizer_info", endpoint(native.tokenizer_info, needs_body=False),
          methods=["GET"]),
    Route("/abort_request", endpoint(native.abort_request), methods=["POST"]),
    Route("/reset_prefix_cache", endpoint(reset_prefix_cache, needs_body=False,
                                          operator=True), methods=["POST"]),
    Route("/plan", endpoint(plan, needs_body=False), methods=["GET"]),
    Route("/v1/load_lora_adapter", endpoint(lora_routes.load_lora_adapter, operator=True),
          methods=["POST"]),
    Route("/v1/unload_lora_adapter", endpoint(lora_routes.unload_lora_adapter, operator=True),
          methods=["POST"]),
]


def build_app(config: EngineConfig, settings: ServerSettings,
              core: EngineCore | None = None) -> Starlette:
    """The ASGI app. `core` may be passed pre-built (tests); else it loads on startup."""
    st = State(config, settings)
    _warn_if_events_exposed(config, settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        load = asyncio.create_task(_load(st, core))
        yield
        load.cancel()
        if st.engine is not None:
            await st.engine.stop()

    routes = ROUTES if settings.disable_web_ui else ROUTES + web_ui.ROUTES
    app = Starlette(routes=routes, lifespan=lifespan,
                    middleware=[Middleware(RequestIdMiddleware,
                                           access_log=not settings.disable_uvicorn_access_log),
                                Middleware(HostCheckMiddleware, listen_host=settings.host,
                                           allowed_hosts=settings.allowed_hosts)],
                    exception_handlers={HTTPException: _http_error, Exception: _unexpected})
    app.state.ridgeline = st  # handlers reach the engine through request.app.state
    app.state.response_store = ResponseStore(settings.responses_store_max_entries,
                                             settings.responses_store_max_bytes)
    return app


def _warn_if_events_exposed(config: EngineConfig, settings: ServerSettings) -> None:
    try:
        events = KVEventsConfig.parse(config.cache.kv_events_config)
    except ValueError:
        return  # the engine's load reports it
    warning = exposure_warning(events, bool(settings.api_key))
    if warning is not None:
        log.log(*warning)


async def _load(st: State, prebuilt: EngineCore | None) -> None:
    try:
        core = prebuilt or await asyncio.to_thread(EngineCore, st.config)
    except BaseException as e:
        st.load_error = e
        log.exception("model failed to load")
        if st.on_load_failure is not None:
            st.on_load_failure()  # the server exits non-zero instead of idling unhealthy
        return
    engine = AsyncEngine(core, st.config.model_name, st.settings.log_stats_interval,
                         log_requests=not st.settings.disable_log_requests)
    engine.start()
    st.model_names = [engine.model_name]
    if st.config.model and st.config.model != engine.model_name:
        st.model_names.append(st.config.model)
    st.engine = engine
    if st.on_ready is not None:
        st.on_ready()
    log.info("ready to serve", extra={"model": engine.model_name})


def freeze_startup_heap() -> None:
    """Take everything alive after the model load out of the garbage collector's walks.

    A full (oldest-generation) collection visits every tracked object, and after the
    load there are ~200k (torch, the server's libraries, the model's modules); each such
    walk holds the GIL, so the event loop and the model thread stop together for it.
    Frozen, they are never visited again (reference counting still frees them). vLLM
    and SGLang freeze their start-up heaps the same way. `ridgeline serve` only: it
    keeps one engine for the life of the process, where a frozen cycle could never be
    collected. `cmd_serve` turns collection off for the imports and the load, and
    nothing collects before the freeze either: what the imports left unreachable
    (tuples, cells, functions, frames; no tensor) stays frozen, about a megabyte. A
    load that left a tensor in a cycle would keep it too: free large tensors by
    reference, never by cycle.
    """
    started = time.perf_counter()
    gc.freeze()
    gc.enable()
    log.info("froze the start-up heap", extra={"objects": gc.get_freeze_count(),
                                               "ms": round(1e3 * (time.perf_counter() - started))})


def uvicorn_config(app: Starlette, settings: ServerSettings, **overrides: Any) -> uvicorn.Config:
    """How `ridgeline serve` runs the app (tests and `bench overhead` run it the same way)."""
    kwargs = dict(host=settings.host, port=settings.port, loop="uvloop", log_config=None,
                  http=with_header_timeout(settings.header_timeout),
                  timeout_graceful_shutdown=5)
    return uvicorn.Config(app, **(kwargs | overrides))


def run_server(config: EngineConfig, settings: ServerSettings) -> int:
    from sse_starlette.sse import AppStatus

    from app.logging_setup import configure_logging

    configure_logging()
    app = build_app(config, settings)
    AppStatus.disable_automatic_graceful_drain()  # we drain ourselves, then close streams
    server = DrainingServer(uvicorn_config(app, settings), app.state.ridgeline)
    app.state.ridgeline.on_load_failure = lambda: setattr(server, "should_exit", True)
    app.state.ridgeline.on_ready = freeze_startup_heap
    log.info("serving", extra={"host": settings.host, "port": settings.port})
    server.run()
    return 1 if app.state.ridgeline.load_error is not None else server.exit_code


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose first SIGTERM/SIGINT drains before exiting.

    First signal: new requests get 503, requests in flight may finish for
    `shutdown_timeout` seconds, the rest end with an error event; exit code 0.
    Second signal: the open streams end with an error event at once, then the
    process exits with code 1 (the drain was cut short). While the model loads there is
    nothing to drain, and a load cannot be interrupted from its thread: the process
    exits with code 1 if the load has not ended within `LOADING_EXIT_S` seconds.
    """

    LOADING_EXIT_S = 5.0

    def __init__(self, config: uvicorn.Config, st: State):
        super().__init__(config)
        self.st = st
        self.exit_code = 0

    def handle_exit(self, sig, frame):  # runs in the loop's thread
        st = self.st
        if st.engine is None:  # still loading: nothing to drain
            log.info("stopping while the model loads")
            self._exit()
            timer = threading.Timer(self.LOADING_EXIT_S, os._exit, args=(1,))
            timer.daemon = True  # a load that ends first lets the process exit as usual
            timer.start()
            return
        loop = asyncio.get_event_loop()
        if st.draining:
            if self.exit_code == 0:
                self.exit_code = 1
                log.warning("second signal: ending open requests now")
                loop.call_soon_threadsafe(lambda: loop.create_task(self._end(0.0)))
            return
        st.draining = True
        log.info("draining", extra={"in_flight": st.engine.num_unfinished,
                                    "timeout_s": st.settings.shutdown_timeout})
        loop.call_soon_threadsafe(
            lambda: loop.create_task(self._end(st.settings.shutdown_timeout)))

    async def _end(self, timeout: float) -> None:
        """Let requests finish for `timeout` seconds, end the rest with an error, exit."""
        engine, deadline = self.st.engine, time.monotonic() + timeout
        while engine.num_unfinished and time.monotonic() < deadline and self.exit_code == 0:
            await asyncio.sleep(0.05)
        failed = engine.fail_unfinished("server shut down before completion")
        if failed:
            log.warning("ended unfinished requests", extra={"count": failed})
        await engine.inputs.stop_rendering()  # a render in progress would hold its client
        await asyncio.sleep(0.2)  # let the error events reach the clients
        self._exit()

    def _exit(self) -> None:
        from sse_starlette.sse import AppStatus

        AppStatus.should_exit = True
        self.should_exit = True
