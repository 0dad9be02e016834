"""Uvicorn's HTTP protocol with the error contract's JSON for requests it cannot parse.

A request that breaks HTTP itself (`Content-Length: -5`, a malformed request line) never reaches
the app: uvicorn's parser answers it with a `text/plain` 400 of its own. Every other error of the
server is `{"detail": ..., "code": ...}`, so a client parses one shape; this subclass of uvicorn's
protocol (passed as `uvicorn.Config(http=...)`, its documented way to choose a protocol class)
writes that shape instead, and still closes the connection, as uvicorn does, since the stream's
framing is lost.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["MALFORMED_CODE", "json_error_protocol"]

MALFORMED_CODE = "malformed_http"


def _body(msg: str) -> bytes:
    return json.dumps({"detail": f"malformed HTTP request: {msg}", "code": MALFORMED_CODE}).encode()


def json_error_protocol() -> type[Any]:
    """Uvicorn's httptools protocol (h11's where httptools is missing) answering unparseable
    requests with the contract's JSON 400."""
    try:
        from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
    except ImportError:  # no httptools: the pure-Python h11 protocol
        import h11
        from uvicorn.protocols.http.h11_impl import H11Protocol

        class JsonErrorH11Protocol(H11Protocol):
            def send_400_response(self, msg: str) -> None:
                body = _body(msg)
                headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                           (b"connection", b"close")]
                self.transport.write(self.conn.send(h11.Response(status_code=400, headers=headers)))
                self.transport.write(self.conn.send(h11.Data(data=body)))
                self.transport.close()

        return JsonErrorH11Protocol

    class JsonErrorHttpToolsProtocol(HttpToolsProtocol):
        def send_400_response(self, msg: str) -> None:
            body = _body(msg)
            content = [STATUS_LINE[400]]
            for name, value in self.server_state.default_headers:
                content.extend([name, b": ", value, b"\r\n"])
            content.extend([b"content-type: application/json\r\n",
                            b"content-length: " + str(len(body)).encode("ascii") + b"\r\n",
                            b"connection: close\r\n", b"\r\n", body])
            self.transport.write(b"".join(content))
            self.transport.close()

    return JsonErrorHttpToolsProtocol
