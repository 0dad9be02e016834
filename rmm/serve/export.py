"""One user's stored data out of a bank and back in: `export_user`, `import_user`.

An export is a folder: `data.jsonl` in rmm's dataset format (`rmm.data.jsonl`,
docs/dataset-format.md) — the user, every session handed to reflection (the reflection jobs'
payloads are where a finished session's turns are kept) and the open session with their turns,
every memory (an event with its participants), the event graph's edges and topics, the user's
Semantic XPath tree (every version of every node in the latest tree: `node` records), every
selection with the feedback it received — plus, when rerankers are per user,
`reranker/` (the user's checkpoint) and `manifest.json` (what, when, from where, counts, and a
SHA-256 per file). It is what a user asking "what do you hold about me?" gets, and what moves a
user between banks (`Memory.import_user`). Used by `rmm.embedded.Memory` and `rmm data export`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rmm import __version__
from rmm.data.jsonl import FORMAT_VERSION, read_jsonl, write_jsonl
from rmm.errors import DataError
from rmm.memory.graph import Edge, Event, Topic
from rmm.memory.tree import TreeNode, TreeWriteError
from rmm.memory.validation import check_event
from rmm.policy.checkpoint import checkpoint_exists, pack_checkpoint, unpack_checkpoint
from rmm.serve.event_jobs import EVENTS_KIND
from rmm.serve.tenants import callers_terms, scoped, unknown_user, unscoped_id
from rmm.types import Memory, Session, Turn

if TYPE_CHECKING:
    from rmm.serve.service import RetrievalService

__all__ = ["EXPORT_DATA", "EXPORT_MANIFEST", "EXPORT_RERANKER", "Graph", "export_user", "import_user",
           "latest_nodes", "memory_from_record", "node_from_record", "read_graph", "read_tree", "write_graph",
           "write_tree"]

log = logging.getLogger(__name__)

EXPORT_DATA = "data.jsonl"
EXPORT_MANIFEST = "manifest.json"
EXPORT_RERANKER = "reranker"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _sessions(service: RetrievalService, tenant: str, user_id: str) -> tuple[list[Session], int]:
    """The user's sessions in the order they were handed over: each reflection job's session, then
    the open one; a session posted twice is listed once. Returns (sessions, repeats skipped)."""
    sessions: list[Session] = []
    seen_sessions: set[str] = set()
    seen_turns: set[str] = set()
    repeats = 0
    # an `events` job carries its reflection job's session again: each session is listed from its reflect job
    raw_sessions = [payload["session"] for job, payload in service.jobs.of_user(user_id)
                    if payload.get("session") and job.kind != EVENTS_KIND]
    current = service.sessions.current(user_id)
    if current.turns:
        raw_sessions.append({"id": unscoped_id(tenant, current.id), "time": current.time,
                             "turns": [{"id": unscoped_id(tenant, t.id), "speaker": t.speaker, "text": t.text,
                                        "time": t.time} for t in current.turns]})
    for raw in raw_sessions:
        if raw["id"] in seen_sessions:
            repeats += 1
            continue
        seen_sessions.add(raw["id"])
        turns = []
        for t in raw["turns"]:
            if t["id"] in seen_turns:
                repeats += 1
                continue
            seen_turns.add(t["id"])
            turns.append(Turn(id=t["id"], session_id=raw["id"], speaker=t["speaker"], text=t["text"], time=t.get("time")))
        sessions.append(Session(id=raw["id"], user_id=user_id, turns=turns, time=raw.get("time")))
    return sessions, repeats


@dataclass
class Graph:
    """A user's event graph as stored: participants of each event, every edge, every topic."""

    participants: dict[str, tuple[str, ...]] = field(default_factory=dict)
    edges: list[Edge] = field(default_factory=list)
    topics: list[Topic] = field(default_factory=list)


def read_graph(service: RetrievalService, user_id: str, memories: list[Memory]) -> Graph:
    """The graph rows of the user's events (`rmm.memory.graph`): each edge read once, from its source."""
    store = service.bank.store
    events = [m.id for m in memories if m.kind == "event"]
    if not events:
        return Graph(topics=store.topics(user_id) if memories else [])
    edges = [e for memory_id in events for e in store.neighbours(user_id, memory_id, "out")]
    return Graph(store.participants(user_id, events), edges, store.topics(user_id))


def read_tree(service: RetrievalService, user_id: str) -> list[TreeNode]:
    """Every version of every node of the user's latest tree, in tree order, oldest version first
    (a node edited since it was added reads its history; one never edited is its one version). A
    node removed from the tree (`remove_nodes`) is not exported: the store lists only live nodes."""
    store = service.bank.store
    out: list[TreeNode] = []
    for node in store.tree(user_id):
        out += store.node_history(user_id, node.id) if node.version > 1 else [node]
    return out


def _node_record(user: str, node: TreeNode) -> dict[str, Any]:
    return {"type": "node", "id": node.id, "user": user, "node_type": node.type, "parent": node.parent,
            "position": int(node.position or 0), "attributes": dict(node.attributes), "memory": node.memory_id,
            "version": node.version, "revision": node.revision, "text": node.text}


def _records(user: str, sessions: list[Session], memories: list[Memory],
             selections: list[dict[str, Any]], graph: Graph | None = None,
             tree: list[TreeNode] | None = None) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = [{"type": "dataset", "format": FORMAT_VERSION, "name": f"export of {user}"},
                                     {"type": "user", "id": user}]
    for session in sessions:
        records.append({"type": "session", "id": session.id, "user": user, "time": session.time})
        records += [{"type": "turn", "id": t.id, "session": session.id, "speaker": t.speaker, "text": t.text,
                     "time": t.time} for t in session.turns]
    graph = graph or Graph()
    records += [{"type": "memory", "id": m.id, "user": user, "kind": m.kind, "text": m.text, "refs": list(m.refs),
                 "source_text": m.source_text, "created_at": m.created_at, "updated_at": m.updated_at,
                 "merged_from": list(m.merged_from), "time_span": None if m.time_span is None else list(m.time_span),
                 **({"participants": list(graph.participants.get(m.id, ()))} if m.kind == "event" else {})}
                for m in memories]
    records += [{"type": "edge", "user": user, "source": e.source, "target": e.target, "label": e.label,
                 "evidence": list(e.evidence)} for e in graph.edges]
    records += [{"type": "topic", "id": t.id, "user": user, "summary": t.summary, "members": list(t.members)}
                for t in graph.topics]
    records += [_node_record(user, node) for node in tree or []]
    for s in selections:
        given = s["feedback"] or {}
        records.append({"type": "feedback", "selection": s["selection"], "user": user, "query": s["query"],
                        "shown": s["shown"], "explore": s["explore"], "created_at": s["created_at"],
                        "rewarded_at": s["rewarded_at"], "cited": given.get("cited"),
                        "no_cite": bool(given.get("no_cite", False)), "rewards": given.get("rewards"),
                        "learned": bool(given.get("learned", False)), "reason": given.get("reason")})
    return records


def export_user(service: RetrievalService, tenant: str, user: str, out: Path) -> dict[str, Any]:
    """Write the export folder `out` (new or empty); returns the manifest. UnknownUserError when
    nothing at all is stored for the user."""
    out = out.expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DataError(f"export folder {out} exists and is not empty; give a new folder")
    user_id = scoped(tenant, user)
    has_memories = service.bank.store.has_user(user_id)
    with callers_terms(tenant, user):
        memories = service.bank.memories(user_id) if has_memories else []
        graph = read_graph(service, user_id, memories) if has_memories else Graph()
        tree = read_tree(service, user_id) if has_memories else []
    sessions, repeats = _sessions(service, tenant, user_id)
    selections = service.selections.of_user(user_id)
    if not (memories or sessions or selections):
        raise unknown_user(user)
    out.mkdir(parents=True, exist_ok=True)
    data = out / EXPORT_DATA
    count = write_jsonl(_records(user, sessions, memories, selections, graph, tree), data)
    read_jsonl(data)  # the export reads back in the format it claims (raises JsonlDataError otherwise)
    files = {EXPORT_DATA: _sha256(data)}
    reranker = _export_reranker(service, user_id, out / EXPORT_RERANKER)
    if reranker:
        files.update({str(p.relative_to(out)): _sha256(p) for p in sorted((out / EXPORT_RERANKER).rglob("*"))
                      if p.is_file()})
    kinds: dict[str, int] = {}
    for memory in memories:
        kinds[memory.kind] = kinds.get(memory.kind, 0) + 1
    manifest = {
        "format": FORMAT_VERSION, "user": user, "tenant": tenant, "rmm_version": __version__,
        "exported_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "store": "postgresql" if service.config.store else "sqlite", "encoder": service.config.encoder,
        "reranker_per": service.config.reranker_per, "reranker": EXPORT_RERANKER if reranker else None,
        "counts": {"records": count, "sessions": len(sessions), "turns": sum(len(s.turns) for s in sessions),
                   "memories": len(memories), "memory_kinds": kinds, "edges": len(graph.edges),
                   "topics": len(graph.topics), "tree_nodes": len({n.id for n in tree}),
                   "tree_versions": len(tree), "selections": len(selections),
                   "feedback": sum(1 for s in selections if s["feedback"] is not None),
                   "repeated_sessions_or_turns_skipped": repeats},
        "files": files,
        "not_exported": "pending selections' candidate embeddings and scores (derived from the memories); "
                        + ("" if service.config.reranker_per == "user" else
                           f"the reranker (shared per {service.config.reranker_per}, not the user's own)"),
    }
    (out / EXPORT_MANIFEST).write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return manifest


def _export_reranker(service: RetrievalService, user_id: str, target: Path) -> bool:
    """The user's own reranker checkpoint into `target` (rerankers per user only); False if none."""
    if service.config.reranker_per != "user":
        return False
    learners = service.learners
    if learners.versions is not None:
        stored = learners.versions.read(user_id)
        if stored is None:
            return False
        unpack_checkpoint(stored[1], target)
        return True
    path = learners.path(user_id)
    if path is None or not checkpoint_exists(path):
        return False
    shutil.copytree(path, target)
    return True


def memory_from_record(record: dict[str, Any], user_id: str) -> Memory:
    """A `memory` record of rmm's format (type removed) as the stored `Memory` of `user_id`: its
    id, times and provenance kept (`import_user`, `rmm.serve.importer`)."""
    span = record.get("time_span")
    return Memory(id=record["id"], user_id=user_id, kind=record["kind"], text=record["text"],
                  refs=list(record.get("refs", [])), source_text=record.get("source_text", ""),
                  created_at=record.get("created_at", time.time()), updated_at=record.get("updated_at", time.time()),
                  merged_from=list(record.get("merged_from", [])), time_span=None if span is None else (span[0], span[1]))


def import_user(service: RetrievalService, tenant: str, path: Path, *, user: str | None = None,
                reflect: bool = False) -> dict[str, int]:
    """Restore an export (folder, or its data file) as `user`; returns what was restored."""
    path = path.expanduser()
    folder, data = (path, path / EXPORT_DATA) if path.is_dir() else (path.parent, path)
    content = read_jsonl(data)
    users = content.dataset.users
    if len(users) != 1:
        raise DataError(f"{data} holds {len(users)} users; an export holds one (import datasets with rmm data import)")
    source = users[0]
    target = user or source
    user_id = scoped(tenant, target)
    memories = [memory_from_record(m, user_id) for m in content.memories]
    events = [(memory, record.get("participants", [])) for memory, record in zip(memories, content.memories)
              if memory.kind == "event"]
    nodes = latest_nodes(content.nodes)  # checked before anything is written: a bad node stores nothing
    if nodes and not memories:
        raise DataError(f"{data} holds a tree but no memory: the tree is restored into a user that has memories")
    with callers_terms(tenant, target):
        service.bank.add(user_id, [m for m in memories if m.kind != "event"])
        written = write_graph(service, user_id, events, content.edges, content.topics)
        tree = write_tree(service, user_id, nodes)
    restored = {"memories": len(memories), "sessions_reflected": 0, "reranker": 0}
    if events:  # what an export with an event graph restored of it
        restored.update(edges=written["edges"], topics=written["topics"])
    if nodes:
        restored["tree_nodes"] = tree
    if (folder / EXPORT_RERANKER).is_dir():
        restored["reranker"] = int(_import_reranker(service, user_id, folder / EXPORT_RERANKER))
    if reflect:
        for session in content.dataset.sessions[source]:
            # the imported graph holds its sessions already: no `events` job builds them again
            service.add_session(tenant, target, session.turns, session_id=session.id, time_=session.time,
                                events=False if events else None)
            restored["sessions_reflected"] += 1
    return restored


def write_graph(service: RetrievalService, user_id: str, events: list[tuple[Memory, list[str]]],
                edges: list[dict[str, Any]], topics: list[dict[str, Any]]) -> dict[str, int]:
    """Event memories with their participants, and the edge and topic records (rmm's format, `type`
    removed) between them, into the bank in one `add_events` transaction (vectors encoded here, as
    `bank.add` would). An event without the refs or time `add_events` requires (posted as a plain
    memory before those checks) is stored as a plain memory first, still a graph node."""
    valid, plain = [], []
    for memory, participants in events:
        try:
            check_event(user_id, memory, participants)
            valid.append(Event(memory, tuple(participants)))
        except ValueError:
            plain.append(memory)
    if plain:
        log.warning("%d event(s) of %s without refs or time (or with too many participants) restored as plain "
                    "memories, without participants", len(plain), user_id)
        service.bank.add(user_id, plain)
    graph_edges = [Edge(e["source"], e["target"], e["label"], tuple(e.get("evidence", []))) for e in edges]
    graph_topics = [Topic(t["id"], t.get("summary", ""), tuple(t.get("members", []))) for t in topics]
    if not (valid or graph_edges or graph_topics):
        return {"events": 0, "edges": 0, "topics": 0}
    vectors = service.encoder.encode_passages([e.memory.text for e in valid]) if valid else None
    service.bank.store.add_events(user_id, valid, graph_edges, graph_topics, embeddings=vectors)
    return {"events": len(valid), "edges": len(graph_edges), "topics": len(graph_topics)}


def node_from_record(record: dict[str, Any]) -> TreeNode:
    """A `node` record of rmm's format (type removed) as the `TreeNode` to write: its id, type,
    parent, position, attributes and memory (version and revision are the store's to number)."""
    return TreeNode(id=record["id"], type=record["node_type"], parent=record.get("parent"),
                    position=record.get("position"), attributes=record.get("attributes", {}),
                    memory_id=record.get("memory"))


def latest_nodes(records: list[dict[str, Any]]) -> list[TreeNode]:
    """The highest version of each node of `records` (one user's), as `TreeNode`s in file order of
    their first version; a record the tree would refuse is a `DataError` naming the node."""
    latest: dict[str, dict[str, Any]] = {}
    for record in records:
        have = latest.get(record["id"])
        if have is None or have.get("version", 1) < record.get("version", 1):
            latest[record["id"]] = record
    try:
        return [node_from_record(r) for r in latest.values()]
    except TreeWriteError as exc:
        raise DataError(f"a tree node of the data cannot be stored: {exc}") from exc


def write_tree(service: RetrievalService, user_id: str, nodes: list[TreeNode]) -> int:
    """Add the nodes the user's tree does not hold yet (by id) in one `add_nodes` transaction (all or
    nothing); returns how many. Each is written as its version 1 at the user's current generation:
    the history in the file stays in the file."""
    if not nodes:
        return 0
    store = service.bank.store
    present = {n.id for n in store.tree(user_id)}
    new = [n for n in nodes if n.id not in present]
    if new:
        store.add_nodes(user_id, new)
    return len(new)


def _import_reranker(service: RetrievalService, user_id: str, source: Path) -> bool:
    if service.config.reranker_per != "user":
        log.warning("%s holds a per-user reranker, but this bank's rerankers are per %s: not restored", source,
                    service.config.reranker_per)
        return False
    learners = service.learners
    if learners.versions is not None and service.db is not None:
        version = learners.versions.latest().get(user_id, 0) + 1
        with service.db.tx() as cur:
            learners.versions.write(cur, user_id, version, pack_checkpoint(source))  # type: ignore[attr-defined]
    else:
        target = learners.path(user_id)
        assert target is not None  # a bank folder keeps checkpoints on disk
        shutil.rmtree(target, ignore_errors=True)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(source, target)
    learners.drop(user_id)  # the next retrieval loads the restored one
    return True
