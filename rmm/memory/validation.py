"""The checks both memory stores apply, and the errors they raise, in one place: SQLite
(`store.py`) and PostgreSQL (`pg_store.py`) refuse the same bad input alike, with the same
messages; only the queries that find what to check differ between them."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from rmm.errors import DimensionMismatchError, RmmError, UnknownMemoryError, UnknownUserError
from rmm.types import Memory

__all__ = [
    "MAX_LISTED_USERS",
    "MAX_PARTICIPANTS",
    "DuplicateMemoryError",
    "as_matrix",
    "check_dim",
    "check_edge",
    "check_event",
    "check_memory",
    "check_meta_value",
    "check_topic",
    "check_user_name",
    "duplicate_keys",
    "require_embedded",
    "require_events",
    "require_ids",
    "unknown_user",
]

MAX_LISTED_USERS = 10  # an unknown-user error names the users there are up to this many


class DuplicateMemoryError(RmmError, ValueError):
    """A memory id that already exists for that user (the store never silently overwrites)."""


def check_memory(memory: Memory) -> Memory:
    """A `Memory` with a non-empty id and user id, else `TypeError` / `ValueError`."""
    if not isinstance(memory, Memory):
        raise TypeError(f"expected a Memory, got {type(memory).__name__}")
    if not memory.id or not memory.user_id:
        raise ValueError(f"memory needs a non-empty id and user_id, got id={memory.id!r} user_id={memory.user_id!r}")
    return memory


def duplicate_keys(memories: list[Memory]) -> None:
    """Refuse one add that names the same (user, id) twice."""
    keys = [(m.user_id, m.id) for m in memories]
    if len(set(keys)) != len(keys):
        dupes = sorted({f"{u}/{i}" for (u, i) in keys if keys.count((u, i)) > 1})
        raise DuplicateMemoryError(f"memory ids repeated within one add: {dupes[:5]}")


def as_matrix(embeddings: torch.Tensor | np.ndarray, n: int) -> np.ndarray:
    """float32 C-contiguous [n, d], finite, else `ValueError`."""
    array = embeddings.detach().cpu().float().numpy() if isinstance(embeddings, torch.Tensor) else np.asarray(embeddings, dtype=np.float32)
    if array.ndim != 2 or array.shape[0] != n:
        raise ValueError(f"expected embeddings of shape [{n}, d], got {tuple(array.shape)}")
    if not np.isfinite(array).all():
        raise ValueError("embeddings contain NaN or inf")
    return np.ascontiguousarray(array, dtype=np.float32)


def check_user_name(user: object) -> None:
    """A user id is a non-empty string."""
    if not isinstance(user, str) or not user:
        raise ValueError(f"user must be a non-empty string, got {user!r}")


def check_meta_value(value: object) -> None:
    """Meta values are strings."""
    if not isinstance(value, str):
        raise TypeError(f"meta values are strings (serialise them yourself), got {type(value).__name__}")


def require_ids(user: str, ids: Sequence[str], present: Iterable[str]) -> None:
    """Refuse ids of `user` that are not among `present` (what the store found), naming up to five."""
    found = set(present)
    missing = [i for i in ids if i not in found]
    if missing:
        shown = missing[:5] + (["..."] if len(missing) > 5 else [])
        raise UnknownMemoryError(f"{len(missing)} unknown memory id(s) for user {user!r}: {shown}")


def require_embedded(user: str, ids: Sequence[str], embedded: Iterable[str]) -> None:
    """Refuse ids of `user` whose memory has no stored embedding."""
    found = set(embedded)
    missing = [i for i in ids if i not in found]
    if missing:
        raise UnknownMemoryError(f"memories of user {user!r} without a stored embedding: {missing[:5]}")


def check_dim(dim: int, stored: int, location: str) -> None:
    """Refuse embeddings whose dimension is not the store's."""
    if int(dim) != int(stored):
        raise DimensionMismatchError(f"embedding dimension {int(dim)} does not match the store's {int(stored)} "
                                     f"({location})")


def unknown_user(user: str, location: str, users: list[str], total: int) -> UnknownUserError:
    """The error for a user the store does not have, with a hint: `users` are the first
    `MAX_LISTED_USERS + 1` active ones in order, `total` how many there are."""
    if not users:
        hint = "the store has no users yet"
    elif len(users) <= MAX_LISTED_USERS:
        hint = f"known users: {users}"
    else:
        hint = f"the store has {total} users"
    return UnknownUserError(f"unknown user {user!r} in {location}; {hint}")


# ---- the event graph (rmm.memory.graph): checks both stores apply before writing ------------------------

MAX_PARTICIPANTS = 3  # CompassMem's event schema: at most three participants per event


def check_event(user: str, memory: Memory, participants: Sequence[str]) -> None:
    """An event node: a `Memory` of kind ``event`` of `user`, with turn refs, an explicit time and at
    most `MAX_PARTICIPANTS` named participants (what graph search and the reranker rely on)."""
    check_memory(memory)
    if memory.kind != "event":
        raise ValueError(f"event {memory.id!r}: kind must be 'event', got {memory.kind!r}")
    if memory.user_id != user:
        raise ValueError(f"event {memory.id!r} belongs to user {memory.user_id!r}, not {user!r}")
    if not memory.refs:
        raise ValueError(f"event {memory.id!r} needs the turn ids it came from (refs)")
    if memory.time_span is None or all(t is None for t in memory.time_span):
        raise ValueError(f"event {memory.id!r} needs an explicit time (time_span)")
    if len(participants) > MAX_PARTICIPANTS:
        raise ValueError(f"event {memory.id!r} has {len(participants)} participants; at most {MAX_PARTICIPANTS}")
    if any(not isinstance(p, str) or not p for p in participants):
        raise ValueError(f"event {memory.id!r}: participants are non-empty strings, got {list(participants)!r}")


def check_edge(source: object, target: object, label: object, evidence: Sequence[object]) -> None:
    """A directed edge between two different nodes, a non-empty free-form label, turn ids as evidence."""
    for name, value in (("source", source), ("target", target), ("label", label)):
        if not isinstance(value, str) or not value:
            raise ValueError(f"edge {name} must be a non-empty string, got {value!r}")
    if source == target:
        raise ValueError(f"edge {source!r} -> {target!r}: an event is not its own neighbour")
    if any(not isinstance(e, str) or not e for e in evidence):
        raise ValueError(f"edge {source!r} -> {target!r}: evidence are turn ids (non-empty strings), got {list(evidence)!r}")


def check_topic(topic_id: object, members: Sequence[object]) -> None:
    """A topic has a non-empty id; its members are memory ids."""
    if not isinstance(topic_id, str) or not topic_id:
        raise ValueError(f"topic id must be a non-empty string, got {topic_id!r}")
    if any(not isinstance(m, str) or not m for m in members):
        raise ValueError(f"topic {topic_id!r}: members are memory ids, got {list(members)!r}")


def require_events(user: str, ids: Iterable[str], events: Iterable[str]) -> None:
    """Refuse graph rows naming ids of `user` that are not stored events (`events`: those found)."""
    found = set(events)
    missing = sorted({i for i in ids if i not in found})
    if missing:
        raise UnknownMemoryError(f"{len(missing)} id(s) of user {user!r} are not stored events: {missing[:5]}")
