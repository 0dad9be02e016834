"""Every error the API answers, in one shape: JSON `{"detail": message, "code": short_name}`.

The service raises typed errors (`rmm.serve.errors`, `rmm.errors`); this table gives each its
status code and name, so the routes never build error responses themselves. 401 answers carry
`WWW-Authenticate: Bearer` as HTTP requires.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from rmm.errors import RmmError, UnknownMemoryError, UnknownUserError
from rmm.memory.store import DuplicateMemoryError
from rmm.serve.batcher import BatcherClosedError
from rmm.serve.errors import (
    BadRequestError,
    InvalidApiKeyError,
    MissingApiKeyError,
    NoOpenSessionError,
    SelectionExpiredError,
    SelectionUsedError,
    UnknownJobError,
    UnknownSelectionError,
)

__all__ = ["error_response", "install_error_handlers", "json_error"]

log = logging.getLogger(__name__)

ERRORS: list[tuple[type[BaseException], int, str]] = [
    (MissingApiKeyError, 401, "missing_api_key"),
    (InvalidApiKeyError, 401, "invalid_api_key"),
    (UnknownUserError, 404, "unknown_user"),
    (UnknownMemoryError, 404, "unknown_memory"),
    (UnknownSelectionError, 404, "unknown_selection"),
    (UnknownJobError, 404, "unknown_job"),
    (NoOpenSessionError, 404, "no_open_session"),
    (SelectionExpiredError, 410, "selection_expired"),
    (SelectionUsedError, 409, "selection_used"),
    (DuplicateMemoryError, 409, "duplicate_memory"),
    (BadRequestError, 422, "bad_request"),
    (BatcherClosedError, 503, "shutting_down"),
]
# the names of the errors FastAPI and Starlette raise themselves (routing, body limit, checks in routes)
HTTP_NAMES = {401: "unauthorized", 404: "not_found", 405: "method_not_allowed", 413: "body_too_large",
              422: "invalid_request"}


def json_error(status: int, code: str, detail: str, *, headers: Mapping[str, str] | None = None,
               **extra: Any) -> JSONResponse:
    """The API's one error shape (`extra` adds fields, e.g. pydantic's `errors` list)."""
    headers = dict(headers or {})
    if status == 401:
        headers.setdefault("WWW-Authenticate", "Bearer")
    return JSONResponse({"detail": detail, "code": code, **extra}, status_code=status, headers=headers)


def error_response(exc: BaseException) -> JSONResponse:
    """The answer to a typed error; an unexpected one is logged and answered 500 without details."""
    for cls, status, code in ERRORS:
        if isinstance(exc, cls):
            return json_error(status, code, str(exc))
    if isinstance(exc, RmmError | ValueError):
        return json_error(422, "bad_request", str(exc))
    log.error("unexpected error", exc_info=exc)
    return json_error(500, "internal", f"internal error: {type(exc).__name__}")


def describe_validation(exc: RequestValidationError) -> str:
    """Pydantic's errors as one line a caller can act on: `where: what` for each."""
    parts = []
    for error in exc.errors():
        where = ".".join(str(x) for x in error.get("loc", ()) if x != "body") or "body"
        message = error.get("msg", "invalid")
        if error.get("type") == "json_invalid":
            message = f"body is not valid JSON ({error.get('ctx', {}).get('error', 'decode error')})"
            where = "body"
        parts.append(f"{where}: {message}")
    return "; ".join(parts) or "invalid request"


def install_error_handlers(app: FastAPI) -> None:
    """Route every error an app can raise through `json_error`."""

    async def on_validation(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return json_error(422, "invalid_request", describe_validation(exc),
                          errors=json.loads(json.dumps(exc.errors(), default=str)))

    async def on_http(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        return json_error(exc.status_code, HTTP_NAMES.get(exc.status_code, "error"), exc.detail,
                          headers=getattr(exc, "headers", None))

    async def on_typed(_request: Request, exc: Exception) -> JSONResponse:
        return error_response(exc)

    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(HTTPException, on_http)
    for cls in (RmmError, ValueError, BatcherClosedError):
        app.add_exception_handler(cls, on_typed)
