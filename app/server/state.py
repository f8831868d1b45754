"""The server's state, one object per app, reached by handlers through `request.app.state`.

It lives on the event loop only: handlers, the lifespan task and the drain all run
there, so nothing here needs a lock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from starlette.requests import Request

from app.config import EngineConfig, ServerSettings
from app.engine.async_engine import AsyncEngine
from app.server.errors import APIError


@dataclass
class State:
    config: EngineConfig
    settings: ServerSettings
    engine: AsyncEngine | None = None
    model_names: list[str] = field(default_factory=list)  # the served name first
    draining: bool = False
    load_error: BaseException | None = None
    on_load_failure: Callable[[], None] | None = None
    on_ready: Callable[[], None] | None = None  # once the engine is up, before serving

    def ready_engine(self) -> AsyncEngine:
        """The engine, or the 5xx that says why there is none to serve this request."""
        retry = {"Retry-After": str(self.settings.retry_after_seconds)}
        if self.draining:
            raise APIError(503, "server is shutting down", type_="service_unavailable",
                           headers=retry)
        if self.load_error is not None:
            raise APIError(500, f"model failed to load: {self.load_error}", type_="server_error")
        if self.engine is None:
            raise APIError(503, "model is still loading", type_="service_unavailable",
                           headers=retry)
        if not self.engine.healthy:
            raise APIError(503, "engine is not healthy", type_="service_unavailable")
        return self.engine


def state(request: Request) -> State:
    return request.app.state.ridgeline


def engine(request: Request) -> AsyncEngine:
    """The running engine (the route wrapper has checked it is ready)."""
    return request.app.state.ridgeline.engine


def check_model(request: Request, model: str | None) -> str:
    """The served name to answer with; 404 for a model this server does not serve. A
    LoRA adapter's name is answered with, and noted on the request for `queue_all`."""
    st = state(request)
    names = st.model_names
    if model is None or model in names:
        return names[0]
    loras = st.engine.core.loras if st.engine is not None else None
    if loras is not None and model in loras.adapters:
        request.state.lora_name = model
        return model
    raise APIError(404, f"The model `{model}` does not exist.", "model",
                   "invalid_request_error", "model_not_found")


def default_max_tokens(request: Request, requested: int | None, prompt_len: int) -> int:
    """OpenAI's chat default: whatever room the context leaves."""
    if requested is not None:
        return requested
    return max(1, engine(request).core.max_model_len - prompt_len)
