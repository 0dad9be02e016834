"""One learner among the replicas of a PostgreSQL bank, and every replica on its newest reranker.

Each replica runs one `SharedLearning` thread. It tries a PostgreSQL *session-level* advisory
lock (`pg_try_advisory_lock`, a key derived from the bank schema) on a dedicated connection about
once a second. The replica that holds it is the learner: it reads feedback rows no reranker
version contains yet (`rmm.serve.pg_pending.unapplied_feedback`, in seq order), rebuilds each
update from its selection row alone (candidates and embeddings as scored, μ, τ, mask — never
re-read from the bank) and records it through the ordinary `Learner` (truncated-importance
REINFORCE). When a batch steps the optimizer, it writes the new reranker version (version = the
learner's step) and marks that batch's feedback applied in one transaction on the lock's own
connection — so a learner that lost its connection (and with it the lock) cannot write at all,
and the `(key, version)` primary key fences off any second writer. Rows waiting in a partial
batch stay unapplied in the database, so a learner that dies loses nothing: the next one
re-reads them.

When the learner dies its connection drops, PostgreSQL releases the lock, and another replica
takes it at its next try (about a second). A replica that is not the learner keeps its lock
connection open between tries (a try is one query on it, not a connect), and opens a new one
only when that one broke (one that died while idle, e.g. across a database restart, is replaced
within the same try). Every replica that is not the learner polls the newest
version of each key every `reload_interval_s` and swaps it in (`LearnerRegistry.refresh`); the
learner's own rerankers are always the newest, since it wrote them.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import os
import queue
import time
from collections import defaultdict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from rmm.memory.pg_database import PgDatabase
from rmm.policy.optimizer import OptimizerStepError
from rmm.policy.pg_versions import RerankerVersions, learner_to_bytes
from rmm.policy.registry import LearnerRegistry, adopt_weights
from rmm.serve.background import Background
from rmm.serve.feedback import rebuild
from rmm.serve.pg_pending import mark_applied, skip_unlearnable, unapplied_feedback

if TYPE_CHECKING:
    import psycopg

__all__ = ["APPLICATION_NAME", "LeaseStats", "SharedLearning", "learner_holder", "learner_lock_key"]

log = logging.getLogger(__name__)

RETRY_S = 1.0  # how often a replica that is not the learner tries the lock
APPLY_EVERY_S = 0.2  # how often the learner looks for new feedback
# Keepalives on the lock's connection: a learner host that vanishes without closing its socket
# releases the lock within ~idle + interval x count seconds instead of the OS default (hours).
_KEEPALIVE = {"keepalives": 1, "keepalives_idle": 5, "keepalives_interval": 2, "keepalives_count": 3}
# Every replica's lease connection — the learner's and each follower's kept one — is named
# "rmm-learner:<pid>" in pg_stat_activity, so the name alone does not say who learns: only
# `learner_holder`, which joins pg_locks, finds the replica holding the lock.
APPLICATION_NAME = "rmm-learner"


def learner_lock_key(schema: str) -> int:
    """The advisory lock key of a bank's learner (signed 64-bit, from the schema name)."""
    digest = hashlib.sha256(f"rmm-learner:{schema}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def learner_holder(cur: psycopg.Cursor[Any], schema: str) -> int | None:
    """The OS process id of the replica holding `schema`'s learner lock (None: nobody), read from
    PostgreSQL's lock table — what operators and the chaos test ask to find the learner."""
    key = learner_lock_key(schema) & 0xFFFFFFFFFFFFFFFF
    row = cur.execute(
        "SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
        "WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1 AND l.classid::bigint = %s "
        "AND l.objid::bigint = %s", (key >> 32, key & 0xFFFFFFFF)).fetchone()
    if row is None or not str(row[0]).startswith(f"{APPLICATION_NAME}:"):
        return None
    return int(str(row[0]).rpartition(":")[2])


@dataclass
class LeaseStats:
    """What `/metrics` and the chaos test read: whether this replica learns, and what it did."""

    is_learner: bool = False
    acquisitions: int = 0
    applied: int = 0  # feedback rows this replica applied (marked in a committed version)
    versions_written: int = 0
    reloads: int = 0  # newer versions swapped in while not the learner


class SharedLearning:
    """The lease + learner + version-poller thread of one replica (start / stop)."""

    def __init__(self, db: PgDatabase, registry: LearnerRegistry, versions: RerankerVersions, *,
                 reload_interval_s: float = 1.0, retry_s: float = RETRY_S, apply_every_s: float = APPLY_EVERY_S,
                 batch_rows: int = 256) -> None:
        if not 0 < reload_interval_s <= 2.0:
            raise ValueError(f"reload_interval_s must be in (0, 2], got {reload_interval_s}")
        self.db, self.registry, self.versions = db, registry, versions
        self.reload_interval_s, self.retry_s, self.apply_every_s = reload_interval_s, retry_s, apply_every_s
        self.batch_rows = batch_rows
        self.lock_key = learner_lock_key(db.where.schema)
        self.stats = LeaseStats()
        self._conn: psycopg.Connection[Any] | None = None  # the lock's connection while this replica learns
        self._idle: psycopg.Connection[Any] | None = None  # the connection tries run on, kept between them
        self._buffered: dict[str, list[int]] = defaultdict(list)  # key -> seqs recorded, not yet in a version
        self._touched: set[str] = set()
        # promotions (`promote`) waiting for the lease thread, which alone uses the lock's connection
        self._promotions: queue.SimpleQueue[tuple[str, dict[str, torch.Tensor], Future[int]]] = queue.SimpleQueue()
        self._thread = Background("rmm-learner-lease", self._run)

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the thread and give the lock back (closing its connection releases it).

        The thread closes its own connections when its loop ends; closing them here too only
        matters when the round outlives `timeout` (a connection the thread opens after this still
        closes when its loop ends)."""
        if not self._thread.stop(timeout):
            log.warning("the learner round was still running %.0f s after shutdown began; closing its "
                        "connection anyway (its uncommitted work stays unapplied for the next learner)", timeout)
        self._release()
        self._close_idle()

    @property
    def is_learner(self) -> bool:
        return self._conn is not None

    # ---- one round at a time ---------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        finally:  # the loop's own connections end with it, however late it ends (see `stop`)
            self._release()
            self._close_idle()

    def _loop(self) -> None:
        stopping = self._thread.stopping
        next_try = next_reload = 0.0
        while not stopping.is_set():
            now = time.monotonic()
            try:
                if self._conn is None and now >= next_try:
                    next_try = now + self.retry_s
                    self.try_acquire()
                if self._conn is not None:
                    if not stopping.is_set():  # a stop that came during the try: no round after it
                        self.apply_pending()
                        self._promote_waiting()
                elif now >= next_reload:
                    next_reload = now + self.reload_interval_s
                    self.reload()
            except Exception as exc:  # a lost database or connection: drop the role, keep serving, retry
                log.log(logging.ERROR if isinstance(exc, OptimizerStepError) else logging.WARNING,
                        "shared learning round failed (%s: %s); retrying", type(exc).__name__,
                        " ".join(str(exc).split())[:300], exc_info=log.isEnabledFor(logging.DEBUG))
                self._lose_lease()
            wait = self.apply_every_s if self._conn is not None else min(next_try, next_reload) - time.monotonic()
            stopping.wait(max(0.02, wait))

    def try_acquire(self) -> bool:
        """Take the learner lock if nobody holds it; on success, start from the newest versions.

        Tries run on one connection kept open between them (reopened only when it broke), so a
        replica that is not the learner costs the server one idle session, not a connect a second.
        A kept connection whose session died while idle (a database restart, an administrator's
        `pg_terminate_backend`) only says so when used: it is replaced and the try made again at
        once on a fresh one, so a restart costs no failed round. A stop that began meanwhile wins:
        a lock just taken is given straight back."""
        import psycopg

        if self._idle is not None and (self._idle.closed or self._idle.broken):
            self._close_idle()
        while True:
            conn, fresh = self._idle, self._idle is None
            if conn is None:
                if self._thread.stopping.is_set():  # a stop closed the kept one: no connect just to give it back
                    return False
                conn = self._idle = self.db.dedicated(**_KEEPALIVE, application_name=f"{APPLICATION_NAME}:{os.getpid()}")
            try:
                got = bool(conn.execute("SELECT pg_try_advisory_lock(%s)", (self.lock_key,)).fetchone()[0])  # type: ignore[index]
                break
            except Exception as exc:
                self._close_idle()  # lost or unusable: this try reconnects once, a later one afresh
                if fresh or not isinstance(exc, psycopg.OperationalError):
                    raise
                log.info("the learner lock's kept connection was lost while idle (%s); trying on a new one",
                         " ".join(str(exc).split())[:200])
        if not got:
            return False
        if self._thread.stopping.is_set():
            self._close_idle()  # its session ends: PostgreSQL releases the lock just taken
            return False
        self._idle, self._conn = None, conn
        self.stats.is_learner = True
        self.stats.acquisitions += 1
        self._buffered.clear()
        self.reload()  # nobody else writes versions now: what the database holds is the newest
        log.info("this replica is now the learner of bank schema %s", self.db.where.schema)
        return True

    def reload(self) -> list[str]:
        """Swap in every newer stored version of the loaded keys."""
        latest = self.versions.latest()
        reloaded = self.registry.refresh(latest)
        self.stats.reloads += len(reloaded)
        return reloaded

    def apply_pending(self) -> int:
        """Record every unapplied feedback row; commit a version per optimizer step. Returns rows recorded."""
        conn = self._conn
        if conn is None:
            return 0
        held = [seq for seqs in self._buffered.values() for seq in seqs]
        with conn.transaction(), conn.cursor() as cur:
            rows = unapplied_feedback(cur, exclude=held, limit=self.batch_rows)
        for row in rows:
            key = row.selection.reranker_key
            with self.registry.lock:
                learner = self.registry.get(key)
                before = learner.stats.updates
                try:
                    learner.record(rebuild(row.selection), torch.tensor(row.rewards, dtype=torch.float32))
                except OptimizerStepError:  # the learner part-stepped, not a bad row: the round stops, row kept
                    self._touched.add(key)  # so losing the lease drops it: reloaded from the database
                    raise
                except (ValueError, TypeError, IndexError, RuntimeError) as exc:  # the row, not the database
                    with conn.transaction(), conn.cursor() as cur:
                        skip_unlearnable(cur, row.seq, f"{type(exc).__name__}: {exc}")
                    continue
                self._buffered[key].append(row.seq)
                self._touched.add(key)
                stepped = learner.stats.updates > before
                snapshot = copy.deepcopy(learner) if stepped else None
            if snapshot is not None:
                self._commit(key, snapshot)
        return len(rows)

    def _commit(self, key: str, learner: Any) -> None:
        """Write `learner` (just stepped) as `key`'s next version and mark its batch applied, atomically."""
        assert self._conn is not None
        seqs = self._buffered.pop(key, [])
        version = int(learner.stats.step)
        data = learner_to_bytes(learner) if version != self.registry.version_of(key) else None
        with self._conn.transaction(), self._conn.cursor() as cur:
            if data is not None:
                self.versions.write(cur, key, version, data)
            mark_applied(cur, seqs, version)  # a skipped (non-finite) update consumes its batch at the same version
        with self.registry.lock:
            if key in self.registry:
                self.registry.install(key, self.registry.get(key), version)
        self.stats.applied += len(seqs)
        self.stats.versions_written += data is not None

    # ---- promotion (rmm.serve.shadow) --------------------------------------------------------
    def promote(self, key: str, weights: dict[str, torch.Tensor], timeout_s: float = 30.0) -> int:
        """Serve `weights` for `key` on every replica: the lease thread writes them as the key's next
        reranker version on the lock's connection (so only the learner can, fenced like its own
        versions) and keeps learning from them; the other replicas load it within `reload_interval_s`.
        Returns the version written. Refused (RuntimeError) on a replica that is not the learner."""
        if self._conn is None:
            raise RuntimeError("this replica is not the learner: only the learner writes reranker versions")
        done: Future[int] = Future()
        self._promotions.put((key, weights, done))
        return done.result(timeout_s)

    def _promote_waiting(self) -> None:
        """Write the promotions waiting (lease thread, after a round)."""
        while True:
            try:
                key, weights, done = self._promotions.get_nowait()
            except queue.Empty:
                return
            try:
                assert self._conn is not None
                # a partial batch stays buffered (and unapplied in the database): the learner records
                # carry their own μ, so it is learned on the promoted weights at the next step
                with self.registry.lock:
                    snapshot = copy.deepcopy(self.registry.get(key))
                version = adopt_weights(snapshot, weights)
                with self._conn.transaction(), self._conn.cursor() as cur:
                    self.versions.write(cur, key, version, learner_to_bytes(snapshot))
                with self.registry.lock:
                    self.registry.install(key, snapshot, version)
                self.stats.versions_written += 1
                done.set_result(version)
            except BaseException as exc:  # the caller hears why; the loop decides about the lease
                done.set_exception(exc)
                raise

    # ---- losing the role ---------------------------------------------------------------------
    def _lose_lease(self) -> None:
        """Forget what this learner recorded but did not commit: its rerankers are reloaded from the
        database at next use (the rows are still unapplied there, for the next learner)."""
        was = self._conn is not None
        self._release()
        if was:
            with self.registry.lock:
                for key in self._touched:
                    self.registry.drop(key)
            self._touched.clear()
            self._buffered.clear()
            log.warning("this replica lost the learner lock (connection lost); another replica takes over")

    def _release(self) -> None:
        conn, self._conn = self._conn, None
        self.stats.is_learner = False
        _close(conn)  # the session ends: PostgreSQL releases the advisory lock
        while True:  # promotions still waiting cannot be written by this replica any more
            try:
                _, _, done = self._promotions.get_nowait()
            except queue.Empty:
                break
            done.set_exception(RuntimeError("this replica stopped being the learner before writing the promotion"))

    def _close_idle(self) -> None:
        conn, self._idle = self._idle, None
        _close(conn)


def _close(conn: psycopg.Connection[Any] | None) -> None:
    if conn is not None:
        try:
            conn.close()
        except Exception:
            log.debug("closing a learner lock connection failed", exc_info=True)

