"""The chat page at `/`: what a user opens first, and the KV pool at a glance.

Three files shipped in the package (`app/server/web/`: HTML, CSS, JS; no build step,
nothing fetched from elsewhere). The page streams answers over `/v1/chat/completions`,
so closing the tab, reloading or its Stop button aborts the request as any client's
dropped connection does, and polls `/metrics` for the pool. Each file is sent with a
Content-Security-Policy that allows scripts, styles and requests from this origin
alone: with every user and model text set as text by the page, a message holding markup
creates no element and runs nothing. The page carries no secret: with `--api-key` it
asks for the key and sends it as a Bearer token, so the API stays closed without it.
`--disable-web-ui` turns the page off.
"""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

WEB = Path(__file__).parent / "web"
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
       "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
FILES = {"/": ("index.html", "text/html; charset=utf-8"),
         "/ui/app.js": ("app.js", "text/javascript; charset=utf-8"),
         "/ui/app.css": ("app.css", "text/css; charset=utf-8")}


async def page(request: Request) -> Response:
    name, content_type = FILES[request.url.path]
    return Response((WEB / name).read_bytes(), headers={
        "Content-Type": content_type, "Content-Security-Policy": CSP,
        "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"})


ROUTES = [Route(path, page, methods=["GET", "HEAD"]) for path in FILES]
