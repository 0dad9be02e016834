"""Background jobs (prospective reflection of ended sessions), durable and queryable.

Reflection takes seconds (an LLM call per speaker, or the fallback's segmentation), far too long
to hold an HTTP request open, so ending a session records a job and returns its id. Jobs are
rows in `jobs.sqlite` beside the bank, so a session handed over is not lost when the server
stops: queued jobs, and jobs that were running when it died, run again at the next start.
One worker thread runs them in order (the reflector is not built for concurrent use, and a
user's sessions must be reflected in the order they happened).
"""

from __future__ import annotations

import json
import logging
import queue
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from rmm.serve.errors import UnknownJobError

__all__ = ["Handler", "Job", "JobQueue", "JobStatus", "Jobs"]

log = logging.getLogger(__name__)

JobStatus = Literal["queued", "running", "done", "failed", "cancelled"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id          TEXT PRIMARY KEY,
    tenant      TEXT NOT NULL,
    user_id     TEXT NOT NULL,
    kind        TEXT NOT NULL,
    payload     TEXT NOT NULL,
    status      TEXT NOT NULL,
    created_at  REAL NOT NULL,
    started_at  REAL,
    finished_at REAL,
    result      TEXT,
    error       TEXT
);
CREATE INDEX IF NOT EXISTS jobs_status ON jobs(status);
CREATE INDEX IF NOT EXISTS jobs_user ON jobs(user_id);
"""
# One session, one reflection job, enforced by the database as on PostgreSQL (migration 0005): a
# second job for a session (concurrent ends, a whole session posted again) conflicts on this index
# and `submit` answers the job already there. Duplicates an older rmm left are cancelled first,
# keeping the oldest job of each session; cancelled jobs (their user was deleted) do not count.
_ONE_JOB_PER_SESSION = """
UPDATE jobs SET status = 'cancelled', finished_at = coalesce(finished_at, CAST(strftime('%s', 'now') AS REAL)),
                error = coalesce(error, 'duplicate of an older job of its session (one session, one job)')
WHERE id IN (SELECT id FROM (
    SELECT id, row_number() OVER (PARTITION BY user_id, json_extract(payload, '$.session.id')
                                  ORDER BY created_at, rowid) AS n
    FROM jobs WHERE kind = 'reflect' AND status <> 'cancelled') WHERE n > 1);
CREATE UNIQUE INDEX IF NOT EXISTS jobs_one_per_session ON jobs (user_id, json_extract(payload, '$.session.id'))
    WHERE kind = 'reflect' AND status <> 'cancelled';
"""


@dataclass
class Job:
    id: str
    tenant: str
    user_id: str  # tenant-scoped
    kind: str
    status: JobStatus
    created_at: float
    started_at: float | None = None
    finished_at: float | None = None
    result: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    # not stored: the `events` job queued with this reflection job (the answer of ending a session)
    events_job_id: str | None = None


Handler = Callable[[Job, dict[str, Any]], dict[str, Any]]


class Jobs(Protocol):
    """A durable job queue: `JobQueue` (SQLite beside the bank, one server) or
    `rmm.serve.pg_jobs.PgJobQueue` (PostgreSQL, claimed once across replicas)."""

    def start(self) -> None: ...

    def submit(self, tenant: str, user_id: str, kind: str, payload: dict[str, Any],
               job_id: str | None = None) -> Job: ...

    def get(self, tenant: str, job_id: str) -> Job: ...

    def cancel_user(self, user_id: str) -> int: ...

    def of_user(self, user_id: str) -> list[tuple[Job, dict[str, Any]]]: ...

    def delete_user(self, user_id: str) -> int: ...

    def counts(self) -> dict[str, int]: ...

    def close(self, timeout: float = 60.0) -> None: ...


_COLUMNS = "id, tenant, user_id, kind, status, created_at, started_at, finished_at, result, error"


def _row_job(row: tuple[Any, ...]) -> Job:
    """A `Job` from a row of `_COLUMNS`."""
    return Job(id=row[0], tenant=row[1], user_id=row[2], kind=row[3], status=row[4], created_at=row[5],
               started_at=row[6], finished_at=row[7], result=json.loads(row[8]) if row[8] else {}, error=row[9])


class JobQueue:
    """`submit` commits the job (synchronous=FULL: an acknowledged session is never lost) and
    wakes the worker; `handler(job, payload) -> result` does the work."""

    def __init__(self, path: str | Path, handler: Handler) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.handler = handler
        self._lock = threading.Lock()
        self._conn = sqlite3.connect(str(self.path), timeout=30.0, check_same_thread=False, isolation_level=None)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=FULL")
        self._conn.execute("PRAGMA secure_delete=ON")  # a deleted user's session text is zeroed, not left in free pages
        self._conn.executescript(_SCHEMA)
        if not self._conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'jobs_one_per_session'").fetchone():
            self._conn.executescript(f"BEGIN IMMEDIATE; {_ONE_JOB_PER_SESSION} COMMIT;")
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the worker, re-queueing what an earlier run left queued or half-done."""
        if self._thread is not None:
            return
        with self._lock:
            leftover = [r[0] for r in self._conn.execute(
                "SELECT id FROM jobs WHERE status IN ('queued', 'running') ORDER BY created_at")]
            self._conn.execute("UPDATE jobs SET status='queued', started_at=NULL WHERE status='running'")
        if leftover:
            log.info("resuming %d reflection job(s) left by an earlier run", len(leftover))
        for job_id in leftover:
            self._queue.put(job_id)
        self._thread = threading.Thread(target=self._work, name="rmm-jobs", daemon=True)
        self._thread.start()

    def submit(self, tenant: str, user_id: str, kind: str, payload: dict[str, Any],
               job_id: str | None = None) -> Job:
        """Commit the job and wake the worker; a reflection job for a session that already has one
        conflicts on `jobs_one_per_session` and the job already there is returned instead. `job_id`
        (default: a new random id) lets a kind make its ids deterministic, so that a job submitted
        again conflicts on the primary key and is answered the same way (`rmm.serve.event_jobs`)."""
        job = Job(id=job_id or uuid.uuid4().hex, tenant=tenant, user_id=user_id, kind=kind, status="queued",
                  created_at=time.time())
        with self._lock:
            inserted = self._conn.execute(
                "INSERT INTO jobs(id, tenant, user_id, kind, payload, status, created_at) VALUES (?,?,?,?,?,?,?) "
                "ON CONFLICT DO NOTHING",
                (job.id, tenant, user_id, kind, json.dumps(payload), job.status, job.created_at),
            ).rowcount
            if not inserted:
                session_id = (payload.get("session") or {}).get("id")
                row = self._conn.execute(
                    f"SELECT {_COLUMNS} FROM jobs WHERE user_id=? AND kind=? AND status <> 'cancelled' "
                    "AND json_extract(payload, '$.session.id') = ?", (user_id, kind, session_id)).fetchone()
                if row is None:  # not the session index (a job id collision): nothing sound to answer
                    raise RuntimeError(f"job {job.id} conflicts with an existing job")
                log.info("session %r of %s already has job %s; not queued twice", session_id, user_id, row[0])
                return _row_job(row)
        self._queue.put(job.id)
        return job

    def get(self, tenant: str, job_id: str) -> Job:
        with self._lock:
            row = self._conn.execute(f"SELECT {_COLUMNS} FROM jobs WHERE id=?", (job_id,)).fetchone()
        if row is None or row[1] != tenant:
            raise UnknownJobError(f"unknown job id {job_id!r} for this API key's tenant")
        return _row_job(row)

    def cancel_user(self, user_id: str) -> int:
        """Cancel the user's queued jobs (their user is being deleted)."""
        with self._lock:
            return self._conn.execute(
                "UPDATE jobs SET status='cancelled', finished_at=? WHERE user_id=? AND status='queued'",
                (time.time(), user_id)).rowcount

    def of_user(self, user_id: str) -> list[tuple[Job, dict[str, Any]]]:
        """Every job of the user with its payload (the session it reflects), oldest first: what an
        export of the user reads."""
        with self._lock:
            rows = self._conn.execute(f"SELECT {_COLUMNS}, payload FROM jobs WHERE user_id=? ORDER BY created_at, rowid",
                                      (user_id,)).fetchall()
        return [(_row_job(r[:-1]), json.loads(r[-1])) for r in rows]

    def delete_user(self, user_id: str) -> int:
        """Delete every job row of the user (their payloads hold the sessions' turns): the user is
        being erased. Call `cancel_user` first to count what was still queued."""
        with self._lock:
            return self._conn.execute("DELETE FROM jobs WHERE user_id=?", (user_id,)).rowcount

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {status: n for status, n in self._conn.execute("SELECT status, COUNT(*) FROM jobs GROUP BY status")}

    def _work(self) -> None:
        while True:
            job_id = self._queue.get()
            if job_id is None:
                return
            with self._lock:
                row = self._conn.execute("SELECT tenant, payload, status FROM jobs WHERE id=?", (job_id,)).fetchone()
                if row is None or row[2] != "queued":
                    continue  # cancelled meanwhile
                started = time.time()
                self._conn.execute("UPDATE jobs SET status='running', started_at=? WHERE id=?", (started, job_id))
            try:
                job = self.get(row[0], job_id)
                result = self.handler(job, json.loads(row[1]))
                status, error, result_text = "done", None, json.dumps(result)
            except Exception as exc:  # a failed job is reported through its status, never lost silently
                log.exception("job %s failed", job_id)
                status, error, result_text = "failed", f"{type(exc).__name__}: {exc}", None
            with self._lock:
                self._conn.execute("UPDATE jobs SET status=?, finished_at=?, result=?, error=? WHERE id=?",
                                   (status, time.time(), result_text, error, job_id))

    def close(self, timeout: float = 60.0) -> None:
        """Let the running job finish (queued ones stay queued for the next start)."""
        if self._thread is not None:
            # Drop what is queued in memory; the rows stay 'queued' and resume at the next start.
            try:
                while True:
                    self._queue.get_nowait()
            except queue.Empty:
                pass
            self._queue.put(None)
            self._thread.join(timeout)
            if self._thread.is_alive():  # leave its connection open: the daemon thread dies with the process
                log.warning("a reflection job was still running at shutdown; it will run again at the next start")
                return
            self._thread = None
        with self._lock:
            self._conn.close()
