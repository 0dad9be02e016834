"""A dataset in rmm's format into a live bank: `plan_import`, then `run_import` (`rmm data import`).

What goes in, through the service's own write paths (no second implementation of storing or
reflecting): every turn as a `turn` memory (`RetrievalService.add_memories`; id = the turn's id,
text `speaker: text`, the shape reflection's `store_turns` writes), every `memory` record of the
file (an export's: id, times and provenance kept, as `import_user` restores them; events with their
participants, then the file's `edge` and `topic` records, through `export.write_graph`: edges
pool their evidence and memberships are sets, so a rerun writes them again harmlessly), the latest
version of each tree `node` the user's tree does not hold yet (`export.write_tree`, one
transaction per user, after the memories it points at), and with
`reflect` each session handed to the service's prospective reflection (`add_session`, a
background job per session, which builds topic memories). Questions and feedback records are not
stored: questions are evaluation data, and feedback cannot be replayed without the candidates'
embeddings it was learned from (see `import_user`).

Resumable after a kill, with no duplicates, by deterministic ids taken from the file rather than a
progress record beside the bank: a progress record can disagree with the bank (written before or
after the batch it counts, or a bank restored from a backup), while the bank itself cannot.
`plan_import` reads which of the file's memory ids the bank holds and leaves those out; every
batch is one transaction of the store (SQLite or PostgreSQL), so a kill leaves whole batches and
the rerun writes exactly the rest. Sessions are reflected once per session id because the job
tables allow one reflection job per session (`jobs_one_per_session`, PostgreSQL's migration 0005):
a rerun's `add_session` answers the job already there (queued jobs survive the kill and run at the
next start). An id the bank holds with another text is a conflict, refused before anything is
written. What stays at least once is the service's own: a reflection job killed while it ran runs
again from the start at the next start, so that one session's topic memories may be written twice.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rmm.data.jsonl import JsonlContent
from rmm.errors import DataError, UnknownUserError
from rmm.memory.tree import TreeNode
from rmm.serve.export import latest_nodes, memory_from_record, write_graph, write_tree
from rmm.serve.records import NewMemory
from rmm.serve.tenants import callers_terms, scoped
from rmm.types import Memory, Session

if TYPE_CHECKING:
    from rmm.serve.jobs import Job
    from rmm.serve.service import RetrievalService

__all__ = ["ImportPlan", "ImportReport", "UserPlan", "plan_import", "run_import", "turn_memory"]

log = logging.getLogger(__name__)

_FINISHED = ("done", "failed", "cancelled")


def turn_memory(speaker: str, text: str, turn_id: str, time_: str | None) -> NewMemory:
    """A turn as a `turn` memory, as reflection's `store_turns` stores one."""
    return NewMemory(text=f"{speaker}: {text}", kind="turn", id=turn_id, refs=[turn_id], source_text=text, time=time_)


@dataclass
class UserPlan:
    """What one user still needs: turn memories, the file's memories, sessions to reflect."""

    user: str
    turns: list[NewMemory] = field(default_factory=list)
    memories: list[Memory] = field(default_factory=list)
    sessions: list[Session] = field(default_factory=list)
    present: int = 0  # memories of the file the bank already holds (an earlier run's)
    participants: dict[str, list[str]] = field(default_factory=dict)  # of the file's events
    edges: list[dict] = field(default_factory=list)  # the event graph's records (written every run)
    topics: list[dict] = field(default_factory=list)
    nodes: list[TreeNode] = field(default_factory=list)  # the tree's nodes (latest versions; present ones skipped)


@dataclass
class ImportPlan:
    users: list[UserPlan]
    empty_users: list[str]  # declared, with nothing to store (a bank holds users through their memories)

    @property
    def total(self) -> int:
        """Units of work the progress counts: memories to write and sessions to reflect."""
        return sum(len(u.turns) + len(u.memories) + len(u.sessions) for u in self.users)

    @property
    def present(self) -> int:
        return sum(u.present for u in self.users)


@dataclass
class ImportReport:
    users: int = 0
    turn_memories: int = 0
    memories: int = 0
    already_present: int = 0
    sessions_reflected: int = 0
    topic_memories: int = 0
    failed_sessions: list[str] = field(default_factory=list)
    edges: int = 0  # the event graph's edge and topic records written
    topics: int = 0
    tree_nodes: int = 0  # tree nodes added (a rerun adds none)


def plan_import(service: RetrievalService, tenant: str, content: JsonlContent, *, turns: bool = True,
                reflect: bool = False) -> ImportPlan:
    """What the bank lacks of `content`; DataError (nothing written) when one of the file's ids is
    stored with another text: the bank holds something else under that id."""
    dataset = content.dataset
    file_memories: dict[str, list[dict]] = {}
    for record in content.memories:
        file_memories.setdefault(record["user"], []).append(record)
    file_graph: dict[str, tuple[list[dict], list[dict]]] = {}
    for record in content.edges:
        file_graph.setdefault(record["user"], ([], []))[0].append(record)
    for record in content.topics:
        file_graph.setdefault(record["user"], ([], []))[1].append(record)
    file_nodes: dict[str, list[dict]] = {}
    for record in content.nodes:
        file_nodes.setdefault(record["user"], []).append(record)
    tree_of = {user: latest_nodes(records) for user, records in file_nodes.items()}  # DataError before any write
    plans, empty, conflicts = [], [], []
    for user in dataset.users:
        try:
            stored = {m.id: m.text for m in service.memories(tenant, user)}
        except UnknownUserError:
            stored = {}
        plan = UserPlan(user)
        plan.edges, plan.topics = file_graph.get(user, ([], []))
        plan.nodes = tree_of.get(user, [])
        own = file_memories.get(user, [])
        plan.participants = {m["id"]: list(m.get("participants", [])) for m in own if m["kind"] == "event"}
        owned_ids = {m["id"] for m in own}  # an export's stored turn wins over its turn record
        wanted: list[tuple[str, str]] = []
        for record in own:
            wanted.append((record["id"], record["text"]))
            if record["id"] not in stored:
                plan.memories.append(memory_from_record(record, scoped(tenant, user)))
        if turns:
            for turn in dataset.turns(user):
                if turn.id in owned_ids:
                    continue
                memory = turn_memory(turn.speaker, turn.text, turn.id, turn.time)
                wanted.append((turn.id, memory.text))
                if turn.id not in stored:
                    plan.turns.append(memory)
        for memory_id, text in wanted:
            if memory_id in stored:
                if stored[memory_id] != text:
                    conflicts.append(f"user {user!r}: memory {memory_id!r} is stored with another text")
                plan.present += 1
        if reflect:
            plan.sessions = [s for s in dataset.sessions.get(user, []) if s.turns]
        if plan.turns or plan.memories or plan.sessions or plan.present or plan.edges or plan.topics or plan.nodes:
            plans.append(plan)
        else:
            empty.append(user)
    if conflicts:
        shown = "\n  ".join(conflicts[:20]) + (f"\n  … and {len(conflicts) - 20} more" if len(conflicts) > 20 else "")
        raise DataError(f"{len(conflicts)} id(s) of the file are stored with other content; nothing was imported:\n"
                        f"  {shown}")
    return ImportPlan(plans, empty)


def run_import(service: RetrievalService, tenant: str, plan: ImportPlan, *, batch_size: int = 256,
               progress: Callable[[int], None] | None = None, poll: float = 0.05) -> ImportReport:
    """Write the plan in batches of `batch_size` memories (each one transaction), then hand each
    session to reflection and wait for its job; `progress(n)` after every n units done."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    advance = progress or (lambda n: None)
    report = ImportReport(users=len(plan.users), already_present=plan.present)
    for user in plan.users:
        for start in range(0, len(user.turns), batch_size):
            batch = user.turns[start:start + batch_size]
            service.add_memories(tenant, user.user, batch)
            report.turn_memories += len(batch)
            advance(len(batch))
        user_id = scoped(tenant, user.user)
        for start in range(0, len(user.memories), batch_size):
            records = user.memories[start:start + batch_size]
            with callers_terms(tenant, user.user):
                service.bank.add(user_id, [m for m in records if m.kind != "event"])
                write_graph(service, user_id, [(m, user.participants.get(m.id, [])) for m in records
                                               if m.kind == "event"], [], [])
            report.memories += len(records)
            advance(len(records))
        if user.edges or user.topics:  # every event is stored by now: the graph rows between them
            with callers_terms(tenant, user.user):
                written = write_graph(service, user_id, [], user.edges, user.topics)
            report.edges += written["edges"]
            report.topics += written["topics"]
        if user.nodes:  # every memory is stored by now: the nodes pointing at them
            with callers_terms(tenant, user.user):
                report.tree_nodes += write_tree(service, user_id, user.nodes)
    jobs: dict[str, tuple[str, Job]] = {}
    for user in plan.users:
        for session in user.sessions:
            job = service.add_session(tenant, user.user, list(session.turns), session_id=session.id,
                                      time_=session.time, events=False if user.participants else None)
            jobs[job.id] = (session.id, job)
    while jobs:
        for job_id, (session_id, job) in list(jobs.items()):
            if job.status not in _FINISHED:
                job = service.job(tenant, job_id)
            if job.status not in _FINISHED:
                jobs[job_id] = (session_id, job)
                continue
            del jobs[job_id]
            if job.status == "done":
                report.sessions_reflected += 1
                report.topic_memories += len(job.result.get("memories", []))
            else:
                log.warning("session %s: reflection %s (%s)", session_id, job.status, job.error)
                report.failed_sessions.append(session_id)
            advance(1)
        if jobs:
            time.sleep(poll)
    return report
