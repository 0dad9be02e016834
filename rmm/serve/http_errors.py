"""Every error the API answers, in one shape: JSON `{"detail": message, "code": short_name}`.

The service raises typed errors (`rmm.serve.errors`, `rmm.errors`); this table gives each its
status code and name, so the routes never build error responses themselves. Errors raised by the
framework keep the shape too: routing (404 unknown path, 405 wrong method, with `Allow`), a body
that is not UTF-8 (422, like any malformed JSON), and anything unexpected (500, no details).
Validation errors (422 `invalid_request`) add `errors`: pydantic's list without the inputs.
401 answers carry `WWW-Authenticate: Bearer` as HTTP requires. A message never repeats more than
`MAX_DETAIL_CHARS` of what the client sent, and a database error never names the database (its
URL, schema or host go to the log, not to the client).

`ErrorBoundary` answers an unexpected exception itself, inside Starlette's outermost middleware:
that one re-raises after answering, and uvicorn then closes the keep-alive connection ("Exception
in ASGI application"), which failed the client's *next* request too.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any
from urllib.parse import unquote_to_bytes

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic_core import PydanticCustomError
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rmm.errors import EncoderUnavailableError, RmmError, UnknownMemoryError, UnknownUserError
from rmm.memory.pg_connect import DatabasePoolExhaustedError, DatabaseUnavailableError
from rmm.memory.store import DuplicateMemoryError
from rmm.memory.tree import UnknownNodeError
from rmm.memory.xpath_syntax import QuerySyntaxError
from rmm.serve.batcher import BatcherClosedError
from rmm.serve.errors import (
    BadRequestError,
    CorruptSelectionError,
    ForbiddenError,
    InvalidApiKeyError,
    MissingApiKeyError,
    NoOpenSessionError,
    NoShadowError,
    SelectionExpiredError,
    SelectionUsedError,
    UnknownJobError,
    UnknownSelectionError,
)
from rmm.serve.records import QueryError, RetrieveItem, RetrieveResult
from rmm.serve.schemas import valid_unicode

__all__ = ["MAX_DETAIL_CHARS", "ErrorBoundary", "classify", "error_response", "install_error_handlers", "json_error",
           "path_error", "shorten", "syntax_error"]

log = logging.getLogger(__name__)

ERRORS: list[tuple[type[BaseException], int, str]] = [
    (MissingApiKeyError, 401, "missing_api_key"),
    (InvalidApiKeyError, 401, "invalid_api_key"),
    (ForbiddenError, 403, "forbidden"),
    (NoShadowError, 404, "no_shadow"),
    (UnknownUserError, 404, "unknown_user"),
    (UnknownMemoryError, 404, "unknown_memory"),
    (UnknownSelectionError, 404, "unknown_selection"),
    (UnknownJobError, 404, "unknown_job"),
    (UnknownNodeError, 404, "unknown_node"),
    (NoOpenSessionError, 404, "no_open_session"),
    (SelectionExpiredError, 410, "selection_expired"),
    # the stored row, not the request: this selection cannot be rewarded (retrieve again); logged for the operator
    (CorruptSelectionError, 410, "selection_corrupt"),
    (SelectionUsedError, 409, "selection_used"),
    (DuplicateMemoryError, 409, "duplicate_memory"),
    (BadRequestError, 422, "bad_request"),
    (QuerySyntaxError, 422, "query_syntax"),  # `errors` carries where (`syntax_error`)
    (BatcherClosedError, 503, "shutting_down"),
    (EncoderUnavailableError, 503, "encoder_unavailable"),
    # the database, not the request: a client may retry (before RmmError's 422 below catches them)
    (DatabasePoolExhaustedError, 503, "database_busy"),
    (DatabaseUnavailableError, 503, "database_unavailable"),
]
MAX_DETAIL_CHARS = 1000  # an error message repeats at most this much (ids in it are the client's own input)
# what a client is told when the database is away: enough to retry, nothing about where it lives
DATABASE_MESSAGES = {
    DatabasePoolExhaustedError: "the database is busy (every connection of this server is in use); retry shortly",
    DatabaseUnavailableError: "the database is unreachable; retry shortly",
}
# the names of the errors FastAPI and Starlette raise themselves (routing, body limit, checks in routes)
HTTP_NAMES = {400: "invalid_request", 401: "unauthorized", 404: "not_found", 405: "method_not_allowed",
              413: "body_too_large", 422: "invalid_request"}


def json_error(status: int, code: str, detail: str, *, headers: Mapping[str, str] | None = None,
               **extra: Any) -> JSONResponse:
    """The API's one error shape (`extra` adds fields, e.g. pydantic's `errors` list)."""
    headers = dict(headers or {})
    detail = shorten(detail)
    if status == 401:
        headers.setdefault("WWW-Authenticate", "Bearer")
    return JSONResponse({"detail": detail, "code": code, **extra}, status_code=status, headers=headers)


def classify(exc: BaseException) -> tuple[int, str, str]:
    """(status, code, message) of an error: a typed one by the table; an unexpected one is logged
    and told as 500 without details."""
    for cls, status, code in ERRORS:
        if isinstance(exc, cls):
            if isinstance(exc, DatabasePoolExhaustedError | DatabaseUnavailableError | CorruptSelectionError):
                # the operator's problem, not the client's: the client sees only a 503 / 410
                log.warning("answered %d %s: %s", status, code, exc)
            if isinstance(exc, DatabaseUnavailableError):
                return status, code, DATABASE_MESSAGES[cls]  # type: ignore[index]
            return status, code, str(exc)
    if isinstance(exc, RmmError | ValueError):
        return 422, "bad_request", str(exc)
    log.error("unexpected error", exc_info=exc)
    return 500, "internal", f"internal error: {type(exc).__name__}"


def error_response(exc: BaseException) -> JSONResponse:
    """The answer to a typed error; an unexpected one is logged and answered 500 without details."""
    status, code, detail = classify(exc)
    if isinstance(exc, QuerySyntaxError):
        return json_error(status, code, detail, errors=[syntax_error(exc)])
    return json_error(status, code, detail)


def syntax_error(exc: QuerySyntaxError) -> dict[str, Any]:
    """Where a Semantic XPath query broke, as one entry of the contract's `errors`: the field
    (`loc`), the message, `offset` (0-based) and `column` (1-based) into the query, what was
    `expected` there and what was `found` (both capped like any detail)."""
    return {"loc": ["query"], "msg": shorten(str(exc)), "type": "query_syntax", "offset": exc.offset,
            "column": exc.column, "expected": shorten(exc.expected), "found": shorten(exc.found)}


def per_query_results(items: list[RetrieveItem], answers: list[RetrieveResult | BaseException]
                      ) -> list[RetrieveResult]:
    """A batch's answers with each failed query as a result carrying its own `error` (status, code,
    capped detail), the server's and the embedded API's one rule; when every query failed, the
    first failure is raised (a batch of one answers as a single request would)."""
    if all(isinstance(a, BaseException) for a in answers):
        raise answers[0]  # type: ignore[misc]
    results = []
    for item, answer in zip(items, answers):
        if isinstance(answer, BaseException):
            status, code, detail = classify(answer)
            answer = RetrieveResult(user=item.user, query=item.query, selection_id=None, explore=item.explore,
                                    expires_at=None, memories=[], error=QueryError(status, code, shorten(detail)))
        results.append(answer)
    return results


def shorten(detail: str) -> str:
    """At most `MAX_DETAIL_CHARS` of a message (the rest replaced by its length)."""
    if len(detail) <= MAX_DETAIL_CHARS:
        return detail
    return f"{detail[:MAX_DETAIL_CHARS]}… ({len(detail)} characters, shortened)"


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


def path_error(scope: Scope) -> str | None:
    """Why a request's path is refused, or None: a percent-encoded byte sequence that is not UTF-8
    (`%ff`) would reach the routes as U+FFFD, so `/users/%ff` and `/users/%fe` named one user."""
    raw = scope.get("raw_path")
    if not raw:
        return None
    try:
        unquote_to_bytes(raw.decode("latin-1")).decode("utf-8")
    except UnicodeDecodeError as exc:
        return (f"path: not valid UTF-8 after percent-decoding (byte 0x{exc.object[exc.start]:02x} at position "
                f"{exc.start}); ids in a path are UTF-8, percent-encoded")
    return None


class ErrorBoundary:
    """Pure ASGI middleware just outside the routes: an exception no handler took becomes the
    contract's 500 (logged with its traceback) and is not re-raised, so the connection stays open."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refused = path_error(scope)
        if refused is not None:
            await json_error(422, "invalid_request", refused)(scope, receive, send)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:
            if started:  # half an answer is out: nothing sound can follow on this connection
                raise
            await error_response(exc)(scope, receive, send)


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
    app.add_exception_handler(Exception, on_typed)  # for errors outside `ErrorBoundary` (the outer middleware)
    app.add_middleware(ErrorBoundary)  # added first: the innermost middleware, so the gate and metrics see its 500
