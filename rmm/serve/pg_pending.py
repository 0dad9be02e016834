"""Pending selections and their feedback in PostgreSQL, shared by every replica of the bank.

Same contract as the SQLite `rmm.serve.pending.SelectionStore` (the `Selections` protocol): a
row keeps everything its update needs as sampled (candidate ids and embeddings as scored, query
embedding, ordered picks, μ, τ, mask, weights version, the lexical feature of hybrid candidates —
column added by migration 0003 — and their further features with the features' names — migration
0004; NULL in older rows, which rebuild without them), so feedback posted to any replica finds
it, and the learner — whichever replica holds the learner lock — rebuilds the update from the row
alone. Claiming a selection appends its feedback to the `feedback` table in the same transaction
(committed before the HTTP answer), so acknowledged feedback survives any replica's death; the
learner applies it later (`learns_in_background`). A rewarded selection whose feedback the
learner has not applied yet is never swept. Rows go through the SQLite store's codec
(`rmm.serve.selection_rows.selection_row` / `selection_from_row`: the same columns and encodings,
with JSONB and BOOLEAN where SQLite has TEXT and INTEGER), so a new field is added in one place;
the refusals on claim are that module's too, so this one never imports `rmm.serve.pending`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rmm.memory.pg_database import PgDatabase
from rmm.serve.errors import CorruptSelectionError, UnknownSelectionError
from rmm.serve.selection_rows import (
    SELECTION_COLUMNS,
    EmbeddingsOf,
    PendingSelection,
    RowFormat,
    refuse_unusable,
    require_embeddings,
    selection_from_row,
    selection_row,
    unknown_selection,
)

if TYPE_CHECKING:
    import psycopg

__all__ = ["AppliedFeedback", "PgSelectionStore", "mark_applied", "skip_unlearnable", "unapplied_feedback"]

log = logging.getLogger(__name__)

_COLUMNS = ", ".join(SELECTION_COLUMNS)  # the SQLite store's columns, in its codec's order
_PREFIXED = ", ".join(f"s.{c}" for c in SELECTION_COLUMNS)


def _jsonb(value: list[Any]) -> Any:
    from psycopg.types.json import Jsonb

    return Jsonb(value)


_FORMAT = RowFormat(dump_json=_jsonb, load_json=list, dump_bool=bool)  # JSONB (read back as lists), BOOLEAN


@dataclass
class AppliedFeedback:
    """One feedback row the learner has to apply: its order, its selection as sampled, its rewards."""

    seq: int
    selection: PendingSelection
    rewards: list[float] | None


class PgSelectionStore:
    """`Selections` on a PostgreSQL bank schema (tables `selections`, `feedback`; migrations 0002-0004)."""

    learns_in_background = True

    def __init__(self, url_or_db: str | PgDatabase, ttl_s: float) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.ttl_s = float(ttl_s)
        self._own = isinstance(url_or_db, str)
        self.db = PgDatabase(url_or_db) if isinstance(url_or_db, str) else url_or_db

    def put_many(self, selections: list[PendingSelection]) -> None:
        """Persist a batch's selections in one transaction, committed before the results are returned."""
        if not selections:
            return
        require_embeddings(selections)
        rows = [selection_row(s, _FORMAT) for s in selections]
        with self.db.tx() as cur:
            cur.executemany(f"INSERT INTO selections ({_COLUMNS}) VALUES ({', '.join(['%s'] * len(SELECTION_COLUMNS))})",
                            rows)

    def upgrade_legacy(self, embeddings_of: EmbeddingsOf, now: float | None = None) -> tuple[int, int]:
        """Nothing to upgrade: every row in the database was written with its embeddings (NOT NULL)."""
        return 0, 0

    def claim(self, tenant: str, selection_id: str,
              check: Callable[[PendingSelection], dict[str, Any] | None] | None = None,
              now: float | None = None) -> PendingSelection:
        """The tenant's pending selection, marked rewarded and its feedback appended in one
        transaction (row-locked, so two replicas cannot both reward it). `check` may refuse before
        anything changes; what it returns is stored, and its `rewards` are what the learner uses."""
        from psycopg.types.json import Jsonb

        now = time.time() if now is None else now
        with self.db.tx() as cur:
            cur.execute(f"SELECT {_COLUMNS} FROM selections WHERE id = %s FOR UPDATE", (selection_id,))
            row = cur.fetchone()
            if row is None or row[1] != tenant:
                raise unknown_selection(selection_id)
            selection = _from_row(row)
            refuse_unusable(selection, now, self.ttl_s)
            stored = check(selection) if check is not None else None
            rewards = None if stored is None else stored.get("rewards")
            cur.execute("UPDATE selections SET consumed_at = %s, feedback = %s WHERE id = %s",
                        (now, None if stored is None else Jsonb(stored), selection_id))
            cur.execute("INSERT INTO feedback (selection_id, reranker_key, rewards, learn, created_at) "
                        "VALUES (%s, %s, %s, %s, %s)",
                        (selection_id, selection.reranker_key, None if rewards is None else Jsonb(list(rewards)),
                         bool(selection.explore and rewards is not None), now))
        selection.consumed_at = now
        return selection

    def feedback_of(self, tenant: str, selection_id: str) -> dict[str, Any] | None:
        """The feedback stored with a rewarded selection (None while it waits)."""
        with self.db.tx() as cur:
            row = cur.execute("SELECT tenant, feedback FROM selections WHERE id = %s", (selection_id,)).fetchone()
        if row is None or row[0] != tenant:
            raise UnknownSelectionError(f"unknown selection id {selection_id!r}")
        return None if row[1] is None else dict(row[1])

    def delete_user(self, user_id: str) -> int:
        """Delete the user's selections (their feedback rows go with them)."""
        with self.db.tx() as cur:
            return cur.execute("DELETE FROM selections WHERE user_id = %s", (user_id,)).rowcount

    def of_user(self, user_id: str) -> list[dict[str, Any]]:
        """The user's selections as an export shows them (the shape of `SelectionStore.of_user`)."""
        with self.db.tx() as cur:
            rows = cur.execute("SELECT id, query, memory_ids, chosen, explore, created_at, consumed_at, feedback "
                               "FROM selections WHERE user_id = %s ORDER BY created_at, id", (user_id,)).fetchall()
        return [{"selection": r[0], "query": r[1], "shown": [list(r[2])[i] for i in r[3]], "explore": bool(r[4]),
                 "created_at": r[5], "rewarded_at": r[6], "feedback": None if r[7] is None else dict(r[7])}
                for r in rows]

    def unsaved_feedback(self) -> list[tuple[PendingSelection, dict[str, Any]]]:
        """Nothing for a starting replica to replay itself: the learner-lock holder applies the
        feedback table's unapplied rows (`rmm.serve.learner_lease`), after a crash too."""
        return []

    def rewarded(self, reranker_key: str, since: float, limit: int) -> list[tuple[PendingSelection, dict[str, Any]]]:
        """The newest `limit` sampled selections of `reranker_key` claimed with feedback after `since`
        (every replica's), with their feedback, oldest first (`SelectionStore.rewarded`)."""
        with self.db.tx() as cur:
            rows = cur.execute(
                f"SELECT {_COLUMNS}, feedback FROM selections WHERE consumed_at IS NOT NULL AND consumed_at > %s "
                "AND feedback IS NOT NULL AND explore AND reranker_key = %s ORDER BY consumed_at DESC, id DESC "
                "LIMIT %s", (since, reranker_key, limit)).fetchall()
        n = len(SELECTION_COLUMNS)
        return [(selection_from_row(row[:n], _FORMAT), dict(row[n])) for row in reversed(rows)]

    def mark_checkpointed(self, selection_ids: list[str]) -> None:
        """Nothing to record: a reranker version marks the feedback it holds (`applied_version`)."""

    def sweep(self, now: float | None = None) -> int:
        """Delete rows expired or rewarded more than one TTL ago, keeping any whose feedback the
        learner has not applied yet (a learner that was down for an hour still learns from it)."""
        cutoff = (time.time() if now is None else now) - self.ttl_s
        with self.db.tx() as cur:
            removed = cur.execute(
                "DELETE FROM selections s WHERE (s.consumed_at IS NULL AND s.expires_at < %(c)s) "
                "OR (s.consumed_at < %(c)s AND NOT EXISTS (SELECT 1 FROM feedback f WHERE f.selection_id = s.id "
                "AND f.learn AND f.applied_version IS NULL))", {"c": cutoff}).rowcount
        if removed:
            log.info("swept %d expired or rewarded selections", removed)
        return removed

    def count_pending(self, now: float | None = None) -> int:
        now = time.time() if now is None else now
        with self.db.tx() as cur:
            row = cur.execute("SELECT count(*) FROM selections WHERE consumed_at IS NULL AND expires_at >= %s",
                              (now,)).fetchone()
        return int(row[0]) if row else 0

    def count_unapplied(self) -> int:
        """Feedback waiting for the learner."""
        with self.db.tx() as cur:
            row = cur.execute("SELECT count(*) FROM feedback WHERE learn AND applied_version IS NULL").fetchone()
        return int(row[0]) if row else 0

    def close(self) -> None:
        if self._own:
            self.db.close()


def unapplied_feedback(cur: psycopg.Cursor[Any], *, exclude: list[int] | None = None,
                       limit: int = 256) -> list[AppliedFeedback]:
    """Feedback to learn from that no reranker version contains yet, in seq order, minus `exclude`
    (rows the learner already holds in its buffer). No high-water mark: a row with a lower seq may
    commit after a higher one, and it must still be found. A row that cannot be decoded is taken off
    the queue (`skip_unlearnable`) in the same transaction, so it cannot hide the rows after it."""
    cur.execute(f"SELECT f.seq, f.rewards, {_PREFIXED} FROM feedback f JOIN selections s ON s.id = f.selection_id "
                "WHERE f.learn AND f.applied_version IS NULL AND NOT (f.seq = ANY(%s)) ORDER BY f.seq LIMIT %s",
                (list(exclude or []), limit))
    found: list[AppliedFeedback] = []
    for r in cur.fetchall():
        try:
            selection = _from_row(r[2:])
        except CorruptSelectionError as exc:
            skip_unlearnable(cur, int(r[0]), str(exc))
            continue
        found.append(AppliedFeedback(seq=int(r[0]), rewards=None if r[1] is None else [float(x) for x in r[1]],
                                     selection=selection))
    return found


def mark_applied(cur: psycopg.Cursor[Any], seqs: list[int], version: int) -> None:
    """Mark feedback rows as contained in reranker `version`. Fails the transaction when another
    learner applied one of them meanwhile (this learner's view is stale); rows deleted meanwhile
    (their user was deleted) are simply gone."""
    if not seqs:
        return
    row = cur.execute("SELECT count(*) FROM feedback WHERE seq = ANY(%s) AND applied_version IS NOT NULL",
                      (seqs,)).fetchone()
    if row is not None and row[0]:
        raise RuntimeError(f"{row[0]} of {len(seqs)} feedback rows were applied by another learner")
    cur.execute("UPDATE feedback SET applied_version = %s, applied_at = %s WHERE seq = ANY(%s) AND applied_version IS NULL",
                (version, time.time(), seqs))


def skip_unlearnable(cur: psycopg.Cursor[Any], seq: int, why: str) -> None:
    """Take a row the learner cannot use off its queue for good (kept, with learn = false), so one
    bad row cannot stop every learner that takes over after it."""
    cur.execute("UPDATE feedback SET learn = false WHERE seq = %s", (seq,))
    log.error("feedback row %d cannot be learned from (%s); marked learn = false", seq, why)


def _from_row(row: tuple[Any, ...]) -> PendingSelection:
    return selection_from_row(row, _FORMAT)
