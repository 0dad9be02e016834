"""The `events` reflection job: an ended session added to its user's CompassMem event graph.

With `reflection_events: true` in the server's config, ending a session (or posting a whole one)
queues, beside the session's `reflect` job, one `events` job on the same durable job tables
(`rmm.serve.jobs` on SQLite, `rmm.serve.pg_jobs` on PostgreSQL). It runs
`rmm.reflection.events.EventGraphBuilder` on that one session: the LLM builder when the server has
an LLM configured, the labelled non-LLM fallback otherwise (topic segments as events, ``next``
edges, cross-session ``similar`` edges, topics).

One session, one job: the job's id is derived from the (tenant-scoped) user and the session id,
so a session ended or posted again conflicts on the job table's primary key and the job already
there is answered (on either store, across replicas), and the builder itself skips a session it
recorded as built (a job that runs again after a crash adds nothing twice). A failure is recorded
on the job (`failed`, with its error); the builder writes each session in one transaction, so a
failed job leaves the stored memories and graph as they were.
"""

from __future__ import annotations

import logging
import threading
import uuid
from typing import TYPE_CHECKING, Any

from rmm.memory.bank import MemoryBank
from rmm.types import Session, Turn

if TYPE_CHECKING:
    from rmm.llm.base import LLM
    from rmm.reflection.events import EventGraphBuilder
    from rmm.serve.jobs import Job

__all__ = ["EVENTS_KIND", "EventGraphJobs", "events_job_id", "session_from_payload"]

log = logging.getLogger(__name__)

EVENTS_KIND = "events"
_NAMESPACE = uuid.UUID("5f0c7a8e-3d2b-4c1e-9a57-6b1d2e3f4a5c")  # rmm's event-graph jobs


def events_job_id(user_id: str, session_id: str) -> str:
    """The one `events` job id of a session of a (tenant-scoped) user."""
    return uuid.uuid5(_NAMESPACE, f"{user_id}\x00{session_id}").hex


def session_from_payload(user_id: str, payload: dict[str, Any]) -> Session:
    """The session a job's payload carries (the shape `SessionReflection` submits)."""
    raw = payload["session"]
    return Session(id=raw["id"], user_id=user_id, time=raw.get("time"),
                   turns=[Turn(id=t["id"], session_id=raw["id"], speaker=t["speaker"], text=t["text"],
                               time=t.get("time")) for t in raw["turns"]])


class EventGraphJobs:
    """Runs `events` jobs over the bank; the builder is made at the first job and reused (one job
    at a time per worker, and its lock makes that so for any caller)."""

    def __init__(self, bank: MemoryBank, llm: LLM | None) -> None:
        self.bank, self.llm = bank, llm
        self._builder: EventGraphBuilder | None = None
        self._lock = threading.Lock()

    @property
    def method(self) -> str:
        return "llm" if self.llm is not None else "fallback (non-LLM topic segmentation)"

    def _get_builder(self) -> EventGraphBuilder:
        if self._builder is None:
            from rmm.reflection.events import EventGraphBuilder

            self._builder = EventGraphBuilder(self.bank, self.llm)
        return self._builder

    def run(self, job: Job, payload: dict[str, Any]) -> dict[str, Any]:
        """Add the payload's session to the job's user's graph; returns the build's report with the
        ids of the events it inserted (merged-into events keep their ids)."""
        session = session_from_payload(job.user_id, payload)
        store = self.bank.store
        with self._lock:
            before = _event_ids(store, job.user_id)
            report = self._get_builder().build(job.user_id, [session])
            after = _event_ids(store, job.user_id)
        return {"session": session.id, "method": self.method, "events": sorted(after - before),
                "built": report.sessions == 1, "report": report.to_json()}


def _event_ids(store: Any, user_id: str) -> set[str]:
    if not store.has_user(user_id):
        return set()
    return {m.id for m in store.memories(user_id) if m.kind == "event"}
