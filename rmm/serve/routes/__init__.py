"""The API's routes, one `APIRouter` per resource.

`VERSIONED` routers live under `deps.API_PREFIX` (behind the API key), `PUBLIC` ones at the root.
"""

from __future__ import annotations

from fastapi import APIRouter

from rmm.serve.routes import events, feedback, memories, ops, reranker, retrieve, sessions, tree

__all__ = ["PUBLIC", "VERSIONED"]

PUBLIC: list[APIRouter] = [ops.router]
VERSIONED: list[APIRouter] = [memories.router, sessions.router, retrieve.router, feedback.router,
                               reranker.router, events.router, tree.router]
