"""The in-process vector index of an SQLite bank: one index per user, cached in memory and on disk.

An index is derived state: the store keeps every embedding. Files (`<bank>/index/<user>.safetensors`)
are stamped with what they reflect — store id, user, store generation, encoder, index options — and
a file whose stamp does not match the store is rebuilt from the stored embeddings; an unreadable one
is rebuilt with a warning. A write is applied to a cached index incrementally only when no other
writer slipped in (the generation moved by exactly one); otherwise the cache is dropped and rebuilt
on demand, so another process writing to the same bank is noticed at the next search.

A PostgreSQL bank has none of this: the database searches itself (`rmm.memory.pg_store`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rmm.errors import CorruptFileError
from rmm.memory.index import VectorIndex, index_file_info, load_index, make_index
from rmm.memory.store import MemoryStore

__all__ = ["UserIndexCache", "index_filename"]

log = logging.getLogger(__name__)


@dataclass
class _UserIndex:
    index: VectorIndex
    generation: int
    dirty: bool  # changed since it was last written to disk


def index_filename(user: str) -> str:
    """A safe, unique file name for any user id (readable prefix + hash of the exact id)."""
    readable = re.sub(r"[^A-Za-z0-9._-]", "_", user)[:48].lstrip(".") or "user"
    digest = hashlib.sha1(user.encode("utf-8")).hexdigest()[:12]
    return f"{readable}-{digest}.safetensors"


class UserIndexCache:
    """Per-user indexes over `store`'s embeddings, kept current with its generations. Not locked:
    the bank calls it under its own lock."""

    def __init__(self, store: MemoryStore, folder: Path, *, backend: str, dim: int, device: torch.device,
                 options: dict[str, Any], fingerprint: str) -> None:
        self.store = store
        self.folder = folder
        self.backend = backend
        self.dim = dim
        self.device = device
        self.options = options
        self.fingerprint = fingerprint
        self._indexes: dict[str, _UserIndex] = {}
        folder.mkdir(exist_ok=True)

    def path(self, user: str) -> Path:
        return self.folder / index_filename(user)

    def _stamp(self, user: str, generation: int) -> dict[str, str]:
        return {
            "store_id": self.store.store_id,
            "user": user,
            "generation": str(generation),
            "fingerprint": self.fingerprint,
            "options": json.dumps(self.options, sort_keys=True),
        }

    def generation_or_none(self, user: str) -> int | None:
        return self.store.generation(user) if self.store.has_user(user) else None

    def index_for(self, user: str) -> VectorIndex:
        """The user's index at the store's current generation: cached, loaded, or rebuilt."""
        self.store.require_user(user)
        generation = self.store.generation(user)
        cached = self._indexes.get(user)
        if cached is not None and cached.generation == generation:
            return cached.index
        index = self._load_file(user, generation)
        if index is None:
            ids, vectors = self.store.embeddings(user)
            index = make_index(self.backend, self.dim, device=self.device, **self.options)
            if ids:
                index.add(ids, vectors)
            self._indexes[user] = _UserIndex(index, generation, dirty=True)
            self.save(user)
            log.debug("built %s index for user %r (%d vectors, generation %d)", self.backend, user, len(ids), generation)
        else:
            self._indexes[user] = _UserIndex(index, generation, dirty=False)
        return index

    def _load_file(self, user: str, generation: int) -> VectorIndex | None:
        file = self.path(user)
        if not file.exists():
            return None
        expected = self._stamp(user, generation)
        try:
            info = index_file_info(file)
            stamp = info["metadata"]
            if info["backend"] != self.backend or info["dim"] != self.dim or stamp != expected:
                log.info("index file %s is stale (generation %s, store at %d); rebuilding", file, stamp.get("generation"), generation)
                return None
            index = load_index(file, device=self.device)
        except CorruptFileError as exc:
            log.warning("index file %s is unreadable (%s); rebuilding it from the store", file, exc)
            return None
        return index

    def save(self, user: str) -> None:
        entry = self._indexes.get(user)
        if entry is None or not entry.dirty:
            return
        if self.generation_or_none(user) != entry.generation:
            return  # another writer moved on: this snapshot would only be stale on disk
        entry.index.metadata = self._stamp(user, entry.generation)
        try:
            entry.index.save(self.path(user))
            entry.dirty = False
        except OSError as exc:  # the index is only a cache: failing to persist it loses nothing
            log.warning("could not write index file for user %r: %s", user, exc)

    def apply(self, user: str, before: int | None, change: Callable[[VectorIndex], None]) -> None:
        """Bring a cached index along with a store write that moved `before` → now.

        Applied incrementally only if the cache reflected `before` and no other writer slipped in
        (generation moved by exactly one); otherwise the cache is dropped and rebuilt on demand.
        """
        entry = self._indexes.get(user)
        if entry is None:
            return
        try:
            after = self.generation_or_none(user)
            if before is None or after != before + 1 or entry.generation != before:
                del self._indexes[user]
                return
            change(entry.index)
            entry.generation = after
            entry.dirty = True
        except BaseException:
            self._indexes.pop(user, None)
            raise

    def forget(self, user: str) -> None:
        """Drop a deleted user's index, in memory and on disk."""
        self._indexes.pop(user, None)
        self.path(user).unlink(missing_ok=True)

    def flush(self) -> None:
        """Write every index changed since it was last saved (they are rebuildable anyway)."""
        for user in list(self._indexes):
            self.save(user)

    def clear(self) -> None:
        self._indexes.clear()
