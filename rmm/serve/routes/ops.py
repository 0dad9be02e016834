"""Operations: `/health` and `/metrics` (no key needed; they show no tenant's data)."""

from __future__ import annotations

import torch
from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from rmm.memory.pg_connect import DatabasePoolExhaustedError, DatabaseUnavailableError
from rmm.serve.deps import Service, Telemetry
from rmm.serve.schemas import HealthOut, QueryEngineOut
from rmm.serve.service import RetrievalService

__all__ = ["router"]

router = APIRouter(tags=["ops"])


def store_state(service: RetrievalService) -> str:
    """"ok", "busy" (every pooled connection in use) or "unavailable" (PostgreSQL unreachable):
    one round trip to a PostgreSQL store; a SQLite bank is a local file, always "ok"."""
    if service.db is None:
        return "ok"
    try:
        with service.db.tx() as cur:
            cur.execute("SELECT 1")
    except DatabasePoolExhaustedError:
        return "busy"
    except DatabaseUnavailableError:
        return "unavailable"
    return "ok"


@router.get("/health", response_model=HealthOut,
            responses={503: {"model": HealthOut, "description": "the store is unreachable"}})
def health(service: Service, response: Response) -> HealthOut:
    """Readiness for a load balancer: 200 while the server can answer, 503 (`status` and `store`
    "unavailable") while its PostgreSQL store is unreachable, so traffic goes elsewhere meanwhile."""
    batching = service.config.batching
    store = store_state(service)
    if store == "unavailable":
        response.status_code = 503
    return HealthOut(status="unavailable" if store == "unavailable" else "ok", store=store,
                     encoder=service.encoder.name, dim=service.bank.dim, batching=batching.enabled,
                     max_batch=batching.max_batch, max_wait_ms=batching.max_wait_ms,
                     torch_threads=torch.get_num_threads(), query_engine=_query_engine(service))


def _query_engine(service: Service) -> QueryEngineOut:
    choice = service.query_engine
    return QueryEngineOut(engine=choice.engine, requested=choice.requested, cached=choice.cached,
                          batch_sizes=list(choice.batch_sizes), note=choice.note,
                          ms_per_query={t.engine: {str(s): ms for s, ms in t.ms_per_query.items()}
                                        for t in choice.timings if t.ms_per_query},
                          skipped={t.engine: t.skipped for t in choice.timings if t.skipped})


@router.get("/metrics", response_class=Response)
def prometheus(metrics: Telemetry) -> Response:
    """Prometheus text format."""
    return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)
