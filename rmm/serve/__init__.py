"""The retrieval server: batched retrieve, feedback into the learner, auth and durability.

Names are re-exported lazily: `import rmm.serve` stays cheap (FastAPI, uvicorn and the models load
only when the server or the client is actually used).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "AsyncRmmClient",
    "MicroBatcher",
    "Query",
    "RetrievalService",
    "RmmClient",
    "RmmServerError",
    "ServeConfig",
    "create_app",
    "load_config",
]

_HOMES = {
    "AsyncRmmClient": "rmm.serve.client",
    "Query": "rmm.serve.client",
    "RmmClient": "rmm.serve.client",
    "RmmServerError": "rmm.serve.client",
    "MicroBatcher": "rmm.serve.batcher",
    "RetrievalService": "rmm.serve.service",
    "ServeConfig": "rmm.serve.config",
    "load_config": "rmm.serve.config",
    "create_app": "rmm.serve.app",
}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'rmm.serve' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
