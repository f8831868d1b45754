"""The HTTP server: Starlette on uvicorn (uvloop + httptools), one process, one loop.

The model loads in a thread after the socket is open, so /health answers 503
while starting instead of refusing connections. SIGTERM/SIGINT drain: new
requests get 503, in-flight ones may finish for `--shutdown-timeout` seconds,
the rest end with an error event, then the process exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from app import api_openai
from app.config import EngineConfig
from app.engine import AsyncEngine, EngineDead
from app.engine_core import EngineCore
from app.protocol import (
    AbortRequest,
    APIError,
    DetokenizeRequest,
    TokenizeRequest,
    error_body,
    from_invalid_parameter,
    now,
    parse,
)
from app.sampling_params import InvalidParameter
from app.scheduler import QueueFull
from models.tokenizer import apply_chat_template

log = logging.getLogger("ridgeline.server")


@dataclass(frozen=True)
class ServerSettings:
    served_model_name: str | None = None
    api_key: str | None = None
    max_body_bytes: int = 4 << 20
    shutdown_timeout: float = 30.0
    log_stats_interval: float = 10.0
    retry_after_seconds: int = 1


async def read_json(request: Request, limit: int) -> Any:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise APIError(413, f"request body of {length} bytes exceeds the {limit}-byte limit")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise APIError(413, f"request body exceeds the {limit}-byte limit")
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"malformed JSON body: {e}") from e


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


class State:
    """Per-app mutable state, on the event loop only."""

    def __init__(self, settings: ServerSettings):
        self.settings = settings
        self.engine: AsyncEngine | None = None
        self.model_names: list[str] = []
        self.draining = False
        self.load_error: BaseException | None = None
        self.on_load_failure: Callable[[], None] | None = None


def build_app(config: EngineConfig, settings: ServerSettings,
              core: EngineCore | None = None) -> Starlette:
    """The ASGI app. `core` may be passed pre-built (tests); else it loads on startup."""
    state = State(settings)

    def ready_engine(request: Request) -> AsyncEngine:
        if state.draining:
            raise APIError(503, "server is shutting down", type_="service_unavailable",
                           headers={"Retry-After": str(settings.retry_after_seconds)})
        if state.load_error is not None:
            raise APIError(500, f"model failed to load: {state.load_error}", type_="server_error")
        if state.engine is None:
            raise APIError(503, "model is still loading", type_="service_unavailable",
                           headers={"Retry-After": str(settings.retry_after_seconds)})
        if not state.engine.healthy:
            raise APIError(503, "engine is not healthy", type_="service_unavailable")
        return state.engine

    def authorize(request: Request) -> None:
        key = settings.api_key
        if not key:
            return
        given = request.headers.get("authorization", "")
        expected = f"Bearer {key}"
        if not hmac.compare_digest(given.encode(), expected.encode()):
            raise APIError(401, "missing or invalid API key", None, "authentication_error",
                           "invalid_api_key")

    def endpoint(handler, needs_body: bool = True):
        """Every route but /health and /metrics: API key, readiness, body, error mapping."""
        async def route(request: Request) -> Response:
            try:
                authorize(request)
                ready_engine(request)
                body = await read_json(request, settings.max_body_bytes) if needs_body else None
                return await handler(request, body)
            except APIError as e:
                return _error(e)
            except InvalidParameter as e:
                return _error(from_invalid_parameter(e))
            except QueueFull as e:
                return _error(APIError(503, f"server is overloaded: {e}", None,
                                       "service_unavailable", "queue_full",
                                       {"Retry-After": str(settings.retry_after_seconds)}))
            except EngineDead as e:
                return _error(APIError(503, str(e), None, "service_unavailable"))
            except api_openai.ClientDisconnected:
                return Response(status_code=499)  # nobody is listening; nginx's code for it
        return route

    async def health(request: Request) -> Response:
        ok = state.engine is not None and state.engine.healthy and not state.draining
        return Response(status_code=200 if ok else 503)

    async def metrics(request: Request) -> Response:
        data = state.engine.metrics.render() if state.engine else b""
        return Response(data, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def models(request: Request, body: None) -> JSONResponse:
        core = state.engine.core
        return JSONResponse({"object": "list", "data": [{
            "id": state.model_names[0], "object": "model", "created": now(),
            "owned_by": "ridgeline", "root": str(core.model_dir),
            "max_model_len": core.max_model_len}]})

    async def tokenize(request: Request, body: dict) -> JSONResponse:
        req = parse(TokenizeRequest, body)
        core = state.engine.core
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of 'prompt' or 'messages'", "prompt")
        if req.messages is not None:
            ids = apply_chat_template(core.tokenizer,
                                      [m.model_dump(exclude_none=True) for m in req.messages])
        else:
            ids = core.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": core.max_model_len})

    async def detokenize(request: Request, body: dict) -> JSONResponse:
        req = parse(DetokenizeRequest, body)
        core = state.engine.core
        vocab = core.model_config.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids outside the vocabulary [0, {vocab}): {bad[:5]}",
                           "tokens")
        return JSONResponse({"prompt": core.tokenizer.decode(req.tokens)})

    async def abort_request(request: Request, body: dict) -> JSONResponse:
        req = parse(AbortRequest, body)
        return JSONResponse({"rid": req.rid, "aborted": state.engine.abort(req.rid)})

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/models", endpoint(models, needs_body=False), methods=["GET"]),
        Route("/tokenize", endpoint(tokenize), methods=["POST"]),
        Route("/detokenize", endpoint(detokenize), methods=["POST"]),
        Route("/abort_request", endpoint(abort_request), methods=["POST"]),
    ] + [
        Route(path, endpoint(h), methods=["POST"])
        for path, h in api_openai.ROUTES.items()
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        load = asyncio.create_task(_load(core))
        yield
        load.cancel()
        if state.engine is not None:
            await state.engine.stop()

    async def _load(prebuilt: EngineCore | None) -> None:
        try:
            built = prebuilt or await asyncio.to_thread(EngineCore, config)
        except BaseException as e:
            state.load_error = e
            log.exception("model failed to load")
            if state.on_load_failure is not None:
                state.on_load_failure()  # the server exits non-zero instead of idling unhealthy
            return
        engine = AsyncEngine(built, settings.served_model_name or _default_name(config),
                             settings.log_stats_interval)
        engine.start()
        state.model_names = [engine.model_name]
        if config.model and config.model != engine.model_name:
            state.model_names.append(config.model)
        state.engine = engine
        log.info("ready to serve", extra={"model": engine.model_name})

    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.ridgeline = state  # handlers reach the engine through request.app.state
    return app


def _default_name(config: EngineConfig) -> str:
    return config.served_model_name or config.model or "SmolLM2-135M-Instruct"


def run_server(args: argparse.Namespace, config: EngineConfig) -> int:
    import uvicorn
    from sse_starlette.sse import AppStatus

    from app.logging_setup import configure_logging

    configure_logging()
    settings = ServerSettings(
        served_model_name=args.served_model_name, api_key=args.api_key,
        max_body_bytes=args.max_request_body_bytes, shutdown_timeout=args.shutdown_timeout,
        log_stats_interval=args.log_stats_interval,
    )
    app = build_app(config, settings)
    AppStatus.disable_automatic_graceful_drain()  # we drain ourselves, then close streams
    server = DrainingServer(uvicorn.Config(app, host=args.host, port=args.port, loop="uvloop",
                                           http="httptools", log_config=None,
                                           timeout_graceful_shutdown=5), app, settings)
    app.state.ridgeline.on_load_failure = lambda: setattr(server, "should_exit", True)
    log.info("serving", extra={"host": args.host, "port": args.port})
    server.run()
    return 1 if app.state.ridgeline.load_error is not None else 0


class DrainingServer:
    """uvicorn.Server whose first SIGTERM/SIGINT drains before exiting."""

    def __new__(cls, config, app: Starlette, settings: ServerSettings):
        import uvicorn
        from sse_starlette.sse import AppStatus

        class _Server(uvicorn.Server):
            def handle_exit(self, sig, frame):  # runs in the loop's thread
                state: State = app.state.ridgeline
                if state.draining or state.engine is None:
                    AppStatus.should_exit = True
                    return super().handle_exit(sig, frame)
                state.draining = True
                log.info("draining", extra={"in_flight": state.engine.num_unfinished,
                                            "timeout_s": settings.shutdown_timeout})
                loop = asyncio.get_event_loop()
                loop.call_soon_threadsafe(lambda: loop.create_task(self._drain(state)))

            async def _drain(self, state: State) -> None:
                deadline = time.monotonic() + settings.shutdown_timeout
                while state.engine.num_unfinished and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                failed = state.engine.fail_unfinished("server shut down before completion")
                if failed:
                    log.warning("ended unfinished requests", extra={"count": failed})
                await asyncio.sleep(0.2)  # let the error events reach the clients
                AppStatus.should_exit = True
                self.should_exit = True

        return _Server(config)


__all__ = ["ServerSettings", "build_app", "error_body", "run_server"]
