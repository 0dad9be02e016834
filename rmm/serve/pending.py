"""Selections waiting for their feedback, persisted in SQLite beside the bank.

An agent may post feedback seconds or minutes after it retrieved, and the server may restart in
between; a selection therefore lives in `selections.sqlite` (WAL) until it is rewarded, expires
or its user is deleted. A row keeps what the learner needs except the candidate embeddings,
which are read back from the bank's store at feedback time: the store already holds them, and
copying K×d floats per query would make this table grow ~20× faster than the memories do.

Commits use `synchronous=NORMAL`: in WAL mode that survives a killed process (the durability a
pending selection needs); only a power loss can roll back the last few, which then answer 404.
Expired and rewarded rows are kept for one more TTL so a late caller gets "expired" / "already
rewarded" instead of "unknown", then swept.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from rmm.serve.errors import (
    SelectionExpiredError,
    SelectionUsedError,
    UnknownSelectionError,
)

__all__ = ["PendingSelection", "SelectionStore"]

log = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS selections (
    id           TEXT PRIMARY KEY,
    tenant       TEXT NOT NULL,
    user_id      TEXT NOT NULL,
    reranker_key TEXT NOT NULL,
    query        TEXT NOT NULL,
    memory_ids   TEXT NOT NULL,
    chosen       TEXT NOT NULL,
    explore      INTEGER NOT NULL,
    query_emb    BLOB NOT NULL,
    scores       BLOB NOT NULL,
    logp         BLOB,
    noise        BLOB,
    created_at   REAL NOT NULL,
    expires_at   REAL NOT NULL,
    consumed_at  REAL
);
CREATE INDEX IF NOT EXISTS selections_user ON selections(user_id);
CREATE INDEX IF NOT EXISTS selections_expiry ON selections(expires_at);
"""

_COLUMNS = ("id, tenant, user_id, reranker_key, query, memory_ids, chosen, explore, query_emb, scores, logp, noise, "
            "created_at, expires_at, consumed_at")


@dataclass
class PendingSelection:
    """A `Selection` minus its candidate embeddings (those come back from the store)."""

    id: str
    tenant: str
    user_id: str  # the tenant-scoped user id
    reranker_key: str
    query: str
    memory_ids: list[str]  # the K candidates, in retrieval order
    chosen: list[int]  # indices into memory_ids, in shown order
    explore: bool
    query_embedding: torch.Tensor  # [d]
    scores: torch.Tensor  # [K]
    logp: torch.Tensor | None
    noise: torch.Tensor | None
    created_at: float
    expires_at: float
    consumed_at: float | None = None


def _blob(tensor: torch.Tensor | None) -> bytes | None:
    if tensor is None:
        return None
    return np.ascontiguousarray(tensor.detach().float().cpu().numpy(), dtype=np.float32).tobytes()


def _tensor(blob: bytes | None) -> torch.Tensor | None:
    if blob is None:
        return None
    return torch.from_numpy(np.frombuffer(blob, dtype=np.float32).copy())


class SelectionStore:
    """Thread-safe: one connection guarded by a lock (the batch worker writes, handlers claim)."""

    def __init__(self, path: str | Path, ttl_s: float) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.path = Path(path)
        self.ttl_s = float(ttl_s)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._conn = sqlite3.connect(str(self.path), timeout=30.0, check_same_thread=False, isolation_level=None)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=NORMAL")
        self._conn.executescript(_SCHEMA)

    def put_many(self, selections: list[PendingSelection]) -> None:
        """Persist a batch's selections in one transaction (one commit per batch, not per query)."""
        if not selections:
            return
        rows = [
            (s.id, s.tenant, s.user_id, s.reranker_key, s.query, json.dumps(s.memory_ids), json.dumps(s.chosen),
             int(s.explore), _blob(s.query_embedding), _blob(s.scores), _blob(s.logp), _blob(s.noise),
             s.created_at, s.expires_at, None)
            for s in selections
        ]
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                self._conn.executemany(f"INSERT INTO selections({_COLUMNS}) VALUES ({','.join('?' * 15)})", rows)
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    def claim(self, tenant: str, selection_id: str, check: Callable[[PendingSelection], None] | None = None,
              now: float | None = None) -> PendingSelection:
        """The tenant's pending selection, marked rewarded in the same transaction (so two
        concurrent feedbacks cannot both teach the learner). `check` may refuse the feedback
        (raising) before anything is marked, so a bad request leaves the selection usable."""
        now = time.time() if now is None else now
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                row = self._conn.execute(f"SELECT {_COLUMNS} FROM selections WHERE id=?", (selection_id,)).fetchone()
                if row is None or row[1] != tenant:
                    raise UnknownSelectionError(
                        f"unknown selection id {selection_id!r}: never issued to this API key's tenant, or "
                        "purged (expired or rewarded more than one TTL ago, or its user or memory was deleted)"
                    )
                selection = _from_row(row)
                if selection.consumed_at is not None:
                    raise SelectionUsedError(
                        f"selection {selection_id!r} already received feedback at "
                        f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(selection.consumed_at))}; "
                        "each selection is rewarded once"
                    )
                if selection.expires_at < now:
                    raise SelectionExpiredError(
                        f"selection {selection_id!r} expired {now - selection.expires_at:.1f} s ago (selections "
                        f"wait {self.ttl_s:g} s for feedback; raise selection_ttl_s to allow slower feedback)"
                    )
                if check is not None:
                    check(selection)
                self._conn.execute("UPDATE selections SET consumed_at=? WHERE id=?", (now, selection_id))
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")
        selection.consumed_at = now
        return selection

    def delete_user(self, user_id: str) -> int:
        with self._lock:
            return self._conn.execute("DELETE FROM selections WHERE user_id=?", (user_id,)).rowcount

    def delete_memory(self, user_id: str, memory_id: str) -> int:
        """Drop the user's selections whose candidates include the memory (they would teach the
        learner about a memory that no longer exists)."""
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                doomed = [sid for sid, ids in self._conn.execute(
                    "SELECT id, memory_ids FROM selections WHERE user_id=?", (user_id,)) if memory_id in json.loads(ids)]
                self._conn.executemany("DELETE FROM selections WHERE id=?", [(sid,) for sid in doomed])
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")
        return len(doomed)

    def sweep(self, now: float | None = None) -> int:
        """Delete rows expired or rewarded more than one TTL ago."""
        cutoff = (time.time() if now is None else now) - self.ttl_s
        with self._lock:
            removed = self._conn.execute(
                "DELETE FROM selections WHERE expires_at < ? OR (consumed_at IS NOT NULL AND consumed_at < ?)",
                (cutoff, cutoff),
            ).rowcount
        if removed:
            log.info("swept %d expired or rewarded selections", removed)
        return removed

    def count_pending(self, now: float | None = None) -> int:
        now = time.time() if now is None else now
        with self._lock:
            return int(self._conn.execute(
                "SELECT COUNT(*) FROM selections WHERE consumed_at IS NULL AND expires_at >= ?", (now,)).fetchone()[0])

    def close(self) -> None:
        with self._lock:
            self._conn.close()


def _from_row(row: tuple) -> PendingSelection:
    query_embedding = _tensor(row[8])
    scores = _tensor(row[9])
    assert query_embedding is not None and scores is not None
    return PendingSelection(
        id=row[0], tenant=row[1], user_id=row[2], reranker_key=row[3], query=row[4],
        memory_ids=list(json.loads(row[5])), chosen=list(json.loads(row[6])), explore=bool(row[7]),
        query_embedding=query_embedding, scores=scores, logp=_tensor(row[10]), noise=_tensor(row[11]),
        created_at=row[12], expires_at=row[13], consumed_at=row[14],
    )
