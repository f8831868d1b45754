"""Who may call what: `--api-key` for clients, `--admin-api-key` for the operator.

SGLang's split. Client routes (generation, tokens, models, `/plan`) take the API key
when one is set, or the admin key. Operator routes act on every client's work:
`/reset_prefix_cache` (all cached prefixes; also a timing oracle for what others sent),
and the cross-client part of `/abort_request` (abort by a client-chosen id, or
`abort_all`). With `--admin-api-key` set, an operator route wants that key: none or a
wrong one is a 401, the client key a 403. Without it, operator routes take the client
key as before, but the cross-client aborts are refused: only an admin key grants them.
`/health` and `/metrics` stay open (probes and scrapers carry no key).

Keys come as `Authorization: Bearer KEY` (the scheme in any case, as RFC 9110 has it:
clients send `bearer` too), or on Anthropic's routes as `x-api-key: KEY` (what its
clients send). Keys are compared in constant time.
"""

from __future__ import annotations

import hashlib
import hmac

from starlette.requests import Request

from app.config import ServerSettings
from app.server.errors import APIError


def _bearer_token(header: str) -> str:
    """The credentials of an `Authorization` header of the Bearer scheme, "" for any
    other: the scheme is case-insensitive, and one or more spaces follow it."""
    scheme, _, token = header.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def _matches(token: str, key: str | None) -> bool:
    return bool(key) and bool(token) and hmac.compare_digest(token.encode(), key.encode())


def authorize(request: Request, settings: ServerSettings, operator: bool = False,
              key_header: str | None = None) -> None:
    """Raise the 401/403 this request earns; note on it whether it carries the admin key.
    `key_header`: a header that may carry the bare key instead (Anthropic's `x-api-key`)."""
    header = request.headers.get("authorization", "")
    given = _bearer_token(header)
    if not header and key_header and request.headers.get(key_header):
        given = request.headers[key_header].strip()
    admin = _matches(given, settings.admin_api_key)
    request.state.admin = admin
    if admin:
        return
    client = _matches(given, settings.api_key)
    if operator and settings.admin_api_key:
        if client:
            raise APIError(403, f"{request.url.path} is an operator route: it needs the "
                           "admin key", None, "permission_error", "admin_key_required")
        raise APIError(401, "missing or invalid admin API key", None, "authentication_error",
                       "invalid_api_key")
    if settings.api_key and not client:
        raise APIError(401, "missing or invalid API key", None, "authentication_error",
                       "invalid_api_key")


def tenant_of(request: Request) -> str:
    """Whose state this request may see (`docs/robustness.md`, tenants): a digest of the
    key it presented (its Bearer token, else its `x-api-key`), "" for none. The raw key
    is never kept."""
    header = request.headers.get("authorization", "")
    key = _bearer_token(header) if header else request.headers.get("x-api-key", "").strip()
    return hashlib.sha256(key.encode()).hexdigest() if key else ""


def is_admin(request: Request) -> bool:
    """Whether the request carried `--admin-api-key` (never true when none is set)."""
    return getattr(request.state, "admin", False)
