"""Admin routes of the reranker: the shadow's off-policy estimate and guarded promotion
(`rmm.serve.shadow`); only tenants named in `shadow.admin_tenants` may call them."""

from __future__ import annotations

from dataclasses import asdict

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from rmm.serve.deps import API_PREFIX, Service, Telemetry, Tenant
from rmm.serve.errors import ForbiddenError, NoShadowError
from rmm.serve.http_errors import json_error
from rmm.serve.schemas import ShadowOut
from rmm.serve.service import RetrievalService
from rmm.serve.shadow import PromotionRefusedError, ShadowScorer

__all__ = ["router"]

router = APIRouter(prefix=API_PREFIX, tags=["reranker"])


def _shadow(service: RetrievalService, tenant: str) -> ShadowScorer:
    if tenant not in service.config.shadow.admin_tenants:
        raise ForbiddenError(f"tenant {tenant!r} is not an admin of this server (shadow.admin_tenants)")
    if service.shadow is None:
        raise NoShadowError("no shadow reranker configured (shadow.checkpoint)")
    return service.shadow


@router.get("/ope", response_model=ShadowOut)
def ope(tenant: Tenant, service: Service) -> ShadowOut:
    """The shadow's running off-policy estimate against the live policy, on the rewarded selections
    the live policy sampled, and what promotion would decide now."""
    return ShadowOut(**_shadow(service, tenant).decide().to_json())


@router.post("/reranker/promote", response_model=ShadowOut,
             responses={409: {"description": "refused: the evidence does not clear the bar (both figures given)"}})
def promote(tenant: Tenant, service: Service, metrics: Telemetry) -> ShadowOut | JSONResponse:
    """Swap the live weights for the shadow's only when its lower bound clears the live value by the
    margin with enough effective sample size; otherwise 409 with the decision and its figures."""
    shadow = _shadow(service, tenant)
    try:
        decision = shadow.promote()
    except PromotionRefusedError as exc:
        metrics.promotions.labels("refused").inc()
        return json_error(409, "promotion_refused", str(exc), decision=asdict(exc.decision))
    metrics.promotions.labels("promoted").inc()
    return ShadowOut(**decision.to_json(), promoted=True, previous=shadow.shadow_name)
