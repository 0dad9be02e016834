"""The event graph: a slate of an event's unvisited neighbours for a client-side explorer's step."""

from __future__ import annotations

from fastapi import APIRouter

from rmm.serve.deps import API_PREFIX, IdPath, Limits, Service, Tenant, UserPath
from rmm.serve.neighbours import NeighbourRequest
from rmm.serve.records import NeighboursResult
from rmm.serve.schemas import NeighboursIn

__all__ = ["router"]

router = APIRouter(prefix=API_PREFIX, tags=["events"])


# `:path`: memory ids are the caller's, and may contain "/" (sent percent-encoded)
@router.post("/users/{user}/events/{event_id:path}/neighbours", response_model=NeighboursResult)
def neighbours(user: UserPath, event_id: IdPath, body: NeighboursIn, tenant: Tenant, service: Service,
               limits: Limits) -> NeighboursResult:
    """The event's unvisited neighbours reranked for `query` by the user's reranker: a Gumbel top-M
    when more than `m` are unvisited (visited ones masked before the draw), else all of them in
    score order. Each carries its edges to the node (label, direction, evidence). Send the
    citations of what your explorer kept to `/v1/feedback` with `selection_id`, as for a retrieve."""
    config = service.config
    m = body.m if body.m is not None else config.m
    if m > limits.config.max_k:
        raise limits.refuse(f"m: {m} exceeds the limit of {limits.config.max_k}")
    if len(body.query) > limits.config.max_text_chars:
        raise limits.refuse(f"query: text of {len(body.query)} characters exceeds the limit of "
                            f"{limits.config.max_text_chars}")
    request = NeighbourRequest(tenant=tenant, user=user, event_id=event_id, query=body.query, m=m,
                               explore=config.explore if body.explore is None else body.explore,
                               visited=list(body.visited), direction=body.direction, label=body.label)
    return service.neighbours(request)
