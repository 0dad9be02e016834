"""Every error the API answers, in one shape: JSON `{"detail": message, "code": short_name}`.

The service raises typed errors (`rmm.serve.errors`, `rmm.errors`); this table gives each its
status code and name, so the routes never build error responses themselves. Errors raised by the
framework keep the shape too: routing (404 unknown path, 405 wrong method, with `Allow`), a body
that is not UTF-8 (422, like any malformed JSON), and anything unexpected (500, no details).
Validation errors (422 `invalid_request`) add `errors`: pydantic's list without the inputs.
401 answers carry `WWW-Authenticate: Bearer` as HTTP requires.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic_core import PydanticCustomError
from starlette.exceptions import HTTPException

from rmm.errors import EncoderUnavailableError, RmmError, UnknownMemoryError, UnknownUserError
from rmm.memory.pg_connect import DatabasePoolExhaustedError, DatabaseUnavailableError
from rmm.memory.store import DuplicateMemoryError
from rmm.serve.batcher import BatcherClosedError
from rmm.serve.errors import (
    BadRequestError,
    CorruptSelectionError,
    InvalidApiKeyError,
    MissingApiKeyError,
    NoOpenSessionError,
    SelectionExpiredError,
    SelectionUsedError,
    UnknownJobError,
    UnknownSelectionError,
)
from rmm.serve.schemas import valid_unicode

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
    # the stored row, not the request: this selection cannot be rewarded (retrieve again); logged for the operator
    (CorruptSelectionError, 410, "selection_corrupt"),
    (SelectionUsedError, 409, "selection_used"),
    (DuplicateMemoryError, 409, "duplicate_memory"),
    (BadRequestError, 422, "bad_request"),
    (BatcherClosedError, 503, "shutting_down"),
    (EncoderUnavailableError, 503, "encoder_unavailable"),
    # the database, not the request: a client may retry (before RmmError's 422 below catches them)
    (DatabasePoolExhaustedError, 503, "database_busy"),
    (DatabaseUnavailableError, 503, "database_unavailable"),
]
# the names of the errors FastAPI and Starlette raise themselves (routing, body limit, checks in routes)
HTTP_NAMES = {400: "invalid_request", 401: "unauthorized", 404: "not_found", 405: "method_not_allowed",
              413: "body_too_large", 422: "invalid_request"}


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
            if isinstance(exc, DatabasePoolExhaustedError | DatabaseUnavailableError | CorruptSelectionError):
                # the operator's problem, not the client's: the client sees only a 503 / 410
                log.warning("answered %d %s: %s", status, code, exc)
            return json_error(status, code, str(exc))
    if isinstance(exc, RmmError | ValueError):
        return json_error(422, "bad_request", str(exc))
    log.error("unexpected error", exc_info=exc)
    return json_error(500, "internal", f"internal error: {type(exc).__name__}")


def _where(error: Mapping[str, Any]) -> str:
    return ".".join(str(x) for x in error.get("loc", ()) if x != "body") or "body"


def _message(error: Mapping[str, Any]) -> str:
    message = str(error.get("msg", "invalid"))
    if error.get("type") == "json_invalid":
        return f"body is not valid JSON ({error.get('ctx', {}).get('error', 'decode error')})"
    if error.get("type") == "string_unicode" and isinstance(error.get("input"), str):
        try:  # pydantic's own check (constrained fields) says "unable to parse raw data"; say what and where
            valid_unicode(error["input"])
        except PydanticCustomError as refused:
            return refused.message()
    return message


def describe_validation(exc: RequestValidationError) -> str:
    """Pydantic's errors as one line a caller can act on: `where: what` for each."""
    return "; ".join(f"{_where(error)}: {_message(error)}" for error in exc.errors()) or "invalid request"


def validation_errors(exc: RequestValidationError) -> list[dict[str, Any]]:
    """The errors as data, without the offending inputs: they can be large, and a lone surrogate
    among them could not even be written out as UTF-8."""
    return [{"loc": [str(x) for x in error.get("loc", ())], "msg": _message(error), "type": str(error.get("type"))}
            for error in exc.errors()]


def describe_http(exc: HTTPException, request: Request) -> tuple[int, str]:
    """Status and message of a framework error: a body that cannot be decoded is malformed (422)."""
    cause = exc.__cause__
    if exc.status_code == 400 and isinstance(cause, UnicodeDecodeError):
        return 422, (f"body: not valid UTF-8 (byte 0x{cause.object[cause.start]:02x} at position {cause.start}); "
                     "send JSON encoded as UTF-8")
    if exc.status_code == 400:
        return 422, f"body: cannot be parsed ({type(cause).__name__ if cause else exc.detail})"
    if exc.status_code == 404 and exc.detail == "Not Found":
        return 404, f"no such endpoint: {request.method} {request.url.path} (see /docs)"
    if exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow")
        return 405, f"{request.method} is not allowed on {request.url.path}" + (f"; use {allowed}" if allowed else "")
    return exc.status_code, str(exc.detail)


def install_error_handlers(app: FastAPI) -> None:
    """Route every error an app can raise through `json_error`."""

    async def on_validation(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return json_error(422, "invalid_request", describe_validation(exc), errors=validation_errors(exc))

    async def on_http(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)  # Starlette's: routing raises it, FastAPI's derives from it
        status, detail = describe_http(exc, request)
        return json_error(status, HTTP_NAMES.get(status, "error"), detail, headers=exc.headers)

    async def on_typed(_request: Request, exc: Exception) -> JSONResponse:
        return error_response(exc)

    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(HTTPException, on_http)
    for cls in (RmmError, ValueError, BatcherClosedError):
        app.add_exception_handler(cls, on_typed)
    app.add_exception_handler(Exception, on_typed)  # the last resort: 500 `internal`, logged, no details
