"""Operations: `/health` and `/metrics` (no key needed; they show no tenant's data)."""

from __future__ import annotations

import torch
from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from rmm.serve.deps import Service, Telemetry
from rmm.serve.schemas import HealthOut

__all__ = ["router"]

router = APIRouter(tags=["ops"])


@router.get("/health", response_model=HealthOut)
def health(service: Service) -> HealthOut:
    batching = service.config.batching
    return HealthOut(status="ok", encoder=service.encoder.name, dim=service.bank.dim, batching=batching.enabled,
                     max_batch=batching.max_batch, max_wait_ms=batching.max_wait_ms,
                     torch_threads=torch.get_num_threads())


@router.get("/metrics", response_class=Response)
def prometheus(metrics: Telemetry) -> Response:
    """Prometheus text format."""
    return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)
