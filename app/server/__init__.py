"""The OpenAI-compatible HTTP server over one `AsyncEngine` (see `app.py`)."""

from app.config import ServerSettings
from app.server.app import build_app, run_server, uvicorn_config

__all__ = ["ServerSettings", "build_app", "run_server", "uvicorn_config"]
