"""A tenant's users and their memories: list, add (batched encode), delete.

Writes go straight to the bank, whose store commits with `synchronous=FULL` before returning:
an acknowledged memory survives `kill -9` (the per-user index is rebuilt from the store).
Deleting a user also drops what refers to them (pending selections, queued jobs, the open
session, a per-user reranker), so nothing stale can be rewarded or reflected later. Deleting one
memory keeps the pending selections that showed it: each holds the embeddings it was scored
with, so its feedback is learned exactly as sampled (the rows go with the TTL sweep).
"""

from __future__ import annotations

import torch

from rmm.memory.bank import MemoryBank
from rmm.memory.graph import Event
from rmm.memory.sessions import SessionLog
from rmm.memory.store import DuplicateMemoryError
from rmm.memory.validation import check_event
from rmm.policy.registry import LearnerRegistry
from rmm.serve.jobs import JobQueue
from rmm.encoders.query.locked import LockedEncoder
from rmm.serve.errors import BadRequestError
from rmm.serve.pending import SelectionStore
from rmm.serve.records import NewMemory, WriteItem
from rmm.serve.tenants import (
    callers_error,
    callers_terms,
    scoped,
    unknown_user,
    unscoped,
)
from rmm.types import Memory

__all__ = ["UserMemories"]


class UserMemories:
    """Memory CRUD scoped to a tenant; thread-safe through the bank's and stores' own locks."""

    def __init__(self, bank: MemoryBank, encoder: LockedEncoder, *, selections: SelectionStore,
                 sessions: SessionLog, jobs: JobQueue, learners: LearnerRegistry, per_user_rerankers: bool) -> None:
        self.bank, self.encoder = bank, encoder
        self.selections, self.sessions, self.jobs = selections, sessions, jobs
        self.learners, self.per_user_rerankers = learners, per_user_rerankers

    def require_user(self, tenant: str, user: str) -> str:
        """The scoped id of a user that has memories; UnknownUserError otherwise."""
        user_id = scoped(tenant, user)
        if not self.bank.store.has_user(user_id):
            raise unknown_user(user)
        return user_id

    def users(self, tenant: str) -> list[str]:
        prefix = scoped(tenant, "")
        return [unscoped(u) for u in self.bank.users() if u.startswith(prefix)]

    def add(self, tenant: str, user: str, memories: list[NewMemory]) -> list[str]:
        """Store and index; returns once committed (an acknowledged memory survives a crash)."""
        (result,) = self.add_batch([WriteItem(tenant, user, memories)])
        if isinstance(result, Exception):
            raise result
        return result

    def add_batch(self, items: list[WriteItem]) -> list[list[str] | Exception]:
        """Every request's memories in one encode; then each request commits on its own, so one
        request's failure (e.g. a duplicate id) never loses or blocks another's write. A request
        refused by `_check_events` is answered before the encode and writes nothing."""
        records = [[
            Memory(id=m.id or Memory.new_id(), user_id=scoped(item.tenant, item.user), kind=m.kind,  # type: ignore[arg-type]
                   text=m.text, refs=list(m.refs), source_text=m.source_text,
                   time_span=None if m.time is None else (m.time, m.time))
            for m in item.memories] for item in items]
        refused: list[Exception | None] = []
        for item, batch in zip(items, records):
            try:
                _check_events(item, batch)
                refused.append(None)
            except BadRequestError as error:
                refused.append(error)
        texts = [m.text for batch, error in zip(records, refused) if error is None for m in batch]
        vectors = self.encoder.encode_passages(texts) if texts else torch.empty(0, self.encoder.dim)
        results: list[list[str] | Exception] = []
        start = 0
        for item, batch, error in zip(items, records, refused):
            if error is not None:
                results.append(error)
                continue
            rows = vectors[start:start + len(batch)]
            start += len(batch)
            try:
                _refuse_repeated_ids(batch)
                if batch and batch[0].kind == "event":  # `_check_events`: then all are events
                    events = [Event(m, tuple(n.participants)) for m, n in zip(batch, item.memories)]
                    self.bank.store.add_events(batch[0].user_id, events, embeddings=rows)  # type: ignore[arg-type]
                    results.append([m.id for m in batch])
                else:
                    results.append(self.bank.add(batch[0].user_id, batch, embeddings=rows) if batch else [])
            except Exception as error:  # noqa: BLE001 - handed back to this request only
                results.append(callers_error(error, item.tenant, item.user))
        return results

    def memories(self, tenant: str, user: str) -> list[Memory]:
        with callers_terms(tenant, user):
            return self.bank.memories(self.require_user(tenant, user))

    def delete_memory(self, tenant: str, user: str, memory_id: str) -> int:
        """Delete from store and index; returns how many pending selections it invalidated — none
        since selections keep the embeddings they were scored with (their feedback still teaches
        the learner exactly what was shown); the count stays in the answer for old clients."""
        user_id = self.require_user(tenant, user)
        with callers_terms(tenant, user):
            self.bank.delete(user_id, [memory_id])
        return 0

    def delete_user(self, tenant: str, user: str) -> dict[str, int]:
        """Memories, index rows, selections and their feedback, open session, every job (queued
        ones cancelled, all rows deleted: their payloads hold the sessions) — and the user's own
        reranker and its checkpoint when there is one per user."""
        user_id = scoped(tenant, user)
        open_turns = len(self.sessions.current(user_id).turns)
        if not self.bank.store.has_user(user_id) and not open_turns:
            raise unknown_user(user)
        counts = {"memories": 0, "selections": 0, "session_turns": open_turns, "jobs_cancelled": 0}
        counts["jobs_cancelled"] = self.jobs.cancel_user(user_id)
        self.jobs.delete_user(user_id)  # done ones too: their payloads hold the sessions' turns
        if self.bank.store.has_user(user_id):
            counts["memories"] = self.bank.store.count(user_id)
            with callers_terms(tenant, user):
                self.bank.delete_user(user_id)
        counts["selections"] = self.selections.delete_user(user_id)
        self.sessions.clear(user_id)
        if self.per_user_rerankers:
            self.learners.drop(user_id, delete_checkpoint=True)
        return counts


def _check_events(item: WriteItem, batch: list[Memory]) -> None:
    """Events posted as memories get the checks `MemoryStorage.add_events` makes (turn refs, an
    explicit time, at most three participants; `rmm.memory.validation.check_event`) and are written
    through it with their participants, so they are graph nodes like the builder's. A request with
    events holds only events (one graph transaction); participants belong to events only."""
    kinds = {m.kind for m in batch}
    for i, (memory, given) in enumerate(zip(batch, item.memories)):
        if memory.kind != "event" and given.participants:
            raise BadRequestError(f"memories[{i}].participants: only events have participants (kind is "
                                  f"{memory.kind!r})")
        if memory.kind == "event":
            if len(kinds) > 1:
                raise BadRequestError(f"memories[{i}]: a request with events holds only events (they are written "
                                      f"with their participants in one graph transaction); got kinds {sorted(kinds)}")
            if given.time is not None and not given.time.strip():
                raise BadRequestError(f"memories[{i}]: event needs an explicit time (`time`), got blank text")
            try:
                check_event(memory.user_id, memory, given.participants)
            except ValueError as exc:
                message = str(exc).replace(f"event {memory.id!r}", "event").replace("(time_span)", "(`time`)")
                raise BadRequestError(f"memories[{i}]: {message}") from None


def _refuse_repeated_ids(batch: list[Memory]) -> None:
    """One request naming an id twice, said with the caller's ids (the store's message is scoped)."""
    seen: set[str] = set()
    for memory in batch:
        if memory.id in seen:
            raise DuplicateMemoryError(f"memory id {memory.id!r} appears more than once in this request")
        seen.add(memory.id)
