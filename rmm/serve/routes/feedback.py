"""Feedback: what the LLM cited for a selection, which the reranker learns from."""

from __future__ import annotations

from fastapi import APIRouter

from rmm.serve.deps import API_PREFIX, Limits, Service, Telemetry, Tenant
from rmm.serve.records import FeedbackResult
from rmm.serve.schemas import FeedbackIn

__all__ = ["router"]

router = APIRouter(prefix=API_PREFIX, tags=["retrieval"])


@router.post("/feedback", response_model=FeedbackResult)
def feedback(body: FeedbackIn, tenant: Tenant, service: Service, limits: Limits, metrics: Telemetry) -> FeedbackResult:
    """What the LLM cited for a selection: indices, `no_cite`, or its raw reply to parse. Feedback
    for a greedy selection (`explore: false`) is stored but not learned from (`learned: false`)."""
    if body.text is not None:
        limits.texts([body.text], "text")
    result = service.feedback(tenant, body.selection_id, cited=body.cited, text=body.text, no_cite=body.no_cite,
                              structured=body.structured)
    metrics.feedback.labels("learned" if result.learned else "skipped").inc()
    if result.updated:
        metrics.updates.inc()
    return result
