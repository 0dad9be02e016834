"""Selections waiting for their feedback, persisted in SQLite beside the bank.

An agent may post feedback seconds or minutes after it retrieved, and the server may restart in
between; a selection therefore lives in `selections.sqlite` (WAL) until it is rewarded, expires
or its user is deleted. A row keeps everything its update needs *as it was at sampling time*
(issue 13 item 3): the candidate ids and their embeddings as scored (float32 blobs, K×d), the
query embedding, the ordered picks, the behaviour log-probabilities μ, τ, the weights version and
the mask, and — for a hybrid first stage — each candidate's lexical feature as scored (float32 blob,
K) and its further features (`features`, float32 blob K×F, row-major, with `feature_names`, a JSON
list of the F names); NULL for dense candidates and rows written before they were kept, which
rebuild without them. A row whose blobs do not match the shape it states is refused for that
selection alone (`CorruptSelectionError`, 410), the row left as it was.
Nothing is re-read from the bank at feedback time, so a memory edited or deleted in
between cannot change what the learner learns. This costs K×d×4 bytes per selection (30 KiB at
K=20, d=384), bounded by the TTL sweep.

Rows written before the embeddings were kept (no `embeddings` column value) are upgraded once
when the store opens, from the bank's current vectors (`upgrade_legacy`; the best there is for
them), or expired with a log line when their memories are gone.

Commits use `synchronous=NORMAL`: in WAL mode that survives a killed process (the durability a
pending selection needs); only a power loss can roll back the last few, which then answer 404.
Expired and rewarded rows are kept for one more TTL so a late caller gets "expired" / "already
rewarded" instead of "unknown", then swept. The feedback a row received is stored with it (JSON:
citations, rewards, whether it was learned and why not).
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from rmm.errors import UnknownMemoryError, UnknownUserError
from rmm.serve.errors import UnknownSelectionError
from rmm.serve.selection_rows import (
    SELECTION_COLUMNS,
    SQLITE_FORMAT,
    EmbeddingsOf,
    PendingSelection,
    RowFormat,
    refuse_unusable,
    require_embeddings,
    selection_from_row,
    selection_row,
    tensor_blob,
    unknown_selection,
)

__all__ = [
    "SELECTION_COLUMNS",
    "SQLITE_FORMAT",
    "PendingSelection",
    "RowFormat",
    "SelectionStore",
    "Selections",
    "open_selections",
    "selection_from_row",
    "selection_row",
]

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

# Added after the first release: ALTERed onto older files (NULL in rows written before).
_ADDED_COLUMNS = {
    "embeddings": "BLOB",  # [K, d] float32 candidate embeddings as scored
    "tau": "REAL",  # sampling temperature
    "version": "INTEGER",  # weights version (learner step) that sampled it
    "mask": "BLOB",  # [K] uint8, 1 = could be picked; NULL = all candidates
    "feedback": "TEXT",  # JSON of the feedback received (citations, rewards, learned, reason)
    "lexical": "BLOB",  # [K] float32 lexical feature as scored (hybrid first stage); NULL = none
    "features": "BLOB",  # [K, F] float32 candidate features as scored, row-major; NULL = none
    "feature_names": "TEXT",  # JSON list of the F feature names; NULL = none
    # 1 once the feedback is in a saved reranker checkpoint; a claimed row without it is replayed
    # into the learner at the next start (a kill -9 since the last checkpoint costs no learning)
    "checkpointed": "INTEGER",
}

_COLUMNS = ", ".join(SELECTION_COLUMNS)
_N_COLUMNS = len(SELECTION_COLUMNS)


class Selections(Protocol):
    """Where pending selections and their feedback live: `SelectionStore` (SQLite beside the bank,
    the default) or `rmm.serve.pg_pending.PgSelectionStore` (PostgreSQL, shared by replicas)."""

    ttl_s: float
    # True where feedback is only appended here and a background learner (the lock holder among
    # the replicas) applies it; False where the request's own process records it at once.
    learns_in_background: bool

    def put_many(self, selections: list[PendingSelection]) -> None: ...

    def upgrade_legacy(self, embeddings_of: EmbeddingsOf, now: float | None = None) -> tuple[int, int]: ...

    def claim(self, tenant: str, selection_id: str,
              check: Callable[[PendingSelection], dict[str, Any] | None] | None = None,
              now: float | None = None) -> PendingSelection: ...

    def feedback_of(self, tenant: str, selection_id: str) -> dict[str, Any] | None: ...

    def delete_user(self, user_id: str) -> int: ...

    def of_user(self, user_id: str) -> list[dict[str, Any]]: ...

    def sweep(self, now: float | None = None) -> int: ...

    def unsaved_feedback(self) -> list[tuple[PendingSelection, dict[str, Any]]]: ...

    def rewarded(self, reranker_key: str, since: float, limit: int) -> list[tuple[PendingSelection, dict[str, Any]]]: ...

    def mark_checkpointed(self, selection_ids: list[str]) -> None: ...

    def count_pending(self, now: float | None = None) -> int: ...

    def close(self) -> None: ...


def selection_summary(selection_id: str, query: str, memory_ids: list[str], chosen: list[int], explore: bool,
                      created_at: float, consumed_at: float | None, feedback: dict[str, Any] | None) -> dict[str, Any]:
    """One selection of a user as `of_user` lists it (both stores)."""
    return {"selection": selection_id, "query": query, "shown": [memory_ids[i] for i in chosen],
            "explore": explore, "created_at": created_at, "rewarded_at": consumed_at, "feedback": feedback}


def open_selections(location: str | Path, ttl_s: float) -> Selections:
    """The selection store for a location: a `postgresql://` URL or a SQLite file path."""
    if isinstance(location, str) and location.startswith(("postgresql://", "postgres://")):
        from rmm.serve.pg_pending import PgSelectionStore

        return PgSelectionStore(location, ttl_s)
    return SelectionStore(location, ttl_s)


class SelectionStore:
    """Thread-safe: one connection guarded by a lock (the batch worker writes, handlers claim)."""

    def __init__(self, path: str | Path, ttl_s: float) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.path = Path(path)
        self.ttl_s = float(ttl_s)
        self.learns_in_background = False
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._conn = sqlite3.connect(str(self.path), timeout=30.0, check_same_thread=False, isolation_level=None)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=NORMAL")
        self._conn.execute("PRAGMA secure_delete=ON")  # a deleted user's queries are zeroed, not left in free pages
        self._conn.executescript(_SCHEMA)
        present = {row[1] for row in self._conn.execute("PRAGMA table_info(selections)")}
        for name, kind in _ADDED_COLUMNS.items():
            if name not in present:
                self._conn.execute(f"ALTER TABLE selections ADD COLUMN {name} {kind}")
        if "checkpointed" not in present:  # feedback from before replay existed: learned or lost, never twice
            self._conn.execute("UPDATE selections SET checkpointed=1 WHERE consumed_at IS NOT NULL")

    def put_many(self, selections: list[PendingSelection]) -> None:
        """Persist a batch's selections in one transaction (one commit per batch, not per query)."""
        if not selections:
            return
        require_embeddings(selections)
        rows = [selection_row(s) for s in selections]
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                self._conn.executemany(f"INSERT INTO selections({_COLUMNS}) VALUES ({','.join('?' * _N_COLUMNS)})",
                                       rows)
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    def upgrade_legacy(self, embeddings_of: EmbeddingsOf, now: float | None = None) -> tuple[int, int]:
        """Give pending rows written before embeddings were stored their candidates' vectors, read
        once now from the bank; rows whose user or memories are gone are expired (a late feedback
        answers 410). Returns (upgraded, expired)."""
        now = time.time() if now is None else now
        with self._lock:
            legacy = self._conn.execute(
                "SELECT id, user_id, memory_ids FROM selections "
                "WHERE embeddings IS NULL AND consumed_at IS NULL AND expires_at >= ?", (now,)).fetchall()
        if not legacy:
            return 0, 0
        upgraded: list[tuple[bytes | None, str]] = []
        doomed: list[str] = []
        for selection_id, user_id, ids in legacy:
            try:
                upgraded.append((tensor_blob(embeddings_of(user_id, list(json.loads(ids)))), selection_id))
            except (UnknownUserError, UnknownMemoryError) as exc:  # gone: nothing faithful to learn from
                log.debug("legacy selection %s cannot be upgraded: %s", selection_id, exc)
                doomed.append(selection_id)
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                self._conn.executemany("UPDATE selections SET embeddings=? WHERE id=? AND embeddings IS NULL", upgraded)
                self._conn.executemany("UPDATE selections SET expires_at=? WHERE id=?",
                                       [(now - 1e-3, sid) for sid in doomed])
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")
        log.warning("%d pending selections written by an older rmm (no stored candidate embeddings): %d upgraded "
                    "with the bank's current vectors, %d expired because their user or memories are gone (their "
                    "feedback answers 410 expired)", len(legacy), len(upgraded), len(doomed))
        return len(upgraded), len(doomed)

    def claim(self, tenant: str, selection_id: str,
              check: Callable[[PendingSelection], dict[str, Any] | None] | None = None,
              now: float | None = None) -> PendingSelection:
        """The tenant's pending selection, marked rewarded in the same transaction (so two
        concurrent feedbacks cannot both teach the learner). `check` may refuse the feedback
        (raising) before anything is marked, so a bad request leaves the selection usable; what it
        returns is stored with the row as the feedback received."""
        now = time.time() if now is None else now
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                row = self._conn.execute(f"SELECT {_COLUMNS} FROM selections WHERE id=?", (selection_id,)).fetchone()
                if row is None or row[1] != tenant:
                    raise unknown_selection(selection_id)
                selection = selection_from_row(row)
                refuse_unusable(selection, now, self.ttl_s)
                stored = check(selection) if check is not None else None
                self._conn.execute("UPDATE selections SET consumed_at=?, feedback=? WHERE id=?",
                                   (now, None if stored is None else json.dumps(stored), selection_id))
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")
        selection.consumed_at = now
        return selection

    def feedback_of(self, tenant: str, selection_id: str) -> dict[str, Any] | None:
        """The feedback stored with a rewarded selection (None while it waits)."""
        with self._lock:
            row = self._conn.execute("SELECT tenant, feedback FROM selections WHERE id=?", (selection_id,)).fetchone()
        if row is None or row[0] != tenant:
            raise UnknownSelectionError(f"unknown selection id {selection_id!r}")
        return None if row[1] is None else dict(json.loads(row[1]))

    def delete_user(self, user_id: str) -> int:
        with self._lock:
            return self._conn.execute("DELETE FROM selections WHERE user_id=?", (user_id,)).rowcount

    def of_user(self, user_id: str) -> list[dict[str, Any]]:
        """The user's selections as an export shows them (query, shown memory ids, the feedback
        stored, times), oldest first; embeddings and scores stay out (they are derived state)."""
        with self._lock:
            rows = self._conn.execute(
                "SELECT id, query, memory_ids, chosen, explore, created_at, consumed_at, feedback FROM selections "
                "WHERE user_id=? ORDER BY created_at, rowid", (user_id,)).fetchall()
        return [selection_summary(r[0], r[1], json.loads(r[2]), json.loads(r[3]), bool(r[4]), r[5], r[6],
                                  None if r[7] is None else json.loads(r[7])) for r in rows]

    def unsaved_feedback(self) -> list[tuple[PendingSelection, dict[str, Any]]]:
        """The rewarded selections whose feedback no saved checkpoint holds yet, with the feedback
        stored for each, in the order it arrived: what a restarted learner replays."""
        with self._lock:
            rows = self._conn.execute(
                f"SELECT {_COLUMNS}, feedback FROM selections WHERE consumed_at IS NOT NULL AND checkpointed IS NULL "
                "AND feedback IS NOT NULL ORDER BY consumed_at, rowid").fetchall()
        return [(selection_from_row(row[:_N_COLUMNS]), dict(json.loads(row[_N_COLUMNS]))) for row in rows]

    def rewarded(self, reranker_key: str, since: float, limit: int) -> list[tuple[PendingSelection, dict[str, Any]]]:
        """The newest `limit` sampled selections of `reranker_key` claimed with feedback after `since`,
        with their feedback, oldest first (what the shadow's window starts from after a restart)."""
        with self._lock:
            rows = self._conn.execute(
                f"SELECT {_COLUMNS}, feedback FROM selections WHERE consumed_at IS NOT NULL AND consumed_at > ? "
                "AND feedback IS NOT NULL AND explore = 1 AND reranker_key = ? ORDER BY consumed_at DESC, rowid DESC "
                "LIMIT ?", (since, reranker_key, limit)).fetchall()
        return [(selection_from_row(row[:_N_COLUMNS]), dict(json.loads(row[_N_COLUMNS]))) for row in reversed(rows)]

    def mark_checkpointed(self, selection_ids: list[str]) -> None:
        """Record that a saved checkpoint holds these selections' feedback (never replayed again)."""
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                for start in range(0, len(selection_ids), 500):
                    chunk = selection_ids[start:start + 500]
                    self._conn.execute(f"UPDATE selections SET checkpointed=1 WHERE id IN ({','.join('?' * len(chunk))})",
                                       chunk)
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    def sweep(self, now: float | None = None) -> int:
        """Delete rows expired or rewarded more than one TTL ago (a rewarded row only once a saved
        checkpoint holds its feedback: until then it is what a restart replays)."""
        cutoff = (time.time() if now is None else now) - self.ttl_s
        with self._lock:
            removed = self._conn.execute(
                "DELETE FROM selections WHERE (consumed_at IS NULL AND expires_at < ?) "
                "OR (consumed_at IS NOT NULL AND consumed_at < ? AND checkpointed IS NOT NULL)",
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
