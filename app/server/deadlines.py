"""A request's deadlines, from its headers and the server's defaults (see
`app/engine/admission.py` for what the engine does with them).

| header | meaning |
| --- | --- |
| `X-Request-Timeout: S` | the client gives up after S seconds without a byte |
| `x-stainless-read-timeout: S` | the same, as the openai SDK sends it on every request |
| `X-SLO-TTFT-Ms: MS` | time-to-first-token target (default `--slo-ttft-ms`) |
| `X-SLO-TPOT-Ms: MS` | time-per-output-token target (default `--slo-tpot-ms`) |

The first token is due at the earliest of: arrival + client timeout, arrival +
`--max-queue-time`, arrival + TTFT target. When the answer comes in one piece (not
streamed) and the client chose its `max_tokens`, the client's timeout is also when the
whole answer is due (`RequestSLO.deadline`): that needs no flag. A streamed request's
timeout bounds the wait for each byte, so only its first token is due; and an answer of
unchosen length (chat without `max_tokens`: the room the context leaves) has no end the
server could predict, so the openai SDK's 600 s on every request refuses no ordinary one.
"""

from __future__ import annotations

import math
import time

from starlette.requests import Request

from app.config import ServerSettings
from app.engine.request import RequestSLO
from app.server.errors import APIError

TIMEOUT_HEADERS = ("x-request-timeout", "x-stainless-read-timeout")


def _seconds(request: Request, header: str, scale: float = 1.0) -> float | None:
    raw = request.headers.get(header)
    if raw is None:
        return None
    try:
        value = float(raw) * scale
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise APIError(400, f"header {header} must be a positive number, got {raw[:40]!r}",
                       header)
    return value


def request_slo(request: Request, settings: ServerSettings,
                whole_answer: bool = False) -> RequestSLO | None:
    """`whole_answer`: the answer is one piece of a length the client chose, so its
    timeout bounds the whole request."""
    arrival = time.monotonic()
    timeout = next((t for h in TIMEOUT_HEADERS if (t := _seconds(request, h)) is not None),
                   None)
    ttft = _seconds(request, "x-slo-ttft-ms", 1e-3)
    if ttft is None and settings.slo_ttft_ms is not None:
        ttft = settings.slo_ttft_ms * 1e-3
    tpot = _seconds(request, "x-slo-tpot-ms", 1e-3)
    if tpot is None and settings.slo_tpot_ms is not None:
        tpot = settings.slo_tpot_ms * 1e-3
    limits = [t for t in (timeout, settings.max_queue_time, ttft) if t is not None]
    deadline = arrival + timeout if whole_answer and timeout is not None else None
    if not limits and tpot is None:
        return None
    return RequestSLO(arrival + min(limits) if limits else None, tpot, deadline)
