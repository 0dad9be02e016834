"""The HTTP API of `rmm serve` (FastAPI; interactive docs at /docs, schema at /openapi.json).

Every `/v1` route needs an API key (`Authorization: Bearer KEY` or `X-API-Key: KEY`), checked
before the body is even read (`rmm.serve.gate`), so a caller without a key learns nothing but
"401". The key names the tenant (`rmm.serve.deps.Tenant`); users, selections and jobs of other
tenants answer 404 exactly like ids that never existed, and no answer shows the internal
`tenant:user` form of an id. Each tenant's feedback trains its own reranker unless
`reranker_per: bank` explicitly shares one. Every non-2xx answer is JSON `{"detail": message,
"code": short_name}` (`rmm.serve.http_errors`): 401 no/invalid key, 404 unknown
user/memory/selection/job or path, 405 wrong method, 409 duplicate memory id or feedback given
twice, 410 expired selection, 413 body too large, 422 malformed or impossible request (not UTF-8
or JSON, a field of the wrong JSON type, NUL or a lone surrogate, empty text, an oversized id, a
path that is not UTF-8; naming the field), 500 unexpected (no details; the connection stays open),
503 shutting down, 503 database_busy / database_unavailable (PostgreSQL store: pool full or server
unreachable; logged at WARNING, the answer names no database; `/health` answers 503 meanwhile). `/health` and `/metrics` (Prometheus text format) need no key and show no
tenant's data.

Where things live: bodies in `schemas`, routes in `routes/` (one router per resource), the
routes' dependencies (the tenant too) in `deps`, metrics in `metrics`, the service in `service`.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from rmm.serve.batcher import MicroBatcher
from rmm.serve.config import ServeConfig
from rmm.serve.deps import API_PREFIX
from rmm.serve.gate import RequestGate
from rmm.serve.http_errors import install_error_handlers
from rmm.serve.metrics import Metrics, RequestMetrics
from rmm.serve.records import RetrieveItem, RetrieveResult, WriteItem
from rmm.serve.routes import PUBLIC, VERSIONED
from rmm.serve.service import RetrievalService

__all__ = ["API_VERSION", "create_app"]

log = logging.getLogger(__name__)

API_VERSION = API_PREFIX.lstrip("/")  # "v1": the OpenAPI document's version

_freeze_lock = threading.Lock()
_running_apps = 0  # apps of this process between start-up and shutdown: the last one out thaws


def _freeze_start_up_objects() -> None:
    """The ~400k objects of the imports and the start-up live as long as the server: moved out of
    the collector's sight, so an automatic full collection no longer walks them all (a 200 ms pause
    of every thread, a few times a minute under load: rmm/bench/serve.py's p99)."""
    global _running_apps
    with _freeze_lock:
        gc.collect()
        gc.freeze()
        _running_apps += 1


def _thaw_when_last() -> None:
    """`gc.unfreeze()` is process-wide: an embedding process gets its objects back when its last
    app stops, never while another app still runs."""
    global _running_apps
    with _freeze_lock:
        _running_apps -= 1
        if _running_apps == 0:
            gc.unfreeze()


def create_app(config: ServeConfig, *, service: RetrievalService | None = None, **service_options: Any) -> FastAPI:
    """The API over a `RetrievalService` (built from `config` unless given; `service_options`,
    e.g. `encoder=` or `llm=`, go to its constructor). The lifespan starts the service's background
    work and, at shutdown, drains the batchers and checkpoints the rerankers."""
    service = service if service is not None else RetrievalService(config, **service_options)
    config = service.config
    batching = config.batching
    metrics = Metrics(service)
    # two stages on two threads: the next batch's queries encode while this one is searched,
    # reranked and persisted
    retrievals: MicroBatcher[RetrieveItem, RetrieveResult] = MicroBatcher(
        service.finish_retrievals, prepare=service.encode_retrievals, max_batch=batching.max_batch,
        max_wait_ms=batching.max_wait_ms, enabled=batching.enabled, name="retrieve", on_batch=metrics.on_batch,
        on_stage=metrics.on_stage)
    # memory writes are coalesced the same way: one passage encode for every concurrent request
    writes: MicroBatcher[WriteItem, list[str]] = MicroBatcher(
        service.add_memories_batch, max_batch=batching.max_batch, max_wait_ms=batching.max_wait_ms,
        enabled=batching.enabled, name="write")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        service.start()
        _freeze_start_up_objects()
        log.info("rmm serve ready: bank %s, encoder %s, batching %s (max_batch %d, max_wait %.1f ms)",
                 config.bank_path, service.encoder.name, "on" if batching.enabled else "off",
                 batching.max_batch, batching.max_wait_ms)
        try:
            yield
        finally:
            try:
                await retrievals.close()
                await writes.close()
                await asyncio.to_thread(service.close)
            finally:
                _thaw_when_last()
            log.info("rmm serve stopped; rerankers checkpointed")

    # no trailing-slash redirects: Starlette builds their Location from the Host header (a redirect to
    # any host a client names) and answers them without a body; an unknown path is the contract's 404
    app = FastAPI(title="rmm retrieval server", version=API_VERSION, lifespan=lifespan, redirect_slashes=False,
                  description="Batched memory retrieval with a reranker that learns from the LLM's citations. "
                              "Send your API key as `Authorization: Bearer KEY` or `X-API-Key: KEY`.")
    app.state.service, app.state.metrics = service, metrics
    app.state.batcher, app.state.writes = retrievals, writes
    install_error_handlers(app)  # first: its `ErrorBoundary` is the innermost middleware
    app.add_middleware(RequestGate, service=service, max_bytes=config.limits.max_request_bytes,
                       guarded_prefix=f"{API_PREFIX}/")
    app.add_middleware(RequestMetrics, metrics=metrics)  # added last: outermost, so it sees every answer
    for router in PUBLIC + VERSIONED:
        app.include_router(router)
    return app
