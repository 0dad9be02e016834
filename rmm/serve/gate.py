"""The two checks that must run before FastAPI reads a request body (pure ASGI middleware).

FastAPI reads and parses the whole body before it runs any dependency, so these cannot be
dependencies:

- **strangers are refused unread**: a `/v1` request without a valid API key gets 401 before its
  body is received, so a caller without a key spends no server memory or parsing and learns
  nothing but "401" (a malformed body from a stranger is 401, not 422). The `deps.Tenant` dependency
  then resolves the key for the route the usual way.
- **bodies over `limits.max_request_bytes` get 413**: by their Content-Length before reading, and
  while streaming when there is none (FastAPI >= 0.110, which the project supports, has no body
  limit of its own).

Everything else (routing, validation, tenant resolution, errors) is FastAPI's.
"""

from __future__ import annotations

from typing import Any

from fastapi import HTTPException, status
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rmm.errors import RmmError
from rmm.serve.deps import api_key, tenant_of
from rmm.serve.http_errors import error_response, json_error
from rmm.serve.service import RetrievalService

__all__ = ["RequestGate"]


class RequestGate:
    """Refuses keyless `/v1` requests and oversized bodies before the app reads them."""

    def __init__(self, app: ASGIApp, service: RetrievalService, max_bytes: int, guarded_prefix: str = "/v1/") -> None:
        self.app, self.service, self.max_bytes, self.guarded_prefix = app, service, max_bytes, guarded_prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if scope.get("path", "").startswith(self.guarded_prefix):
            try:
                tenant_of(self.service, api_key(headers))
            except RmmError as refused:
                await error_response(refused)(scope, receive, send)
                return
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_bytes:
            await json_error(413, "body_too_large", f"request body of {int(length)} bytes exceeds the limit of "
                                                    f"{self.max_bytes} bytes")(scope, receive, send)
            return
        await self.app(scope, self._limited(receive), send)

    def _limited(self, receive: Receive) -> Receive:
        """`receive` that fails with 413 once the streamed body passes the limit."""
        received = 0

        async def limited() -> Message:
            nonlocal received
            message: Any = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:  # FastAPI re-raises an HTTPException met while reading
                    raise HTTPException(status.HTTP_413_CONTENT_TOO_LARGE,
                                        f"request body exceeds the limit of {self.max_bytes} bytes")
            return message

        return limited
