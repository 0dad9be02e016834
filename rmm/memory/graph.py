"""CompassMem's event graph in the memory layer: events, directed labelled edges, topics.

An event is an ordinary `Memory` of kind ``event`` (its summary as text, its turn refs, an explicit
time), so the dense index, BM25 / hybrid, the reranker and ``/v1/retrieve`` treat it like any other
memory. What relates events lives in four tables beside ``memories``, written by both stores in the
same transaction as the memories they touch (`MemoryStorage.add_events`), so a failure or a crash
never leaves an edge to a missing event:

* ``graph_events``  (user_id, memory_id, participants): an event's participants (at most three);
* ``graph_edges``   (user_id, source, target, label, evidence): a directed edge with a free-form
  label and the turn ids that support it, one row per (source, target, label);
* ``graph_topics``  (user_id, topic, summary): the topic layer;
* ``graph_members`` (user_id, topic, memory_id): topic membership.

Deleting an event deletes its rows in all of them; deleting a user deletes all of theirs; a merge
moves the old events' edges and memberships onto the merged event (`rewire`). The SQL here is
shared by SQLite and PostgreSQL: written with ``?`` placeholders, which a store turns into its own
(`mark`), and JSON kept as text, so both stores run the very same statements. The stores check the
user and ids; this module only writes and reads rows on the cursor it is given.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from rmm.memory.validation import (
    as_matrix,
    check_edge,
    check_event,
    check_topic,
    check_user_name,
    duplicate_keys,
    require_events,
)
from rmm.types import Memory

__all__ = ["DIRECTIONS", "GRAPH_TABLES", "SQLITE_TABLES", "Direction", "Edge", "Event", "GraphWrite", "Topic"]

Direction = Literal["out", "in", "both"]
DIRECTIONS: tuple[str, ...] = ("out", "in", "both")

# SQLite's tables (created with a new store, or added in place to an older one by `store.py`);
# PostgreSQL's come from migration 0006.graph.sql, with foreign keys on top.
SQLITE_TABLES = """
CREATE TABLE IF NOT EXISTS graph_events (
    user_id      TEXT NOT NULL,
    memory_id    TEXT NOT NULL,
    participants TEXT NOT NULL,
    PRIMARY KEY (user_id, memory_id)
);
CREATE TABLE IF NOT EXISTS graph_edges (
    user_id  TEXT NOT NULL,
    source   TEXT NOT NULL,
    target   TEXT NOT NULL,
    label    TEXT NOT NULL,
    evidence TEXT NOT NULL,
    PRIMARY KEY (user_id, source, target, label)
);
CREATE INDEX IF NOT EXISTS graph_edges_target ON graph_edges (user_id, target);
CREATE TABLE IF NOT EXISTS graph_topics (
    user_id TEXT NOT NULL,
    topic   TEXT NOT NULL,
    summary TEXT NOT NULL,
    PRIMARY KEY (user_id, topic)
);
CREATE TABLE IF NOT EXISTS graph_members (
    user_id   TEXT NOT NULL,
    topic     TEXT NOT NULL,
    memory_id TEXT NOT NULL,
    PRIMARY KEY (user_id, topic, memory_id)
);
CREATE INDEX IF NOT EXISTS graph_members_memory ON graph_members (user_id, memory_id);
"""

GRAPH_TABLES: tuple[str, ...] = ("graph_members", "graph_topics", "graph_edges", "graph_events")


@dataclass(frozen=True)
class Edge:
    """A directed relation between two events; `evidence` are the dialogue turn ids supporting it."""

    source: str
    target: str
    label: str
    evidence: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "evidence", tuple(self.evidence))
        check_edge(self.source, self.target, self.label, self.evidence)

    def other(self, node: str) -> str:
        """The end of this edge that is not `node` (read from either end; a self-loop gives `node`)."""
        return self.target if self.source == node else self.source


@dataclass(frozen=True)
class Topic:
    """A topic of the topic layer; `members` are the event ids added to it by this write (or, read
    back, all of its members)."""

    id: str
    summary: str = ""
    members: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "members", tuple(self.members))
        check_topic(self.id, self.members)


@dataclass(frozen=True)
class Event:
    """An event node to write: its `Memory` (kind ``event``) and its participants (at most three)."""

    memory: Memory
    participants: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        object.__setattr__(self, "participants", tuple(self.participants))


@dataclass(frozen=True)
class GraphWrite:
    """One checked `add_events` call: the memories to insert and the graph rows to write after them."""

    user: str
    events: tuple[Event, ...]
    edges: tuple[Edge, ...]
    topics: tuple[Topic, ...]

    @classmethod
    def check(cls, user: str, events: Iterable[Event | Memory], edges: Iterable[Edge] = (),
              topics: Iterable[Topic] = ()) -> GraphWrite:
        """Refuse bad input before any transaction starts (a bare `Memory` is an event without
        participants): the user name, each event, the edge and topic records, duplicate ids."""
        check_user_name(user)
        checked = tuple(e if isinstance(e, Event) else Event(e) for e in events)
        for event in checked:
            check_event(user, event.memory, event.participants)
        edges = tuple(edges)
        topics = tuple(topics)
        for item, kind in [(e, Edge) for e in edges] + [(t, Topic) for t in topics]:
            if not isinstance(item, kind):
                raise TypeError(f"expected {kind.__name__}, got {type(item).__name__}")
        duplicate_keys([e.memory for e in checked])
        return cls(user, checked, edges, topics)

    @property
    def memories(self) -> list[Memory]:
        return [e.memory for e in self.events]

    def vectors(self, embeddings: Any) -> Any:
        """The events' embeddings as a checked [events, d] float32 matrix (None when none are given)."""
        return None if embeddings is None or not self.events else as_matrix(embeddings, len(self.events))


def _sql(statement: str, mark: str) -> str:
    return statement if mark == "?" else statement.replace("?", mark)


def _event_ids(cur: Any, mark: str, user: str, ids: Sequence[str]) -> set[str]:
    unique = list(dict.fromkeys(ids))
    found: set[str] = set()
    for start in range(0, len(unique), 500):
        chunk = unique[start : start + 500]
        marks = ",".join("?" * len(chunk))
        cur.execute(_sql(f"SELECT id FROM memories WHERE user_id=? AND kind='event' AND id IN ({marks})", mark),
                    (user, *chunk))
        found.update(r[0] for r in cur.fetchall())
    return found


def _merge_edges(cur: Any, mark: str, user: str, edges: Iterable[Edge]) -> None:
    """Insert edges; an edge already there (same source, target, label) gains the new evidence.
    The read-modify-write is safe: the stores bump the user's generation row before calling this,
    which serialises one user's write transactions (PostgreSQL's row lock, SQLite's write lock)."""
    for edge in edges:
        cur.execute(_sql("INSERT INTO graph_edges (user_id, source, target, label, evidence) VALUES (?,?,?,?,?) "
                         "ON CONFLICT (user_id, source, target, label) DO NOTHING", mark),
                    (user, edge.source, edge.target, edge.label, json.dumps(list(edge.evidence))))
        if cur.rowcount == 0:
            cur.execute(_sql("SELECT evidence FROM graph_edges WHERE user_id=? AND source=? AND target=? AND label=?", mark),
                        (user, edge.source, edge.target, edge.label))
            evidence = list(dict.fromkeys([*json.loads(cur.fetchone()[0]), *edge.evidence]))
            cur.execute(_sql("UPDATE graph_edges SET evidence=? WHERE user_id=? AND source=? AND target=? AND label=?", mark),
                        (json.dumps(evidence), user, edge.source, edge.target, edge.label))


def _write_topics(cur: Any, mark: str, user: str, topics: Iterable[Topic]) -> None:
    """Create or re-summarise topics and add their members (membership only grows here)."""
    for topic in topics:
        cur.execute(_sql("INSERT INTO graph_topics (user_id, topic, summary) VALUES (?,?,?) "
                         "ON CONFLICT (user_id, topic) DO NOTHING", mark), (user, topic.id, topic.summary))
        if cur.rowcount == 0 and topic.summary:
            cur.execute(_sql("UPDATE graph_topics SET summary=? WHERE user_id=? AND topic=?", mark),
                        (topic.summary, user, topic.id))
        for member in dict.fromkeys(topic.members):
            cur.execute(_sql("INSERT INTO graph_members (user_id, topic, memory_id) VALUES (?,?,?) "
                             "ON CONFLICT (user_id, topic, memory_id) DO NOTHING", mark), (user, topic.id, member))


def write(cur: Any, mark: str, batch: GraphWrite) -> None:
    """The graph rows of one `add_events`, on the transaction that has just inserted its memories:
    participants, then edges and memberships, whose ends must be stored events of the user."""
    user = batch.user
    for event in batch.events:
        cur.execute(_sql("INSERT INTO graph_events (user_id, memory_id, participants) VALUES (?,?,?)", mark),
                    (user, event.memory.id, json.dumps(list(event.participants))))
    named = [i for e in batch.edges for i in (e.source, e.target)] + [m for t in batch.topics for m in t.members]
    require_events(user, named, _event_ids(cur, mark, user, named))
    _merge_edges(cur, mark, user, batch.edges)
    _write_topics(cur, mark, user, batch.topics)


def delete_memories(cur: Any, mark: str, user: str, ids: Sequence[str]) -> None:
    """Remove the graph rows of deleted memories: their participants, every edge touching them, memberships."""
    for memory_id in dict.fromkeys(ids):
        cur.execute(_sql("DELETE FROM graph_events WHERE user_id=? AND memory_id=?", mark), (user, memory_id))
        cur.execute(_sql("DELETE FROM graph_edges WHERE user_id=? AND (source=? OR target=?)", mark),
                    (user, memory_id, memory_id))
        cur.execute(_sql("DELETE FROM graph_members WHERE user_id=? AND memory_id=?", mark), (user, memory_id))


def delete_user(cur: Any, mark: str, user: str) -> None:
    """Remove every graph row of a user (topics included: their summaries are the user's text)."""
    for table in GRAPH_TABLES:
        cur.execute(_sql(f"DELETE FROM {table} WHERE user_id=?", mark), (user,))


def rewire(cur: Any, mark: str, user: str, old_ids: Sequence[str], new_id: str) -> None:
    """Move the edges and memberships of `old_ids` onto `new_id` (a merge): an edge between two merged
    events (or to the merged one) would loop and is dropped; parallel edges pool their evidence."""
    old = [i for i in dict.fromkeys(old_ids) if i != new_id]
    if not old:
        return
    require_events(user, [new_id], _event_ids(cur, mark, user, [new_id]))
    moved: list[Edge] = []
    for memory_id in old:
        cur.execute(_sql("SELECT source, target, label, evidence FROM graph_edges WHERE user_id=? AND (source=? OR target=?)",
                         mark), (user, memory_id, memory_id))
        rows = cur.fetchall()
        cur.execute(_sql("DELETE FROM graph_edges WHERE user_id=? AND (source=? OR target=?)", mark),
                    (user, memory_id, memory_id))
        for source, target, label, evidence in rows:
            source, target = (new_id if source in old else source), (new_id if target in old else target)
            if source != target:
                moved.append(Edge(source, target, label, tuple(json.loads(evidence))))
    _merge_edges(cur, mark, user, moved)
    for memory_id in old:
        cur.execute(_sql("SELECT topic FROM graph_members WHERE user_id=? AND memory_id=?", mark), (user, memory_id))
        topics = [r[0] for r in cur.fetchall()]
        cur.execute(_sql("DELETE FROM graph_members WHERE user_id=? AND memory_id=?", mark), (user, memory_id))
        _write_topics(cur, mark, user, [Topic(t, members=(new_id,)) for t in topics])


def neighbours(cur: Any, mark: str, user: str, memory_id: str, direction: str, label: str | None) -> list[Edge]:
    """The edges leaving (``out``), entering (``in``) or touching (``both``) an event, optionally of one label."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {list(DIRECTIONS)}, got {direction!r}")
    where = {"out": "source=?", "in": "target=?", "both": "(source=? OR target=?)"}[direction]
    params: list[Any] = [user, memory_id] + ([memory_id] if direction == "both" else [])
    if label is not None:
        where += " AND label=?"
        params.append(label)
    cur.execute(_sql(f"SELECT source, target, label, evidence FROM graph_edges WHERE user_id=? AND {where} "
                     "ORDER BY source, target, label", mark), tuple(params))
    return [Edge(s, t, lab, tuple(json.loads(e))) for s, t, lab, e in cur.fetchall()]


def topics(cur: Any, mark: str, user: str) -> list[Topic]:
    """Every topic of a user with its members, by topic id."""
    cur.execute(_sql("SELECT topic, summary FROM graph_topics WHERE user_id=? ORDER BY topic", mark), (user,))
    rows = cur.fetchall()
    return [Topic(topic, summary, tuple(members(cur, mark, user, topic))) for topic, summary in rows]


def members(cur: Any, mark: str, user: str, topic: str) -> list[str]:
    """The member ids of one topic (empty for an unknown topic), in id order."""
    cur.execute(_sql("SELECT memory_id FROM graph_members WHERE user_id=? AND topic=? ORDER BY memory_id", mark),
                (user, topic))
    return [r[0] for r in cur.fetchall()]


def participants(cur: Any, mark: str, user: str, ids: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """Participants of the given events (ids that are not events are left out)."""
    out: dict[str, tuple[str, ...]] = {}
    unique = list(dict.fromkeys(ids))
    for start in range(0, len(unique), 500):
        chunk = unique[start : start + 500]
        marks = ",".join("?" * len(chunk))
        cur.execute(_sql(f"SELECT memory_id, participants FROM graph_events WHERE user_id=? AND memory_id IN ({marks})",
                         mark), (user, *chunk))
        out.update((r[0], tuple(json.loads(r[1]))) for r in cur.fetchall())
    return out
