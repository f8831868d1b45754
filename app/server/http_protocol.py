"""uvicorn's httptools protocol with a deadline for a request's headers.

uvicorn times out an idle keep-alive connection, but a client that sends its headers
one byte at a time (slowloris) holds a connection, and a slot of every limit above
it, for as long as it likes. Here each request's headers must be complete within
`header_timeout` seconds of its first byte (of the connection, for the first
request); otherwise the server answers 408 and closes.
"""

from __future__ import annotations

import asyncio
import json

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

_BODY = json.dumps({"error": {"message": "request headers not received in time",
                              "type": "invalid_request_error", "param": None,
                              "code": "request_timeout"}}).encode()
_RESPONSE = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
             b"connection: close\r\ncontent-length: " + str(len(_BODY)).encode()
             + b"\r\n\r\n" + _BODY)


def with_header_timeout(seconds: float) -> type[HttpToolsProtocol]:
    """The protocol class to pass as uvicorn's `http=`."""

    class HeaderTimeoutProtocol(HttpToolsProtocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if self._header_timer is None:
                self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._header_timer = self.loop.call_later(seconds, self._too_slow)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _too_slow(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                self.transport.write(_RESPONSE)
                self.transport.close()

    return HeaderTimeoutProtocol
