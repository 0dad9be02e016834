"""Retrieval: memories for many queries at once, micro-batched across concurrent requests."""

from __future__ import annotations

from fastapi import APIRouter

from rmm.serve.deps import API_PREFIX, Limits, Retrievals, Service, Telemetry, Tenant
from rmm.serve.http_errors import per_query_results
from rmm.serve.records import RetrieveItem
from rmm.serve.schemas import RetrieveIn, RetrieveOut

__all__ = ["router"]

router = APIRouter(prefix=API_PREFIX, tags=["retrieval"])


@router.post("/retrieve", response_model=RetrieveOut)
async def retrieve(body: RetrieveIn, tenant: Tenant, service: Service, batcher: Retrievals, limits: Limits,
                   metrics: Telemetry) -> RetrieveOut:
    """Memories for many queries at once; concurrent requests are micro-batched together.
    Each result's `selection_id` is what feedback refers to. Each query is answered on its own: a
    query that fails (e.g. an unknown user) while others succeed gets a result with `error`
    (`status`, `code`, `detail`) and no memories; when every query fails, the request answers the
    first query's error as a whole (so a one-query request answers exactly as before)."""
    limits.count(len(body.queries), limits.config.max_queries, "queries")
    limits.texts([q.query for q in body.queries], "queries")
    config = service.config
    items = []
    for i, q in enumerate(body.queries):
        k = q.k if q.k is not None else config.k
        m = q.m if q.m is not None else min(config.m, k)
        if k > limits.config.max_k:
            raise limits.refuse(f"queries[{i}].k: {k} exceeds the limit of {limits.config.max_k}")
        if m > k:
            raise limits.refuse(f"queries[{i}]: cannot show m={m} memories out of k={k} candidates")
        items.append(RetrieveItem(tenant=tenant, user=q.user, query=q.query, k=k, m=m,
                                  explore=config.explore if q.explore is None else q.explore))
    answers = await batcher.submit_each(items)
    metrics.queries.inc(len(answers))
    return RetrieveOut(results=per_query_results(items, answers))
