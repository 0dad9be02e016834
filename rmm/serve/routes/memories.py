"""A tenant's users and their memories: list, add, delete."""

from __future__ import annotations

from fastapi import APIRouter

from rmm.serve.deps import API_PREFIX, IdPath, Limits, Service, Telemetry, Tenant, UserPath, Writes
from rmm.serve.records import NewMemory, WriteItem
from rmm.serve.schemas import (
    AddMemoriesIn,
    AddMemoriesOut,
    DeleteMemoryOut,
    DeleteUserOut,
    MemoriesOut,
    MemoryOut,
    UsersOut,
)
from rmm.types import MEMORY_KINDS

__all__ = ["router"]

router = APIRouter(prefix=API_PREFIX, tags=["memories"])


@router.get("/users", response_model=UsersOut)
def list_users(tenant: Tenant, service: Service) -> UsersOut:
    return UsersOut(users=service.users(tenant))


@router.post("/users/{user}/memories", response_model=AddMemoriesOut, status_code=201)
async def add_memories(user: UserPath, body: AddMemoriesIn, tenant: Tenant, writes: Writes, limits: Limits,
                       metrics: Telemetry) -> AddMemoriesOut:
    """Store memories (encoded, indexed); answered only after the write is durable.
    Concurrent requests are micro-batched into one encode, then committed one by one."""
    limits.count(len(body.memories), limits.config.max_memories, "memories")
    limits.texts([m.text for m in body.memories], "memories")
    for i, m in enumerate(body.memories):
        if m.kind not in MEMORY_KINDS:
            raise limits.refuse(f"memories[{i}].kind: must be one of {list(MEMORY_KINDS)}, got {m.kind!r}")
    ids = await writes.submit(WriteItem(tenant, user, [NewMemory(**m.model_dump()) for m in body.memories]))
    metrics.memories.inc(len(ids))
    return AddMemoriesOut(user=user, ids=ids)


@router.get("/users/{user}/memories", response_model=MemoriesOut)
def list_memories(user: UserPath, tenant: Tenant, service: Service) -> MemoriesOut:
    return MemoriesOut(user=user, memories=[MemoryOut.model_validate(m) for m in service.memories(tenant, user)])


# `:path`: memory ids are the caller's, and may contain "/" (sent percent-encoded)
@router.delete("/users/{user}/memories/{memory_id:path}", response_model=DeleteMemoryOut)
def delete_memory(user: UserPath, memory_id: IdPath, tenant: Tenant, service: Service) -> DeleteMemoryOut:
    dropped = service.delete_memory(tenant, user, memory_id)
    return DeleteMemoryOut(user=user, memory_id=memory_id, selections_dropped=dropped)


@router.delete("/users/{user}", response_model=DeleteUserOut)
def delete_user(user: UserPath, tenant: Tenant, service: Service) -> DeleteUserOut:
    """Everything of the user: memories, index, pending selections, open session, queued jobs."""
    return DeleteUserOut(user=user, **service.delete_user(tenant, user))
