"""Open sessions and their prospective reflection, run as durable background jobs.

Turns are appended to the user's open session as they arrive; ending the session (or posting a
whole finished one) records a reflection job and answers at once, because reflecting takes
seconds. The job queue is this module's: it runs `run` for each job, in order, in one worker.

The session log keys sessions by the tenant-scoped user id and names them after it; the ids it
makes are handed out (and stored as memory ids and refs) without the tenant part, so a tenant
only ever sees ids it could have named itself.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rmm.memory.bank import MemoryBank
from rmm.memory.sessions import SessionLog
from rmm.serve.errors import NoOpenSessionError
from rmm.serve.jobs import Handler, Job, JobQueue, Jobs
from rmm.serve.tenants import scoped, unscoped_id
from rmm.types import Memory, Session, Turn

if TYPE_CHECKING:
    from rmm.llm.base import LLM
    from rmm.reflection import ProspectiveReflector

__all__ = ["SessionReflection"]


class SessionReflection:
    """Sessions in, reflection jobs out; `jobs` must be started (and closed) by the owner."""

    def __init__(self, bank: MemoryBank, sessions: SessionLog, jobs_path: Path, llm: LLM | None, *,
                 speakers_exclude: list[str], jobs: Callable[[Handler], Jobs] | None = None) -> None:
        """`jobs` builds the queue around this object's handler (default: SQLite at `jobs_path`)."""
        self.bank, self.sessions, self.llm = bank, sessions, llm
        self.speakers_exclude = speakers_exclude
        self.jobs: Jobs = jobs(self.run) if jobs is not None else JobQueue(jobs_path, self.run)
        self._reflector: ProspectiveReflector | None = None
        # reading the open session, queueing its job and clearing it are one step: concurrent
        # ends of one session otherwise each queued a job (and a late clear could drop the turns
        # of the session opened after it); across replicas the job table's unique index decides
        self._ending = threading.Lock()

    def append_turns(self, tenant: str, user: str, turns: list[tuple[str, str]]) -> list[Turn]:
        """Append to the user's open session (committed before returning); ids as the tenant sees them."""
        return [_unscoped_turn(tenant, turn) for turn in self.sessions.append(scoped(tenant, user), turns)]

    def end_session(self, tenant: str, user: str, *, speakers: list[str] | None = None,
                    store_turns: bool = False) -> Job:
        """Hand the open session to a reflection job; the user's next turns open a new session."""
        user_id = scoped(tenant, user)
        with self._ending:
            session = self.sessions.current(user_id)
            if not session.turns:
                raise NoOpenSessionError(f"user {user!r} has no open session: post turns first")
            session = Session(id=unscoped_id(tenant, session.id), user_id=user_id, time=session.time,
                              turns=[_unscoped_turn(tenant, t) for t in session.turns])
            job = self._submit(tenant, session, speakers, store_turns)
            self.sessions.clear(user_id)  # after the job is committed: a crash between keeps both (no loss)
        return job

    def add_session(self, tenant: str, user: str, turns: list[Turn], *, session_id: str | None = None,
                    time_: str | None = None, speakers: list[str] | None = None, store_turns: bool = False) -> Job:
        """A whole finished session at once (e.g. importing history): reflected in the background."""
        user_id = scoped(tenant, user)
        sid = session_id or f"{user}:session-{Memory.new_id()[:12]}"
        fixed = [Turn(id=t.id or f"{sid}:{n}", session_id=sid, speaker=t.speaker, text=t.text, time=t.time)
                 for n, t in enumerate(turns)]
        return self._submit(tenant, Session(id=sid, user_id=user_id, turns=fixed, time=time_), speakers, store_turns)

    def _submit(self, tenant: str, session: Session, speakers: list[str] | None, store_turns: bool) -> Job:
        payload = {
            "session": {"id": session.id, "time": session.time,
                        "turns": [{"id": t.id, "speaker": t.speaker, "text": t.text, "time": t.time}
                                  for t in session.turns]},
            "speakers": speakers,
            "store_turns": store_turns,
        }
        return self.jobs.submit(tenant, session.user_id, "reflect", payload)

    def job(self, tenant: str, job_id: str) -> Job:
        return self.jobs.get(tenant, job_id)

    @property
    def reflector(self) -> ProspectiveReflector:
        """Built on first use: the LLM (or the fallback) is only needed once a session ends."""
        if self._reflector is None:
            from rmm.reflection import ProspectiveReflector

            self._reflector = ProspectiveReflector(self.bank, self.llm)
        return self._reflector

    def run(self, job: Job, payload: dict[str, Any]) -> dict[str, Any]:
        """One reflection job (the queue's handler): topic memories, optionally the raw turns too."""
        raw = payload["session"]
        session = Session(id=raw["id"], user_id=job.user_id, time=raw.get("time"),
                          turns=[Turn(id=t["id"], session_id=raw["id"], speaker=t["speaker"], text=t["text"],
                                      time=t.get("time")) for t in raw["turns"]])
        speakers = payload.get("speakers") or [s for s in dict.fromkeys(t.speaker for t in session.turns)
                                               if s not in self.speakers_exclude]
        touched = self.reflector.reflect(session, speakers=speakers) if speakers else []
        stored_turns: list[str] = []
        if payload.get("store_turns"):
            turns = [Memory(id=t.id, user_id=job.user_id, kind="turn", text=f"{t.speaker}: {t.text}", refs=[t.id],
                            source_text=t.text, time_span=(t.time, t.time)) for t in session.turns]
            stored_turns = self.bank.add(job.user_id, turns)
        return {"memories": [m.id for m in touched], "turn_memories": stored_turns,
                "method": "llm" if self.llm is not None else "fallback (non-LLM topic segmentation)",
                "speakers": speakers}


def _unscoped_turn(tenant: str, turn: Turn) -> Turn:
    return Turn(id=unscoped_id(tenant, turn.id), session_id=unscoped_id(tenant, turn.session_id),
                speaker=turn.speaker, text=turn.text, time=turn.time)
