"""FastAPI dependencies for the routes: the caller's tenant, the service, the batchers, the
metrics, the limits.

`create_app` puts one of each object on `app.state`; the routes ask for them by type, so a route
module needs no closure over `create_app` and tests can reach the same objects through `app.state`.
The dependencies are coroutines because none of them blocks: FastAPI runs a plain `def`
dependency in its thread pool, a thread hop per dependency per request that cost more than the
lookups themselves.

An API key is sent as `Authorization: Bearer KEY` or `X-API-Key: KEY` (the Bearer token wins when
both are sent). The key names the tenant; the routes only ever see the tenant. Both security
schemes are declared, so `/docs` offers an "Authorize" button for either.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated

from fastapi import Depends, HTTPException, Path, Request, Security, status
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer

from rmm.serve.batcher import MicroBatcher
from rmm.serve.config import LimitsConfig
from rmm.serve.errors import InvalidApiKeyError, MissingApiKeyError
from rmm.serve.metrics import Metrics
from rmm.serve.records import RetrieveItem, RetrieveResult, WriteItem
from rmm.serve.schemas import API_PREFIX, ID_PATTERN, USER_PATTERN
from rmm.serve.service import RetrievalService

__all__ = ["API_PREFIX", "IdPath", "Limits", "RequestLimits", "Retrievals", "Service", "Telemetry", "Tenant",
           "UserPath", "Writes", "api_key", "tenant_of"]

# Every route under API_PREFIX (defined with the schemas, which the client shares) needs an API key
# (`rmm.serve.gate`). Routers carry it themselves (not as an `include_router` prefix) so that a
# matched route's `path` is the whole template metrics report. The path parameters are declared here,
# not in the schemas, so that the client's import of the schemas loads no FastAPI.
UserPath = Annotated[str, Path(pattern=USER_PATTERN, description="a user id of your tenant")]
IdPath = Annotated[str, Path(pattern=ID_PATTERN, description="an id (1-256 characters)")]


class RequestLimits:
    """The `limits:` of the config as checks that refuse a request (422) and say which limit it broke."""

    def __init__(self, config: LimitsConfig) -> None:
        self.config = config

    def count(self, n: int, limit: int, what: str) -> None:
        """Refuse more items in one request than `limit`."""
        if n > limit:
            raise self.refuse(f"too many {what}: {n} in one request, the limit is {limit}; split the request")

    def texts(self, texts: list[str], where: str) -> None:
        """Refuse any text longer than `max_text_chars`, naming its position."""
        for i, text in enumerate(texts):
            if len(text) > self.config.max_text_chars:
                raise self.refuse(f"{where}[{i}]: text of {len(text)} characters exceeds the limit of "
                                  f"{self.config.max_text_chars}")

    @staticmethod
    def refuse(message: str) -> HTTPException:
        """A well-formed request the server will not do (422), with the reason."""
        return HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, message)


async def get_service(request: Request) -> RetrievalService:
    return request.app.state.service


async def get_retrievals(request: Request) -> MicroBatcher[RetrieveItem, RetrieveResult]:
    return request.app.state.batcher


async def get_writes(request: Request) -> MicroBatcher[WriteItem, list[str]]:
    return request.app.state.writes


async def get_metrics(request: Request) -> Metrics:
    return request.app.state.metrics


async def get_limits(request: Request) -> RequestLimits:
    return RequestLimits(request.app.state.service.config.limits)


Service = Annotated[RetrievalService, Depends(get_service)]
Retrievals = Annotated[MicroBatcher[RetrieveItem, RetrieveResult], Depends(get_retrievals)]
Writes = Annotated[MicroBatcher[WriteItem, list[str]], Depends(get_writes)]
Telemetry = Annotated[Metrics, Depends(get_metrics)]
Limits = Annotated[RequestLimits, Depends(get_limits)]


# ---- the caller's tenant ------------------------------------------------------------------------
MISSING_KEY = "missing API key: send 'Authorization: Bearer KEY' or 'X-API-Key: KEY'"

bearer_scheme = HTTPBearer(auto_error=False, description="API key")
header_scheme = APIKeyHeader(name="X-API-Key", auto_error=False, description="API key")


def pick_key(bearer_token: str | None, header_key: str | None) -> str | None:
    """The request's API key: the Bearer token, else the X-API-Key header (blank counts as none)."""
    return (bearer_token or "").strip() or (header_key or "").strip() or None


def api_key(headers: Mapping[str, str]) -> str | None:
    """`pick_key` from raw (lower-cased) headers, for the gate, which runs before FastAPI's schemes."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    return pick_key(token if scheme.lower() == "bearer" else None, headers.get("x-api-key"))


def tenant_of(service: RetrievalService, key: str | None) -> str:
    """The tenant a key speaks for; a typed 401 error when it is missing or unknown."""
    if key is None:
        raise MissingApiKeyError(MISSING_KEY)
    tenant = service.tenant_for_key(key)
    if tenant is None:
        raise InvalidApiKeyError("invalid API key")
    return tenant


async def require_tenant(service: Service,
                   bearer: Annotated[HTTPAuthorizationCredentials | None, Security(bearer_scheme)] = None,
                   header_key: Annotated[str | None, Security(header_scheme)] = None) -> str:
    return tenant_of(service, pick_key(bearer.credentials if bearer else None, header_key))


Tenant = Annotated[str, Depends(require_tenant)]
