"""The aiohttp client SDK for Ridgeline and any OpenAI-compatible server.

It imports nothing else of Ridgeline and no torch: the light install
(`pip install ridgeline`, without the `engine` extra) is this SDK and
`ridgeline bench serve`.
"""

from app.client.client import AsyncClient, parse_retry_after
from app.client.types import (
    APIConnectionError,
    APIStatusError,
    APIStreamError,
    APITimeoutError,
    Call,
    ClientError,
    Completion,
    Delta,
    Stream,
    Usage,
)

__all__ = ["APIConnectionError", "APIStatusError", "APIStreamError", "APITimeoutError",
           "AsyncClient", "Call", "ClientError", "Completion", "Delta", "Stream", "Usage",
           "parse_retry_after"]
