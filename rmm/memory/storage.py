"""The storage interface of a memory bank, and the one place that picks its implementation.

A bank's durable state — memories, their embeddings, users with generation counters, and a small
key/value `meta` table — lives behind `MemoryStorage`. Two implementations:

* `rmm.memory.store.MemoryStore`: one SQLite file (the default: the quickstart needs no server);
  vector search happens in-process over an index rebuilt from the stored embeddings.
* `rmm.memory.pg_store.PostgresStore`: a PostgreSQL database with pgvector (a shared bank for
  several processes); vector search happens in the database (`VectorSearchStorage`), so a
  process holds no index of its own.

`open_store` chooses by the location: a ``postgresql://`` (or ``postgres://``) URL → PostgreSQL,
anything else is a path → SQLite.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from rmm.errors import RmmError

if TYPE_CHECKING:
    import numpy as np
    import torch

    from rmm.memory.graph import Direction, Edge, Event, Topic
    from rmm.memory.tree import NodeEdit, TreeNode
    from rmm.types import Memory

__all__ = ["MemoryStorage", "VectorSearchStorage", "is_database_url", "open_store"]

POSTGRES_SCHEMES = ("postgresql", "postgres")
_URL = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://")


@runtime_checkable
class MemoryStorage(Protocol):
    """What a bank needs of its durable store; every write is durable when it returns.

    Each user has a generation counter bumped by exactly one per write transaction touching that
    user (and kept across `delete_user`), so derived state (an in-process index, BM25) can tell
    whether it is stale, also across processes.
    """

    @property
    def location(self) -> str:
        """Where the store is, for messages (a path, or a URL without its password)."""
        ...

    @property
    def store_id(self) -> str: ...

    def add(self, memories: list[Memory], embeddings: torch.Tensor | np.ndarray | None = None) -> None: ...

    def update(self, memory: Memory, embedding: torch.Tensor | np.ndarray | None = None) -> None: ...

    def delete(self, user: str, ids: list[str]) -> None: ...

    def delete_user(self, user: str) -> None: ...

    def set_meta(self, key: str, value: str) -> None: ...

    def set_meta_if_absent(self, key: str, value: str) -> str:
        """Store `value` unless the key has one; return the stored value (atomic: first writer wins)."""
        ...

    def get_meta(self, key: str, default: str | None = None) -> str | None: ...

    def users(self) -> list[str]: ...

    def require_user(self, user: str) -> None: ...

    def has_user(self, user: str) -> bool: ...

    def generation(self, user: str) -> int: ...

    def count(self, user: str) -> int: ...

    def get(self, user: str, ids: list[str]) -> list[Memory]: ...

    def memories(self, user: str) -> list[Memory]: ...

    def embeddings(self, user: str, ids: list[str] | None = None) -> tuple[list[str], torch.Tensor]: ...

    # the event graph (rmm.memory.graph): written in the transaction of the memories it touches
    def add_events(self, user: str, events: list[Event | Memory], edges: list[Edge] | None = None,
                   topics: list[Topic] | None = None, embeddings: torch.Tensor | np.ndarray | None = None) -> None:
        """Insert event memories, edges between stored or new events, topics and memberships, all or nothing."""
        ...

    def rewire(self, user: str, old_ids: list[str], new_id: str) -> None:
        """Move the edges and memberships of merged events onto the event they were merged into."""
        ...

    def neighbours(self, user: str, memory_id: str, direction: Direction = "out", label: str | None = None) -> list[Edge]: ...

    def topics(self, user: str) -> list[Topic]: ...

    def members(self, user: str, topic: str) -> list[str]: ...

    def participants(self, user: str, ids: list[str]) -> dict[str, tuple[str, ...]]: ...

    # Semantic XPath's tree (rmm.memory.tree): written in the transaction of the memories it shows
    def add_nodes(self, user: str, nodes: list[TreeNode], memories: list[Memory] | None = None,
                  embeddings: torch.Tensor | np.ndarray | None = None) -> None:
        """Insert tree nodes and the memories they show, all or nothing."""
        ...

    def edit_nodes(self, user: str, edits: list[NodeEdit]) -> None:
        """Write each edited node's next version; the older ones stay as its history."""
        ...

    def remove_nodes(self, user: str, ids: list[str]) -> None:
        """Tombstone nodes and their subtrees (still readable as of earlier generations)."""
        ...

    def tree(self, user: str, as_of: int | None = None) -> list[TreeNode]:
        """The tree in tree order: latest versions, or as it was after generation `as_of`."""
        ...

    def node_history(self, user: str, node_id: str) -> list[TreeNode]: ...

    def close(self) -> None: ...


@runtime_checkable
class VectorSearchStorage(MemoryStorage, Protocol):
    """A store that also answers inner-product top-k itself (the database is the index)."""

    def search(self, user: str, queries: torch.Tensor, k: int) -> tuple[torch.Tensor, list[list[str]], torch.Tensor]:
        """Per query: scores [B, k'] (-inf where a row is short), ids, and the hits' vectors [Σ hits, d]."""
        ...


def url_scheme(location: str | Path) -> str | None:
    """The scheme of a ``scheme://…`` location, lowercased; None for a plain path."""
    if not isinstance(location, str):
        return None
    match = _URL.match(location)
    return match.group("scheme").lower() if match else None


def is_database_url(location: str | Path) -> bool:
    """True for a PostgreSQL URL; raises for any other ``scheme://`` (a typo must not become a folder)."""
    scheme = url_scheme(location)
    if scheme is None:
        return False
    if scheme in POSTGRES_SCHEMES:
        return True
    raise RmmError(
        f"unsupported store URL scheme {scheme!r} in {location!r}: use postgresql://user@host/db for PostgreSQL, "
        "or a plain path for an SQLite bank"
    )


def open_store(location: str | Path, **options: Any) -> MemoryStorage:
    """A PostgreSQL store for a ``postgresql://`` URL, else the SQLite store at that path.

    `options` go to `PostgresStore` (pool sizes, search settings); SQLite takes none.
    """
    if is_database_url(location):
        from rmm.memory.pg_store import PostgresStore

        return PostgresStore(str(location), **options)
    if options:
        raise ValueError(f"an SQLite store takes no options, got {sorted(options)}")
    from rmm.memory.store import MemoryStore

    return MemoryStore(location)
