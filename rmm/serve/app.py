"""The HTTP API of `rmm serve` (FastAPI; interactive docs at /docs, schema at /openapi.json).

Every `/v1` route needs an API key (`Authorization: Bearer KEY` or `X-API-Key: KEY`), checked
before the body is even read, so a caller without a key learns nothing but "401". The key names
the tenant; users, selections and jobs of other tenants answer 404 exactly like ids that never
existed. Errors are JSON `{"detail": message, "code": short_name}`: 401 no/invalid key, 404
unknown user/memory/selection/job, 409 duplicate memory id or feedback given twice, 410 expired
selection, 413 body too large, 422 malformed or impossible request, 503 shutting down.
`/health` and `/metrics` (Prometheus text format) need no key and show no tenant's data.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Path, Request, Security, status
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.security import APIKeyHeader, HTTPBearer
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from pydantic import BaseModel, ConfigDict, Field

from rmm.errors import RmmError, UnknownMemoryError, UnknownUserError
from rmm.memory.store import DuplicateMemoryError
from rmm.serve.batcher import BatcherClosedError, MicroBatcher
from rmm.serve.config import ServeConfig
from rmm.serve.errors import (
    BadRequestError,
    NoOpenSessionError,
    SelectionExpiredError,
    SelectionUsedError,
    UnknownJobError,
    UnknownSelectionError,
)
from rmm.serve.jobs import Job
from rmm.serve.service import (
    FeedbackResult,
    NewMemory,
    RetrievalService,
    RetrieveItem,
    RetrieveResult,
    WriteItem,
)
from rmm.types import MEMORY_KINDS, Turn

__all__ = ["create_app"]

log = logging.getLogger(__name__)

API_VERSION = "v1"
USER_PATTERN = r"^[^/\x00-\x1f]{1,256}$"
UserId = Annotated[str, Field(pattern=USER_PATTERN, description="a user id of your tenant (1-256 chars, no '/')")]
UserPath = Annotated[str, Path(pattern=USER_PATTERN, description="a user id of your tenant")]


# ---- request and response bodies ----------------------------------------------------------------
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class MemoryIn(_Strict):
    text: str = Field(min_length=1, description="what is embedded and shown to the LLM")
    kind: str = Field("turn", description=f"one of {list(MEMORY_KINDS)}")
    id: str | None = Field(None, min_length=1, max_length=256, description="default: a new random id")
    refs: list[str] = Field(default_factory=list, description="dialogue turn ids this memory came from")
    source_text: str = ""
    time: str | None = None


class AddMemoriesIn(_Strict):
    memories: list[MemoryIn] = Field(min_length=1)


class AddMemoriesOut(BaseModel):
    user: str
    ids: list[str]


class MemoryOut(BaseModel):
    id: str
    kind: str
    text: str
    refs: list[str]
    source_text: str
    created_at: float
    updated_at: float
    time_span: tuple[str | None, str | None] | None


class MemoriesOut(BaseModel):
    user: str
    memories: list[MemoryOut]


class UsersOut(BaseModel):
    users: list[str]


class TurnIn(_Strict):
    speaker: str = Field(min_length=1, max_length=256)
    text: str = Field(min_length=1)
    time: str | None = None
    id: str | None = Field(None, description="for whole sessions only; default: <session id>:<position>")


class AddTurnsIn(_Strict):
    turns: list[TurnIn] = Field(min_length=1)


class AddTurnsOut(BaseModel):
    user: str
    session_id: str
    turn_ids: list[str]


class EndSessionIn(_Strict):
    speakers: list[str] | None = Field(None, description="whose facts to extract (default: every speaker "
                                                         "except the configured assistant names)")
    store_turns: bool = Field(False, description="also store each raw turn as a turn memory")


class AddSessionIn(EndSessionIn):
    turns: list[TurnIn] = Field(min_length=1)
    session_id: str | None = None
    time: str | None = None


class JobOut(BaseModel):
    job_id: str
    user: str
    kind: str
    status: str
    created_at: float
    started_at: float | None
    finished_at: float | None
    result: dict[str, Any]
    error: str | None


class QueryIn(_Strict):
    user: UserId
    query: str = Field(min_length=1)
    k: int | None = Field(None, ge=1, description="candidates retrieved (default: the server's k)")
    m: int | None = Field(None, ge=1, description="memories shown (default: the server's m)")
    explore: bool | None = Field(None, description="Gumbel-sample the M (learning) or take the top-M")


class RetrieveIn(_Strict):
    queries: list[QueryIn] = Field(min_length=1)


class ShownOut(BaseModel):
    index: int
    id: str
    text: str
    kind: str
    refs: list[str]
    score: float
    retriever_score: float
    time_span: tuple[str | None, str | None] | None


class ResultOut(BaseModel):
    user: str
    query: str
    selection_id: str | None
    explore: bool
    expires_at: float | None
    memories: list[ShownOut]


class RetrieveOut(BaseModel):
    results: list[ResultOut]


class FeedbackIn(_Strict):
    selection_id: str = Field(min_length=1)
    cited: list[int] | None = Field(None, description="indices (0-based, as shown) of the memories the answer used")
    text: str | None = Field(None, description="the LLM's raw reply; citations are parsed from it")
    no_cite: bool = Field(False, description="the answer used none of the shown memories")
    structured: bool = Field(False, description="`text` is the JSON {answer, citations} form")


class FeedbackOut(BaseModel):
    selection_id: str
    rewards: list[float] | None
    cited: list[int] | None
    no_cite: bool
    warnings: list[str]
    updated: bool
    loss: float | None
    learner_step: int
    learner_records: int


class DeleteMemoryOut(BaseModel):
    user: str
    memory_id: str
    selections_dropped: int


class DeleteUserOut(BaseModel):
    user: str
    memories: int
    selections: int
    session_turns: int
    jobs_cancelled: int


class HealthOut(BaseModel):
    status: str
    encoder: str
    dim: int
    batching: bool
    max_batch: int
    max_wait_ms: float


# ---- metrics ------------------------------------------------------------------------------------
class _Metrics:
    """One registry per app, so several apps (tests) never share counters."""

    def __init__(self, service: RetrievalService) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("rmm_http_requests", "HTTP requests", ["method", "route", "status"], registry=r)
        self.latency = Histogram("rmm_http_request_seconds", "HTTP request latency", ["route"], registry=r,
                                 buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
        self.batch_size = Histogram("rmm_batch_size", "queries per batched retrieval call", registry=r,
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512))
        self.batch_seconds = Histogram("rmm_batch_seconds", "time of one batched retrieval call", registry=r,
                                       buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))
        self.queries = Counter("rmm_retrieve_queries", "retrieve queries answered", registry=r)
        self.feedback = Counter("rmm_feedback", "feedback received", ["outcome"], registry=r)
        self.updates = Counter("rmm_learner_updates", "reranker optimizer steps from feedback", registry=r)
        self.memories = Counter("rmm_memories_added", "memories stored through the API", registry=r)
        r.register(_ServiceCollector(service))

    def on_batch(self, size: int, seconds: float) -> None:
        self.batch_size.observe(size)
        self.batch_seconds.observe(seconds)


class _ServiceCollector:
    """Gauges read at scrape time from the service's own state."""

    def __init__(self, service: RetrievalService) -> None:
        self.service = service

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Any:
        stats = self.service.stats()
        pending = GaugeMetricFamily("rmm_pending_selections", "selections waiting for feedback")
        pending.add_metric([], stats["pending_selections"])
        yield pending
        jobs = GaugeMetricFamily("rmm_jobs", "reflection jobs by status", labels=["status"])
        for state, n in stats["jobs"].items():
            jobs.add_metric([state], n)
        yield jobs
        step = GaugeMetricFamily("rmm_learner_step", "optimizer steps of each reranker", labels=["reranker"])
        records = GaugeMetricFamily("rmm_learner_records", "rewarded selections recorded", labels=["reranker"])
        for key, s in stats["learners"].items():
            label = key if self.service.config.reranker_per != "user" else "user"
            step.add_metric([label], s["step"])
            records.add_metric([label], s["records"])
        yield step
        yield records


# ---- the gate: auth, size limits, metrics (pure ASGI: runs before the body is read) -------------
Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


class _Gate:
    def __init__(self, app: Any, service: RetrievalService, metrics: _Metrics, max_bytes: int) -> None:
        self.app, self.service, self.metrics, self.max_bytes = app, service, metrics, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status_code = [500]

        async def send_recording(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status_code[0] = int(message["status"])
            await send(message)

        try:
            await self._handle(scope, receive, send_recording)
        finally:
            route = scope.get("route")
            label = getattr(route, "path", None) or "unmatched"
            self.metrics.requests.labels(scope.get("method", ""), label, str(status_code[0])).inc()
            self.metrics.latency.labels(label).observe(time.perf_counter() - started)

    async def _handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope.get("path", "")
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if path.startswith(f"/{API_VERSION}/"):
            key = _api_key(headers)
            if key is None:
                await _send_error(send, 401, "missing_api_key",
                                  "missing API key: send 'Authorization: Bearer KEY' or 'X-API-Key: KEY'")
                return
            tenant = self.service.tenant_for_key(key)
            if tenant is None:
                await _send_error(send, 401, "invalid_api_key", "invalid API key")
                return
            scope.setdefault("state", {})["tenant"] = tenant
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await _send_error(send, 413, "body_too_large",
                              f"request body of {int(length)} bytes exceeds the limit of {self.max_bytes} bytes")
            return
        received = 0

        async def limited() -> MutableMapping[str, Any]:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise HTTPException(status.HTTP_413_CONTENT_TOO_LARGE,
                                        f"request body exceeds the limit of {self.max_bytes} bytes")
            return message

        await self.app(scope, limited, send)


def _api_key(headers: dict[str, str]) -> str | None:
    auth = headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    key = headers.get("x-api-key", "").strip()
    return key or None


async def _send_error(send: Send, code: int, name: str, message: str) -> None:
    body = json.dumps({"detail": message, "code": name}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if code == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": code, "headers": headers})
    await send({"type": "http.response.body", "body": body})


# ---- error mapping ------------------------------------------------------------------------------
_ERRORS: list[tuple[type[BaseException], int, str]] = [
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


def _error_response(exc: BaseException) -> JSONResponse:
    for cls, code, name in _ERRORS:
        if isinstance(exc, cls):
            return JSONResponse({"detail": str(exc), "code": name}, status_code=code)
    if isinstance(exc, RmmError | ValueError):
        return JSONResponse({"detail": str(exc), "code": "bad_request"}, status_code=422)
    log.error("unexpected error", exc_info=exc)
    return JSONResponse({"detail": f"internal error: {type(exc).__name__}", "code": "internal"}, status_code=500)


def _describe_validation(exc: RequestValidationError) -> str:
    parts = []
    for error in exc.errors():
        where = ".".join(str(x) for x in error.get("loc", ()) if x != "body") or "body"
        message = error.get("msg", "invalid")
        if error.get("type") == "json_invalid":
            message = f"body is not valid JSON ({error.get('ctx', {}).get('error', 'decode error')})"
            where = "body"
        parts.append(f"{where}: {message}")
    return "; ".join(parts) or "invalid request"


def _unprocessable(message: str) -> HTTPException:
    return HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, message)


_bearer = HTTPBearer(auto_error=False, description="API key")
_header_key = APIKeyHeader(name="X-API-Key", auto_error=False, description="API key")


def _tenant(request: Request, _b: Annotated[Any, Security(_bearer)] = None,
            _h: Annotated[Any, Security(_header_key)] = None) -> str:
    """The tenant the gate found for the request's API key (the security params only document it)."""
    found = request.scope.get("state", {}).get("tenant")
    if found is None:  # unreachable behind the gate; refuse rather than serve anonymously
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, "missing API key")
    return found


Tenant = Annotated[str, Depends(_tenant)]


# ---- the app ------------------------------------------------------------------------------------
def create_app(config: ServeConfig, *, service: RetrievalService | None = None, **service_options: Any) -> FastAPI:
    """The API over a `RetrievalService` (built from `config` unless given; `service_options`,
    e.g. `encoder=` or `llm=`, go to its constructor). The lifespan starts the service's background
    work and, at shutdown, drains the batcher and checkpoints the rerankers."""
    service = service if service is not None else RetrievalService(config, **service_options)
    config = service.config
    limits = config.limits
    metrics = _Metrics(service)

    def retrieve_batch(items: list[RetrieveItem]) -> list[RetrieveResult | Exception]:
        return service.retrieve_batch(items)

    batcher: MicroBatcher[RetrieveItem, RetrieveResult] = MicroBatcher(
        retrieve_batch, max_batch=config.batching.max_batch, max_wait_ms=config.batching.max_wait_ms,
        enabled=config.batching.enabled, name="retrieve", on_batch=metrics.on_batch)
    # memory writes are coalesced the same way: one passage encode for every concurrent request
    writes: MicroBatcher[WriteItem, list[str]] = MicroBatcher(
        service.add_memories_batch, max_batch=config.batching.max_batch, max_wait_ms=config.batching.max_wait_ms,
        enabled=config.batching.enabled, name="write")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        service.start()
        log.info("rmm serve ready: bank %s, encoder %s, batching %s (max_batch %d, max_wait %.1f ms)",
                 config.bank_path, service.encoder.name, "on" if config.batching.enabled else "off",
                 config.batching.max_batch, config.batching.max_wait_ms)
        try:
            yield
        finally:
            await batcher.close()
            await writes.close()
            await asyncio.to_thread(service.close)
            log.info("rmm serve stopped; rerankers checkpointed")

    app = FastAPI(title="rmm retrieval server", version=API_VERSION, lifespan=lifespan,
                  description="Batched memory retrieval with a reranker that learns from the LLM's citations. "
                              "Send your API key as `Authorization: Bearer KEY` or `X-API-Key: KEY`.")
    app.add_middleware(_Gate, service=service, metrics=metrics, max_bytes=limits.max_request_bytes)
    app.state.service = service
    app.state.batcher = batcher
    app.state.metrics = metrics

    @app.exception_handler(RequestValidationError)
    async def on_validation(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"detail": _describe_validation(exc), "code": "invalid_request",
                             "errors": json.loads(json.dumps(exc.errors(), default=str))}, status_code=422)

    @app.exception_handler(HTTPException)
    async def on_http(_request: Request, exc: HTTPException) -> JSONResponse:
        names = {401: "unauthorized", 404: "not_found", 405: "method_not_allowed", 413: "body_too_large",
                 422: "invalid_request"}
        return JSONResponse({"detail": exc.detail, "code": names.get(exc.status_code, "error")},
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(RmmError)
    async def on_rmm(_request: Request, exc: RmmError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(ValueError)
    async def on_value(_request: Request, exc: ValueError) -> JSONResponse:
        return _error_response(exc)

    # ---- routes --------------------------------------------------------------------------
    @app.get("/health", response_model=HealthOut, tags=["ops"])
    def health() -> HealthOut:
        return HealthOut(status="ok", encoder=service.encoder.name, dim=service.bank.dim,
                         batching=config.batching.enabled, max_batch=config.batching.max_batch,
                         max_wait_ms=config.batching.max_wait_ms)

    @app.get("/metrics", tags=["ops"], response_class=Response)
    def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def check_count(n: int, limit: int, what: str) -> None:
        if n > limit:
            raise _unprocessable(f"too many {what}: {n} in one request, the limit is {limit}; split the request")

    def check_texts(texts: list[str], where: str) -> None:
        for i, text in enumerate(texts):
            if len(text) > limits.max_text_chars:
                raise _unprocessable(f"{where}[{i}]: text of {len(text)} characters exceeds the limit of "
                                     f"{limits.max_text_chars}")

    @app.get("/v1/users", response_model=UsersOut, tags=["memories"])
    def list_users(tenant: Tenant) -> UsersOut:
        return UsersOut(users=service.users(tenant))

    @app.post("/v1/users/{user}/memories", response_model=AddMemoriesOut, status_code=201, tags=["memories"])
    async def add_memories(user: UserPath, body: AddMemoriesIn, tenant: Tenant) -> AddMemoriesOut:
        """Store memories (encoded, indexed); answered only after the write is durable.
        Concurrent requests are micro-batched into one encode, then committed one by one."""
        check_count(len(body.memories), limits.max_memories, "memories")
        check_texts([m.text for m in body.memories], "memories")
        for i, m in enumerate(body.memories):
            if m.kind not in MEMORY_KINDS:
                raise _unprocessable(f"memories[{i}].kind: must be one of {list(MEMORY_KINDS)}, got {m.kind!r}")
        ids = await writes.submit(WriteItem(tenant, user, [NewMemory(**m.model_dump()) for m in body.memories]))
        metrics.memories.inc(len(ids))
        return AddMemoriesOut(user=user, ids=ids)

    @app.get("/v1/users/{user}/memories", response_model=MemoriesOut, tags=["memories"])
    def list_memories(user: UserPath, tenant: Tenant) -> MemoriesOut:
        return MemoriesOut(user=user, memories=[
            MemoryOut(id=m.id, kind=m.kind, text=m.text, refs=m.refs, source_text=m.source_text,
                      created_at=m.created_at, updated_at=m.updated_at, time_span=m.time_span)
            for m in service.memories(tenant, user)])

    # `:path`: memory ids are the caller's, and may contain "/" (sent percent-encoded)
    @app.delete("/v1/users/{user}/memories/{memory_id:path}", response_model=DeleteMemoryOut, tags=["memories"])
    def delete_memory(user: UserPath, memory_id: str, tenant: Tenant) -> DeleteMemoryOut:
        dropped = service.delete_memory(tenant, user, memory_id)
        return DeleteMemoryOut(user=user, memory_id=memory_id, selections_dropped=dropped)

    @app.delete("/v1/users/{user}", response_model=DeleteUserOut, tags=["memories"])
    def delete_user(user: UserPath, tenant: Tenant) -> DeleteUserOut:
        """Everything of the user: memories, index, pending selections, open session, queued jobs."""
        return DeleteUserOut(user=user, **service.delete_user(tenant, user))

    @app.post("/v1/users/{user}/turns", response_model=AddTurnsOut, status_code=201, tags=["sessions"])
    def add_turns(user: UserPath, body: AddTurnsIn, tenant: Tenant) -> AddTurnsOut:
        """Append turns to the user's open session (kept until the session ends)."""
        check_count(len(body.turns), limits.max_memories, "turns")
        check_texts([t.text for t in body.turns], "turns")
        turns = service.append_turns(tenant, user, [(t.speaker, t.text) for t in body.turns])
        return AddTurnsOut(user=user, session_id=turns[0].session_id, turn_ids=[t.id for t in turns])

    @app.post("/v1/users/{user}/sessions/end", response_model=JobOut, status_code=202, tags=["sessions"])
    def end_session(user: UserPath, tenant: Tenant, body: EndSessionIn | None = None) -> JobOut:
        """Close the open session; prospective reflection turns it into topic memories in the background."""
        body = body or EndSessionIn()
        return _job_out(service.end_session(tenant, user, speakers=body.speakers, store_turns=body.store_turns))

    @app.post("/v1/users/{user}/sessions", response_model=JobOut, status_code=202, tags=["sessions"])
    def add_session(user: UserPath, body: AddSessionIn, tenant: Tenant) -> JobOut:
        """A whole finished session at once (e.g. importing history), reflected in the background."""
        check_count(len(body.turns), limits.max_memories, "turns")
        check_texts([t.text for t in body.turns], "turns")
        turns = [Turn(id=t.id or "", session_id="", speaker=t.speaker, text=t.text, time=t.time) for t in body.turns]
        job = service.add_session(tenant, user, turns, session_id=body.session_id, time_=body.time,
                                  speakers=body.speakers, store_turns=body.store_turns)
        return _job_out(job)

    @app.get("/v1/jobs/{job_id}", response_model=JobOut, tags=["sessions"])
    def get_job(job_id: str, tenant: Tenant) -> JobOut:
        return _job_out(service.job(tenant, job_id))

    @app.post("/v1/retrieve", response_model=RetrieveOut, tags=["retrieval"])
    async def retrieve(body: RetrieveIn, tenant: Tenant) -> RetrieveOut:
        """Memories for many queries at once; concurrent requests are micro-batched together.
        Each result's `selection_id` is what feedback refers to."""
        check_count(len(body.queries), limits.max_queries, "queries")
        check_texts([q.query for q in body.queries], "queries")
        items = []
        for i, q in enumerate(body.queries):
            k = q.k if q.k is not None else config.k
            m = q.m if q.m is not None else min(config.m, k)
            if k > limits.max_k:
                raise _unprocessable(f"queries[{i}].k: {k} exceeds the limit of {limits.max_k}")
            if m > k:
                raise _unprocessable(f"queries[{i}]: cannot show m={m} memories out of k={k} candidates")
            items.append(RetrieveItem(tenant=tenant, user=q.user, query=q.query, k=k, m=m,
                                      explore=config.explore if q.explore is None else q.explore))
        results = await batcher.submit_many(items)
        metrics.queries.inc(len(results))
        return RetrieveOut(results=[ResultOut(
            user=r.user, query=r.query, selection_id=r.selection_id, explore=r.explore, expires_at=r.expires_at,
            memories=[ShownOut(index=s.index, id=s.id, text=s.text, kind=s.kind, refs=s.refs, score=s.score,
                               retriever_score=s.retriever_score, time_span=s.time_span) for s in r.memories],
        ) for r in results])

    @app.post("/v1/feedback", response_model=FeedbackOut, tags=["retrieval"])
    def feedback(body: FeedbackIn, tenant: Tenant) -> FeedbackOut:
        """What the LLM cited for a selection: indices, `no_cite`, or its raw reply to parse."""
        if body.text is not None:
            check_texts([body.text], "text")
        result: FeedbackResult = service.feedback(tenant, body.selection_id, cited=body.cited, text=body.text,
                                                  no_cite=body.no_cite, structured=body.structured)
        metrics.feedback.labels("learned" if result.rewards is not None else "skipped").inc()
        if result.updated:
            metrics.updates.inc()
        return FeedbackOut(**result.__dict__)

    return app


def _job_out(job: Job) -> JobOut:
    from rmm.serve.service import unscoped

    return JobOut(job_id=job.id, user=unscoped(job.user_id), kind=job.kind, status=job.status,
                  created_at=job.created_at, started_at=job.started_at, finished_at=job.finished_at,
                  result=job.result, error=job.error)
