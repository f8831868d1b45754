"""The `Host` header check: a web page must not reach a server on localhost by DNS rebinding.

A page on `evil.example` can make its own name resolve to 127.0.0.1 and then call this
server from the victim's browser as a same-origin request: the browser sends
`Host: evil.example:8000`, which is how the server tells it apart from a local client.
So while the server listens on a loopback address, a request is served only when its
Host names loopback (`localhost`, `127.0.0.1`, `[::1]`, any port) or a name in
`--allowed-hosts`; anything else gets a 400 in the OpenAI error shape. A server that
listens on another address is reached by names the operator chooses, so there the
check applies only when `--allowed-hosts` is given; `*` turns it off everywhere.

A request without a Host header (HTTP/1.0) is served: browsers always send one.
Pure ASGI, like the request-id middleware, so streamed responses are untouched.
"""

from __future__ import annotations

import ipaddress
import json

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from app.server.errors import error_body

LOOPBACK_NAMES = ("localhost",)


def hostname(host_header: str) -> str:
    """'[::1]:8000' -> '::1', 'LocalHost.:80' -> 'localhost'."""
    value = host_header.strip().lower()
    if value.startswith("["):
        value = value[1:].partition("]")[0]
    elif value.count(":") == 1:
        value = value.partition(":")[0]
    return value.rstrip(".")


def is_loopback(name: str) -> bool:
    if name in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def parse_allowed(text: str | None) -> list[str] | None:
    """--allowed-hosts 'a.example,*.corp' -> ['a.example', '*.corp']; '*' -> None (no check)."""
    names = [hostname(n) for n in (text or "").split(",") if n.strip()]
    return None if "*" in names else names


class HostCheckMiddleware:
    def __init__(self, app: ASGIApp, listen_host: str, allowed_hosts: str | None) -> None:
        self.app = app
        self.allowed = parse_allowed(allowed_hosts)
        self.enabled = self.allowed is not None and (
            bool(self.allowed) or is_loopback(hostname(listen_host)))

    def allows(self, host_header: str | None) -> bool:
        if host_header is None:
            return True
        name = hostname(host_header)
        if is_loopback(name) or name in self.allowed:
            return True
        return any(a.startswith("*.") and name.endswith(a[1:]) for a in self.allowed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.enabled:
            await self.app(scope, receive, send)
            return
        given = Headers(scope=scope).get("host")
        if self.allows(given):
            await self.app(scope, receive, send)
            return
        body = json.dumps(error_body(
            f"Host {given[:100]!r} is not allowed: this server answers to loopback names "
            "and --allowed-hosts", "invalid_request_error", None, "invalid_host")).encode()
        await send({"type": "http.response.start", "status": 400,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
