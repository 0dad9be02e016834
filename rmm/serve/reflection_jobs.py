"""Open sessions and their prospective reflection, run as durable background jobs.

Turns are appended to the user's open session as they arrive; ending the session (or posting a
whole finished one) records a reflection job and answers at once, because reflecting takes
seconds. The job queue is this module's: it runs `run` for each job, in order, in one worker.

With `reflection_tree` each user's Semantic XPath tree of the bank (`rmm.reflection.xpath_tree.BankTree`:
``User → Session → Topic/Event/Turn → Turn``) is kept current: the reflector's hook places what a
session added (and versions what it merged into), and after every job `BankTree.sync` places what
the tree does not show yet (stored turns, an `events` job's events). A tree write that fails is
counted in the job's result (`tree.failures`), never fails the job: the memories are stored, and
the next sync places them.

The session log keys sessions by the tenant-scoped user id and names them after it; the ids it
makes are handed out (and stored as memory ids and refs) without the tenant part, so a tenant
only ever sees ids it could have named itself.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rmm.memory.bank import MemoryBank
from rmm.memory.sessions import SessionLog
from rmm.serve.errors import NoOpenSessionError
from rmm.serve.event_jobs import EVENTS_KIND, EventGraphJobs, events_job_id, session_from_payload
from rmm.serve.jobs import Handler, Job, JobQueue, Jobs
from rmm.serve.tenants import scoped, unscoped_id
from rmm.types import Memory, Session, Turn

if TYPE_CHECKING:
    from rmm.llm.base import LLM
    from rmm.reflection import ProspectiveReflector
    from rmm.reflection.xpath_tree import BankTree, TreeReport

__all__ = ["SessionReflection"]

log = logging.getLogger(__name__)


class SessionReflection:
    """Sessions in, reflection jobs out; `jobs` must be started (and closed) by the owner."""

    def __init__(self, bank: MemoryBank, sessions: SessionLog, jobs_path: Path, llm: LLM | None, *,
                 speakers_exclude: list[str], jobs: Callable[[Handler], Jobs] | None = None,
                 events: bool = False, tree: bool = False) -> None:
        """`jobs` builds the queue around this object's handler (default: SQLite at `jobs_path`);
        `events`: each session also gets an `events` job (`rmm.serve.event_jobs`); `tree`: each
        job keeps the user's bank tree current (module docstring)."""
        self.bank, self.sessions, self.llm = bank, sessions, llm
        self._tree: BankTree | None = None
        if tree:
            from rmm.reflection.xpath_tree import BankTree

            self._tree = BankTree(bank)
        self.speakers_exclude = speakers_exclude
        self.events = events
        # built even when `events` is off: jobs queued while it was on still run after a restart
        self.event_graph = EventGraphJobs(bank, llm)
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
                    time_: str | None = None, speakers: list[str] | None = None, store_turns: bool = False,
                    events: bool | None = None) -> Job:
        """A whole finished session at once (e.g. importing history): reflected in the background.
        `events=False` queues no `events` job even when the server builds graphs (an imported graph
        already holds the session); None: the server's setting."""
        user_id = scoped(tenant, user)
        sid = session_id or f"{user}:session-{Memory.new_id()[:12]}"
        fixed = [Turn(id=t.id or f"{sid}:{n}", session_id=sid, speaker=t.speaker, text=t.text, time=t.time)
                 for n, t in enumerate(turns)]
        return self._submit(tenant, Session(id=sid, user_id=user_id, turns=fixed, time=time_), speakers, store_turns,
                            events=events)

    def _submit(self, tenant: str, session: Session, speakers: list[str] | None, store_turns: bool,
                events: bool | None = None) -> Job:
        """The session's `reflect` job, then (graphs on) its `events` job, which runs after it."""
        raw = {"id": session.id, "time": session.time,
               "turns": [{"id": t.id, "speaker": t.speaker, "text": t.text, "time": t.time} for t in session.turns]}
        build = self.events if events is None else events
        events_id = events_job_id(session.user_id, session.id) if build else None
        payload: dict[str, Any] = {"session": raw, "speakers": speakers, "store_turns": store_turns}
        if events_id is not None:
            payload["events_job"] = events_id
        job = self.jobs.submit(tenant, session.user_id, "reflect", payload)
        if events_id is not None:
            # a crash between the two submits leaves the session open (`end_session` clears it
            # after this returns): ending it again answers the reflect job and queues this one
            job.events_job_id = self.jobs.submit(tenant, session.user_id, EVENTS_KIND, {"session": raw},
                                                 job_id=events_id).id
        return job

    def job(self, tenant: str, job_id: str) -> Job:
        return self.jobs.get(tenant, job_id)

    @property
    def reflector(self) -> ProspectiveReflector:
        """Built on first use: the LLM (or the fallback) is only needed once a session ends."""
        if self._reflector is None:
            from rmm.reflection import ProspectiveReflector

            self._reflector = ProspectiveReflector(self.bank, self.llm)
            if self._tree is not None:
                self._tree.attach(self._reflector)
        return self._reflector

    def run(self, job: Job, payload: dict[str, Any]) -> dict[str, Any]:
        """One job (the queue's handler): an `events` job adds the session to the event graph
        (`rmm.serve.event_jobs`); a reflection job stores topic memories, optionally the raw turns."""
        before = None if self._tree is None else dataclasses.replace(self._tree.report, errors=[])
        if job.kind == EVENTS_KIND:
            return self._tree_synced(job.user_id, self.event_graph.run(job, payload), before)
        session = session_from_payload(job.user_id, payload)
        speakers = payload.get("speakers") or [s for s in dict.fromkeys(t.speaker for t in session.turns)
                                               if s not in self.speakers_exclude]
        touched = self.reflector.reflect(session, speakers=speakers) if speakers else []
        stored_turns: list[str] = []
        if payload.get("store_turns"):
            turns = [Memory(id=t.id, user_id=job.user_id, kind="turn", text=f"{t.speaker}: {t.text}", refs=[t.id],
                            source_text=t.text, time_span=(t.time, t.time)) for t in session.turns]
            stored_turns = self.bank.add(job.user_id, turns)
        result = {"memories": [m.id for m in touched], "turn_memories": stored_turns,
                  "method": "llm" if self.llm is not None else "fallback (non-LLM topic segmentation)",
                  "speakers": speakers}
        if payload.get("events_job"):
            result["events_job"] = payload["events_job"]
        return self._tree_synced(job.user_id, result, before)

    def _tree_synced(self, user_id: str, result: dict[str, Any], before: TreeReport | None) -> dict[str, Any]:
        """With `reflection_tree`: place what the user's tree does not show yet, and add what this
        job wrote to the tree (`tree`: nodes added and versioned, failed writes) to its result."""
        if self._tree is None or before is None:
            return result
        try:
            self._tree.sync(user_id)
        except Exception as error:  # noqa: BLE001 - the memories are stored; the next job's sync places them
            self._tree.report.failures += 1
            log.warning("tree of %s not synced: %s", user_id, error)
        after = self._tree.report
        result["tree"] = {"nodes_added": after.nodes_added - before.nodes_added,
                          "nodes_versioned": after.nodes_versioned - before.nodes_versioned,
                          "failures": after.failures - before.failures}
        return result


def _unscoped_turn(tenant: str, turn: Turn) -> Turn:
    return Turn(id=unscoped_id(tenant, turn.id), session_id=unscoped_id(tenant, turn.session_id),
                speaker=turn.speaker, text=turn.text, time=turn.time)
