"""Reflection jobs in PostgreSQL: claimed with `FOR UPDATE SKIP LOCKED`, so each runs once across replicas.

Same interface as the SQLite `rmm.serve.jobs.JobQueue` (the `Jobs` protocol). A job submitted on
any replica is a committed row; every replica's worker claims the oldest runnable job in one
statement — `SELECT … FOR UPDATE SKIP LOCKED` inside an `UPDATE … RETURNING` — so two replicas
never take the same job, and a user's sessions still run in the order they happened (a job waits
while an older job of its user is queued or running). A claim is a lease (`lease_until`, on the
database's clock) that the worker renews while the job runs; a worker that dies stops renewing,
and the job becomes claimable again once the lease has passed. A job whose claimers died
`max_attempts` times is marked failed instead of crashing replicas forever.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from typing import Any

from rmm.memory.pg_database import PgDatabase
from rmm.serve.background import Background
from rmm.serve.errors import UnknownJobError
from rmm.serve.jobs import Handler, Job

__all__ = ["PgJobQueue"]

log = logging.getLogger(__name__)

_NOW = "extract(epoch FROM clock_timestamp())"
_CLAIM = f"""
UPDATE jobs SET status = 'running', started_at = {_NOW}, lease_until = {_NOW} + %(lease)s,
                claimed_by = %(me)s, attempts = attempts + 1
WHERE id = (
    SELECT j.id FROM jobs j
    WHERE (j.status = 'queued' OR (j.status = 'running' AND j.lease_until < {_NOW}))
      AND j.attempts < %(max_attempts)s
      AND NOT EXISTS (SELECT 1 FROM jobs o WHERE o.user_id = j.user_id AND o.created_at < j.created_at
                      AND o.status IN ('queued', 'running'))
    ORDER BY j.created_at
    FOR UPDATE SKIP LOCKED
    LIMIT 1)
RETURNING id, tenant, user_id, kind, payload, created_at, attempts
"""
_GIVE_UP = f"""
UPDATE jobs SET status = 'failed', finished_at = {_NOW},
                error = 'the replica running it died ' || attempts || ' time(s); not retried'
WHERE status = 'running' AND lease_until < {_NOW} AND attempts >= %s
"""


_JOB_COLUMNS = "id, tenant, user_id, kind, status, created_at, started_at, finished_at, result, error"


def _job(row: tuple[Any, ...]) -> Job:
    """A `Job` from a row of `_JOB_COLUMNS`."""
    return Job(id=row[0], tenant=row[1], user_id=row[2], kind=row[3], status=row[4], created_at=row[5],
               started_at=row[6], finished_at=row[7], result=dict(row[8] or {}), error=row[9])


class PgJobQueue:
    """Jobs on a PostgreSQL bank schema (table `jobs`); one worker thread per replica."""

    def __init__(self, db: PgDatabase, handler: Handler, *, lease_s: float = 60.0, poll_s: float = 0.5,
                 max_attempts: int = 3) -> None:
        if lease_s <= 0 or poll_s <= 0 or max_attempts < 1:
            raise ValueError(f"need lease_s > 0, poll_s > 0, max_attempts >= 1; got {lease_s}, {poll_s}, {max_attempts}")
        self.db, self.handler = db, handler
        self.lease_s, self.poll_s, self.max_attempts = lease_s, poll_s, max_attempts
        self.worker_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self._wake = threading.Event()
        self._thread = Background("rmm-jobs-pg", self._work)

    def start(self) -> None:
        """Start the worker: it takes queued jobs, and jobs whose claimer's lease ran out."""
        self._thread.start()

    def submit(self, tenant: str, user_id: str, kind: str, payload: dict[str, Any],
               job_id: str | None = None) -> Job:
        """Commit the job (an acknowledged session is never lost) and wake this replica's worker.

        One session, one job: a reflection job for a session that already has one (concurrent
        `sessions/end` requests, a whole session posted again) conflicts on the unique index of
        migration 0005, and the job already there is returned instead of a second one; so does a job
        whose deterministic `job_id` is taken (`rmm.serve.event_jobs`)."""
        from psycopg.types.json import Jsonb

        job = Job(id=job_id or uuid.uuid4().hex, tenant=tenant, user_id=user_id, kind=kind, status="queued",
                  created_at=time.time())
        with self.db.tx() as cur:
            inserted = cur.execute(
                "INSERT INTO jobs (id, tenant, user_id, kind, payload, status, created_at) "
                "VALUES (%s, %s, %s, %s, %s, %s, %s) ON CONFLICT DO NOTHING RETURNING id",
                (job.id, tenant, user_id, kind, Jsonb(payload), job.status, job.created_at)).fetchone()
            if inserted is None:
                session_id = (payload.get("session") or {}).get("id")
                row = cur.execute(f"SELECT {_JOB_COLUMNS} FROM jobs WHERE user_id = %s AND kind = %s "
                                  "AND payload -> 'session' ->> 'id' = %s AND status <> 'cancelled'",
                                  (user_id, kind, session_id)).fetchone()
                if row is None:  # not the session index (a job id collision): nothing sound to answer
                    raise RuntimeError(f"job {job.id} conflicts with an existing job")
                log.info("session %r of %s already has job %s; not queued twice", session_id, user_id, row[0])
                return _job(row)
        self._wake.set()
        return job

    def get(self, tenant: str, job_id: str) -> Job:
        with self.db.tx() as cur:
            row = cur.execute(f"SELECT {_JOB_COLUMNS} FROM jobs WHERE id = %s", (job_id,)).fetchone()
        if row is None or row[1] != tenant:
            raise UnknownJobError(f"unknown job id {job_id!r} for this API key's tenant")
        return _job(row)

    def cancel_user(self, user_id: str) -> int:
        """Cancel the user's queued jobs (their user is being deleted)."""
        with self.db.tx() as cur:
            return cur.execute("UPDATE jobs SET status = 'cancelled', finished_at = %s WHERE user_id = %s "
                               "AND status = 'queued'", (time.time(), user_id)).rowcount

    def of_user(self, user_id: str) -> list[tuple[Job, dict[str, Any]]]:
        """Every job of the user with its payload (the session it reflects), oldest first."""
        with self.db.tx() as cur:
            rows = cur.execute(f"SELECT {_JOB_COLUMNS}, payload FROM jobs WHERE user_id = %s ORDER BY created_at, id",
                               (user_id,)).fetchall()
        return [(_job(row[:-1]), dict(row[-1])) for row in rows]

    def delete_user(self, user_id: str) -> int:
        """Delete every job row of the user (their payloads hold the sessions' turns)."""
        with self.db.tx() as cur:
            return cur.execute("DELETE FROM jobs WHERE user_id = %s", (user_id,)).rowcount

    def counts(self) -> dict[str, int]:
        with self.db.tx() as cur:
            return {str(s): int(n) for s, n in cur.execute("SELECT status, count(*) FROM jobs GROUP BY status")}

    def claim(self) -> tuple[Job, dict[str, Any]] | None:
        """Take the oldest runnable job (None when there is none); public for tests and tools."""
        with self.db.tx() as cur:
            cur.execute(_GIVE_UP, (self.max_attempts,))
            row = cur.execute(_CLAIM, {"lease": self.lease_s, "me": self.worker_id,
                                       "max_attempts": self.max_attempts}).fetchone()
        if row is None:
            return None
        if row[6] > 1:
            log.warning("job %s claimed again (attempt %d): its previous claimer's lease ran out", row[0], row[6])
        job = Job(id=row[0], tenant=row[1], user_id=row[2], kind=row[3], status="running", created_at=row[5])
        return job, dict(row[4])

    def run_one(self) -> bool:
        """Claim and run one job here (renewing its lease meanwhile); False when none was runnable."""
        claimed = self.claim()
        if claimed is None:
            return False
        job, payload = claimed
        done = threading.Event()
        renewer = threading.Thread(target=self._renew, args=(job.id, done), name="rmm-jobs-lease", daemon=True)
        renewer.start()
        try:
            result: dict[str, Any] | None = self.handler(job, payload)
            status, error = "done", None
        except Exception as exc:  # a failed job is reported through its status, never lost silently
            log.exception("job %s failed", job.id)
            result, status, error = None, "failed", f"{type(exc).__name__}: {exc}"
        finally:
            done.set()
            renewer.join()
        from psycopg.types.json import Jsonb

        with self.db.tx() as cur:
            n = cur.execute("UPDATE jobs SET status = %s, finished_at = %s, result = %s, error = %s, lease_until = NULL "
                            "WHERE id = %s AND claimed_by = %s AND status = 'running'",
                            (status, time.time(), None if result is None else Jsonb(result), error, job.id,
                             self.worker_id)).rowcount
        if n == 0:
            log.warning("job %s finished here after its lease was lost (another replica may have run it too)", job.id)
        return True

    def _renew(self, job_id: str, done: threading.Event) -> None:
        while not done.wait(self.lease_s / 3):
            try:
                with self.db.tx() as cur:
                    cur.execute(f"UPDATE jobs SET lease_until = {_NOW} + %s WHERE id = %s AND claimed_by = %s",
                                (self.lease_s, job_id, self.worker_id))
            except Exception:  # the next renewal may succeed; the lease is three renewals long
                log.exception("could not renew the lease of job %s", job_id)

    def _work(self) -> None:
        while not self._thread.stopping.is_set():
            try:
                ran = self.run_one()
            except Exception:  # the database is away: keep trying, never take the replica down
                log.exception("reflection job worker could not claim a job")
                ran = False
            if not ran:
                self._wake.wait(self.poll_s)
                self._wake.clear()

    def close(self, timeout: float = 60.0) -> None:
        """Let the running job finish; queued jobs stay queued for any replica."""
        self._thread.stopping.set()
        self._wake.set()  # out of its poll wait now
        if not self._thread.stop(timeout):
            log.warning("a reflection job was still running at shutdown; its lease runs out and another "
                        "replica (or the next start) runs it again")
