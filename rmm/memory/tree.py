"""Semantic XPath's typed tree in the memory layer (Liu et al. §3.1): nodes, versions, the induced schema Σ.

A user's memory is a rooted tree. The root is implicit (one per user, never stored: it stands for
the whole memory); every stored node has a `type` (the query language's node type), a `position`
among its siblings, textual `attributes`, a `parent` (None: a child of the root) and optionally a
`memory_id`, the `Memory` row it shows. A leaf (a turn) or an inner node that needs a vector (a
session summary) points at a memory, so the dense index, BM25, the reranker and ``/v1/retrieve``
score it unchanged; the tree only relates nodes.

**Versions.** Every edit of a node writes a new row, its *version* (1, 2, …); older rows stay as the
node's history, and reads return the latest unless asked for one (`as_of`). Each row records the
*revision* it was written at: the user's generation after the write transaction's bump (the
store's per-user counter, +1 per write, never reused, also across `delete_user`), so
``tree(user, as_of=g)`` is the tree exactly as it was after generation ``g``. A version row also
keeps a snapshot of its memory's text (`text`): `update` of a memory that changes its text writes a
new version of each node showing it, so an updated (or re-pointed, merged) memory keeps its history in the tree even
though the ``memories`` row holds only the newest text. Removing a node (`remove_nodes`) writes a
tombstone version for it and its subtree: gone from the latest tree, still there as of earlier
revisions.

**Deletes cascade.** Deleting memories (`MemoryStorage.delete`) removes every node whose latest
version shows one of them, with its whole subtree and all their versions; an older version row of
another node that showed a deleted memory keeps its text snapshot (that node's history, e.g. what
a merge replaced) but loses the pointer. `delete_user` removes every row of the user.

**Σ** (`induce_schema`) is read from what is stored, never declared: the node types with counts,
the attribute names seen per type, the parent → child type pairs with counts (the root's type is
None). Writes are checked for structure (a parent that exists, no cycles, a stored memory), not
against Σ: Σ follows the data.

One table, ``tree_nodes``, one row per node version. The SQL here is shared by SQLite and
PostgreSQL like `rmm.memory.graph`'s: written with ``?`` placeholders a store turns into its own
(`mark`), JSON kept as text; the stores check the user, bump its generation first (which
serialises one user's writes: SQLite's write lock, PostgreSQL's row lock on ``users``) and call
these functions on the transaction of the memories they touch.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rmm.errors import RmmError
from rmm.memory.validation import check_memory, check_user_name, duplicate_keys, require_ids
from rmm.types import Memory

__all__ = [
    "KEEP", "SQLITE_TABLES", "TREE_TABLES", "NodeEdit", "Schema", "TreeNode", "TreeWrite", "TreeWriteError",
    "UnknownNodeError", "induce_schema", "tree_order",
]

SQLITE_TABLES = """
CREATE TABLE IF NOT EXISTS tree_nodes (
    user_id    TEXT NOT NULL,
    node_id    TEXT NOT NULL,
    version    INTEGER NOT NULL,
    revision   INTEGER NOT NULL,
    latest     INTEGER NOT NULL,
    deleted    INTEGER NOT NULL,
    parent_id  TEXT,
    node_type  TEXT NOT NULL,
    position   INTEGER NOT NULL,
    attributes TEXT NOT NULL,
    memory_id  TEXT,
    text       TEXT,
    PRIMARY KEY (user_id, node_id, version)
);
CREATE INDEX IF NOT EXISTS tree_nodes_latest ON tree_nodes (user_id, latest);
CREATE INDEX IF NOT EXISTS tree_nodes_memory ON tree_nodes (user_id, memory_id);
"""

TREE_TABLES: tuple[str, ...] = ("tree_nodes",)

MAX_ID_LENGTH = 512
_NAME = re.compile(r"[^\W\d]\w*")  # the query language's NAME (rmm.memory.xpath_syntax): types and attributes
_NODE = "node"  # the query language's whole-node match: no attribute may be called this


class TreeWriteError(RmmError, ValueError):
    """A tree write that would break the tree (a missing parent, a cycle, a duplicate id, bad fields)."""


class UnknownNodeError(RmmError, KeyError):
    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "unknown node"


class _Keep:
    """The 'leave it as it is' value of a `NodeEdit` field (None means 'the root' / 'no memory')."""

    _instance: _Keep | None = None

    def __new__(cls) -> _Keep:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "KEEP"


KEEP: Any = _Keep()


@dataclass(frozen=True)
class TreeNode:
    """One node of a user's tree. To write: `id`, `type`, and optionally `parent`, `position` (None:
    after its last sibling), `attributes`, `memory_id`. Read back, also its `version`, the
    `revision` (user generation) it was written at, its memory's `text` at that version, and
    `deleted` (a tombstone, only seen through `node_history`)."""

    id: str
    type: str
    parent: str | None = None
    position: int | None = None
    attributes: Mapping[str, str] = field(default_factory=dict)
    memory_id: str | None = None
    version: int = 0
    revision: int = 0
    text: str | None = None
    deleted: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "attributes", dict(self.attributes))
        _check_id(self.id, "node id")
        if not isinstance(self.type, str) or _NAME.fullmatch(self.type) is None:
            raise TreeWriteError(f"node type {self.type!r} is not an identifier (letters, digits, _; not starting "
                                 "with a digit), so no query could name it")
        if self.parent is not None:
            _check_id(self.parent, "parent id")
            if self.parent == self.id:
                raise TreeWriteError(f"node {self.id!r} cannot be its own parent")
        if self.position is not None and (not isinstance(self.position, int) or isinstance(self.position, bool)):
            raise TreeWriteError(f"position must be an integer, got {self.position!r}")
        _check_attributes(self.attributes)
        if self.memory_id is not None:
            _check_id(self.memory_id, "memory id")

    @property
    def content(self) -> str:
        """What a whole-node match (``[node~"…"]``) reads: the memory's text when the node shows one,
        else its attributes as ``name: value`` lines (an inner node like a Day)."""
        if self.text is not None:
            return self.text
        return "\n".join(f"{k}: {v}" for k, v in self.attributes.items())


@dataclass(frozen=True)
class NodeEdit:
    """A change to one node, written as its next version: the fields given replace the latest ones;
    `KEEP` (the default) leaves a field as it is. `parent=None` moves the node under the root,
    `memory_id=None` detaches it from its memory; `attributes` replaces the whole mapping."""

    id: str
    attributes: Mapping[str, str] | Any = KEEP
    parent: str | None | Any = KEEP
    position: int | Any = KEEP
    memory_id: str | None | Any = KEEP

    def __post_init__(self) -> None:
        _check_id(self.id, "node id")
        if self.attributes is not KEEP:
            object.__setattr__(self, "attributes", dict(self.attributes))
            _check_attributes(self.attributes)
        if self.parent is not KEEP and self.parent is not None:
            _check_id(self.parent, "parent id")
            if self.parent == self.id:
                raise TreeWriteError(f"node {self.id!r} cannot be its own parent")
        if self.position is not KEEP and (not isinstance(self.position, int) or isinstance(self.position, bool)):
            raise TreeWriteError(f"position must be an integer, got {self.position!r}")
        if self.memory_id is not KEEP and self.memory_id is not None:
            _check_id(self.memory_id, "memory id")


def _check_id(value: object, what: str) -> None:
    if not isinstance(value, str) or not value or len(value) > MAX_ID_LENGTH:
        raise TreeWriteError(f"{what} must be a non-empty string of at most {MAX_ID_LENGTH} characters, got {value!r}")


def _check_attributes(attributes: Mapping[str, str]) -> None:
    for name, value in attributes.items():
        if not isinstance(name, str) or _NAME.fullmatch(name) is None or name == _NODE:
            raise TreeWriteError(f"attribute name {name!r} must be an identifier other than {_NODE!r}")
        if not isinstance(value, str):
            raise TreeWriteError(f"attribute {name!r} must be text, got {type(value).__name__}")


@dataclass(frozen=True)
class TreeWrite:
    """One checked `add_nodes` call: the memories to insert first, then the nodes."""

    user: str
    nodes: tuple[TreeNode, ...]
    memories: tuple[Memory, ...]

    @classmethod
    def check(cls, user: str, nodes: Iterable[TreeNode], memories: Iterable[Memory] = ()) -> TreeWrite:
        """Refuse bad input before any transaction starts: the user, each record, duplicate ids."""
        check_user_name(user)
        nodes = tuple(nodes)
        memories = tuple(memories)
        for node in nodes:
            if not isinstance(node, TreeNode):
                raise TypeError(f"expected TreeNode, got {type(node).__name__}")
        for memory in memories:
            check_memory(memory)
            if memory.user_id != user:
                raise ValueError(f"memory {memory.id!r} belongs to user {memory.user_id!r}, not {user!r}")
        duplicate_keys(list(memories))
        seen: set[str] = set()
        for node in nodes:
            if node.id in seen:
                raise TreeWriteError(f"node {node.id!r} appears twice in one write")
            seen.add(node.id)
        return cls(user, nodes, memories)


# -- the induced schema ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Schema:
    """Σ as stored: node types (with counts), attribute names per type, parent → child type pairs
    (with counts; the root's type is None)."""

    types: Mapping[str, int]
    attributes: Mapping[str, tuple[str, ...]]
    children: Mapping[tuple[str | None, str], int]

    def allows(self, parent: str | None, child: str) -> bool:
        """Whether the stored tree has a `child`-typed node under a `parent`-typed one (None: the root)."""
        return (parent, child) in self.children

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: ``{"types": {T: {"count", "attributes", "children": {C: count}}}, "roots": {T: count}}``."""
        types = {t: {"count": n, "attributes": list(self.attributes.get(t, ())),
                     "children": {c: k for (p, c), k in sorted(self.children.items(), key=_pair_key) if p == t}}
                 for t, n in sorted(self.types.items())}
        roots = {c: k for (p, c), k in sorted(self.children.items(), key=_pair_key) if p is None}
        return {"types": types, "roots": roots}

    def describe(self) -> str:
        """One line per parent type, for a prompt: ``Session (30) [date] -> Turn (600)``."""
        lines = []
        for parent in [None, *sorted(self.types)]:
            kids = sorted((c, k) for (p, c), k in self.children.items() if p == parent)
            if parent is None:
                head = "(root)"
            else:
                attrs = self.attributes.get(parent, ())
                head = f"{parent} ({self.types[parent]})" + (f" [{', '.join(attrs)}]" if attrs else "")
            if kids or parent is None:
                lines.append(f"{head} -> " + (", ".join(f"{c} ({k})" for c, k in kids) or "(empty)"))
            else:
                lines.append(head)
        return "\n".join(lines)


def _pair_key(item: tuple[tuple[str | None, str], int]) -> tuple[str, str]:
    (parent, child), _ = item
    return (parent or "", child)


def induce_schema(nodes: Iterable[TreeNode]) -> Schema:
    """Σ of a tree (`MemoryStorage.tree`'s nodes): what types, attributes and type pairs occur."""
    nodes = list(nodes)
    kind = {n.id: n.type for n in nodes}
    types: dict[str, int] = defaultdict(int)
    attributes: dict[str, set[str]] = defaultdict(set)
    children: dict[tuple[str | None, str], int] = defaultdict(int)
    for node in nodes:
        types[node.type] += 1
        attributes[node.type].update(node.attributes)
        children[(None if node.parent is None else kind.get(node.parent), node.type)] += 1
    return Schema(dict(types), {t: tuple(sorted(a)) for t, a in attributes.items()}, dict(children))


def tree_order(nodes: Iterable[TreeNode]) -> list[TreeNode]:
    """Pre-order (document order): each node before its subtree, siblings by (position, id). A node
    whose parent is not among `nodes` (an as-of read after a cascade removed its old parent) is left out."""
    kids: dict[str | None, list[TreeNode]] = defaultdict(list)
    for node in nodes:
        kids[node.parent].append(node)
    for group in kids.values():
        group.sort(key=lambda n: (n.position if n.position is not None else 0, n.id))
    out: list[TreeNode] = []
    stack = list(reversed(kids.get(None, [])))
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(reversed(kids.get(node.id, [])))
    return out


# -- SQL shared by both stores ----------------------------------------------------------------------

_COLUMNS = "node_id, version, revision, deleted, parent_id, node_type, position, attributes, memory_id, text"


def _sql(statement: str, mark: str) -> str:
    return statement if mark == "?" else statement.replace("?", mark)


def _node(row: Sequence[Any]) -> TreeNode:
    return TreeNode(id=row[0], version=int(row[1]), revision=int(row[2]), deleted=bool(row[3]), parent=row[4],
                    type=row[5], position=int(row[6]), attributes=json.loads(row[7]), memory_id=row[8], text=row[9])


def revision(cur: Any, mark: str, user: str) -> int:
    """The user's generation inside the write transaction (after the store's bump): the revision."""
    cur.execute(_sql("SELECT generation FROM users WHERE user_id=?", mark), (user,))
    return int(cur.fetchone()[0])


def _latest(cur: Any, mark: str, user: str) -> dict[str, TreeNode]:
    """Every node's latest version row, tombstones included (their parent link still counts for cascades)."""
    cur.execute(_sql(f"SELECT {_COLUMNS} FROM tree_nodes WHERE user_id=? AND latest=1", mark), (user,))
    return {row[0]: _node(row) for row in cur.fetchall()}


def _texts(cur: Any, mark: str, user: str, ids: Iterable[str]) -> dict[str, str]:
    unique = list(dict.fromkeys(ids))
    found: dict[str, str] = {}
    for start in range(0, len(unique), 500):
        chunk = unique[start : start + 500]
        marks = ",".join("?" * len(chunk))
        cur.execute(_sql(f"SELECT id, text FROM memories WHERE user_id=? AND id IN ({marks})", mark), (user, *chunk))
        found.update((r[0], r[1]) for r in cur.fetchall())
    return found


def _insert_version(cur: Any, mark: str, user: str, node: TreeNode, version: int, rev: int) -> None:
    """Write `node` as version `version` (the previous latest row, if any, is no longer latest)."""
    if version > 1:
        cur.execute(_sql("UPDATE tree_nodes SET latest=0 WHERE user_id=? AND node_id=? AND latest=1", mark),
                    (user, node.id))
    cur.execute(_sql(f"INSERT INTO tree_nodes (user_id, {_COLUMNS}, latest) VALUES (?,?,?,?,?,?,?,?,?,?,?,1)", mark),
                (user, node.id, version, rev, int(node.deleted), node.parent, node.type, int(node.position or 0),
                 json.dumps(dict(node.attributes), ensure_ascii=False), node.memory_id, node.text))


def _live(latest: Mapping[str, TreeNode]) -> dict[str, TreeNode]:
    return {i: n for i, n in latest.items() if not n.deleted}


def _next_position(siblings: Mapping[str | None, list[int]], parent: str | None) -> int:
    taken = siblings.get(parent)
    return (max(taken) + 1) if taken else 0


def _sibling_positions(live: Mapping[str, TreeNode]) -> dict[str | None, list[int]]:
    out: dict[str | None, list[int]] = defaultdict(list)
    for node in live.values():
        out[node.parent].append(int(node.position or 0))
    return out


def _check_acyclic(user: str, parents: Mapping[str, str | None]) -> None:
    for start in parents:
        seen = {start}
        parent = parents[start]
        while parent is not None:
            if parent in seen:
                raise TreeWriteError(f"moving nodes of user {user!r} would make a cycle through {parent!r}")
            seen.add(parent)
            parent = parents.get(parent)


def write(cur: Any, mark: str, batch: TreeWrite) -> None:
    """The nodes of one `add_nodes`, on the transaction that has just inserted its memories (and
    bumped the user's generation): a parent must be a live node or one of the batch (in any order),
    memories stored, ids new (a removed node's id stays taken: its history is there)."""
    user = batch.user
    latest = _latest(cur, mark, user)
    live = _live(latest)
    taken = [n.id for n in batch.nodes if n.id in latest]
    if taken:
        raise TreeWriteError(f"node id(s) of user {user!r} already in the tree: {taken[:5]}; use edit_nodes to change one")
    new = {n.id: n for n in batch.nodes}
    missing = sorted({n.parent for n in batch.nodes if n.parent is not None and n.parent not in live and n.parent not in new})
    if missing:
        raise UnknownNodeError(f"parent node(s) of user {user!r} not in the tree: {missing[:5]}")
    _check_acyclic(user, {**{i: n.parent for i, n in live.items()}, **{i: n.parent for i, n in new.items()}})
    memory_ids = [n.memory_id for n in batch.nodes if n.memory_id is not None]
    texts = _texts(cur, mark, user, memory_ids)
    require_ids(user, memory_ids, texts)
    rev = revision(cur, mark, user)
    siblings = _sibling_positions(live)
    for node in batch.nodes:
        position = node.position if node.position is not None else _next_position(siblings, node.parent)
        siblings[node.parent].append(position)
        stored = TreeNode(node.id, node.type, node.parent, position, node.attributes, node.memory_id,
                          text=None if node.memory_id is None else texts[node.memory_id])
        _insert_version(cur, mark, user, stored, 1, rev)


def edit(cur: Any, mark: str, user: str, edits: Sequence[NodeEdit]) -> None:
    """Each edit becomes its node's next version (one per node: several edits of one node in a call
    are refused). Moves are checked for cycles; a new memory must be stored."""
    for e in edits:
        if not isinstance(e, NodeEdit):
            raise TypeError(f"expected NodeEdit, got {type(e).__name__}")
    ids = [e.id for e in edits]
    if len(set(ids)) != len(ids):
        raise TreeWriteError("one edit per node in a call")
    latest = _latest(cur, mark, user)
    live = _live(latest)
    unknown = [i for i in ids if i not in live]
    if unknown:
        raise UnknownNodeError(f"node(s) of user {user!r} not in the tree: {unknown[:5]}")
    parents = {i: n.parent for i, n in live.items()}
    for e in edits:
        if e.parent is not KEEP:
            if e.parent is not None and e.parent not in live:
                raise UnknownNodeError(f"parent node {e.parent!r} of user {user!r} not in the tree")
            parents[e.id] = e.parent
    _check_acyclic(user, parents)
    memory_ids = [e.memory_id for e in edits if e.memory_id is not KEEP and e.memory_id is not None]
    texts = _texts(cur, mark, user, [*memory_ids, *(live[i].memory_id for i in ids if live[i].memory_id)])
    require_ids(user, memory_ids, texts)
    rev = revision(cur, mark, user)
    siblings = _sibling_positions(live)
    for e in edits:
        old = live[e.id]
        parent = old.parent if e.parent is KEEP else e.parent
        if e.position is not KEEP:
            position = e.position
        elif parent != old.parent:
            position = _next_position(siblings, parent)
            siblings[parent].append(position)
        else:
            position = old.position
        memory_id = old.memory_id if e.memory_id is KEEP else e.memory_id
        attributes = old.attributes if e.attributes is KEEP else e.attributes
        text = None if memory_id is None else texts.get(memory_id, old.text)
        _insert_version(cur, mark, user, TreeNode(e.id, old.type, parent, position, attributes, memory_id, text=text),
                        old.version + 1, rev)


def _subtree(latest: Mapping[str, TreeNode], roots: Iterable[str]) -> list[str]:
    kids: dict[str | None, list[str]] = defaultdict(list)
    for node in latest.values():
        kids[node.parent].append(node.id)
    out: list[str] = []
    seen: set[str] = set()
    todo = list(dict.fromkeys(roots))
    while todo:
        node_id = todo.pop()
        if node_id in seen:
            continue
        seen.add(node_id)
        out.append(node_id)
        todo.extend(kids.get(node_id, ()))
    return out


def remove(cur: Any, mark: str, user: str, ids: Sequence[str]) -> None:
    """Tombstone the nodes and their subtrees (a new, deleted version each): gone from the latest
    tree, still there as of earlier revisions. Every id must be a live node."""
    for node_id in ids:
        _check_id(node_id, "node id")
    latest = _latest(cur, mark, user)
    live = _live(latest)
    unknown = [i for i in ids if i not in live]
    if unknown:
        raise UnknownNodeError(f"node(s) of user {user!r} not in the tree: {unknown[:5]}")
    rev = revision(cur, mark, user)
    for node_id in _subtree(live, ids):
        old = live[node_id]
        gone = TreeNode(old.id, old.type, old.parent, old.position, old.attributes, old.memory_id, text=old.text,
                        deleted=True)
        _insert_version(cur, mark, user, gone, old.version + 1, rev)


def memory_updated(cur: Any, mark: str, user: str, memory: Memory) -> None:
    """After `update(memory)` (generation already bumped): a new version of each live node showing it
    whose text changed, so the old text stays in the node's history."""
    cur.execute(_sql(f"SELECT {_COLUMNS} FROM tree_nodes WHERE user_id=? AND memory_id=? AND latest=1 AND deleted=0",
                     mark), (user, memory.id))
    nodes = [_node(r) for r in cur.fetchall()]
    changed = [n for n in nodes if n.text != memory.text]
    if not changed:
        return
    rev = revision(cur, mark, user)
    for old in changed:
        _insert_version(cur, mark, user, TreeNode(old.id, old.type, old.parent, old.position, old.attributes,
                                                  old.memory_id, text=memory.text), old.version + 1, rev)


def delete_memories(cur: Any, mark: str, user: str, ids: Sequence[str]) -> None:
    """With the memories' deletion (after the user's generation bump): remove every node whose latest
    version shows one of them, with its subtree and all their versions; older rows of other nodes
    showing them lose the pointer (their text snapshot stays: that node's history)."""
    unique = list(dict.fromkeys(ids))
    if not unique:
        return
    cur.execute(_sql("SELECT 1 FROM tree_nodes WHERE user_id=? LIMIT 1", mark), (user,))
    if cur.fetchone() is None:
        return  # no tree: the common case of a flat bank costs one indexed probe
    latest = _latest(cur, mark, user)
    doomed = set(unique)
    roots = [i for i, n in latest.items() if n.memory_id in doomed]
    for node_id in _subtree(latest, roots):
        cur.execute(_sql("DELETE FROM tree_nodes WHERE user_id=? AND node_id=?", mark), (user, node_id))
    for start in range(0, len(unique), 500):
        chunk = unique[start : start + 500]
        marks = ",".join("?" * len(chunk))
        cur.execute(_sql(f"UPDATE tree_nodes SET memory_id=NULL WHERE user_id=? AND memory_id IN ({marks})", mark),
                    (user, *chunk))


def delete_user(cur: Any, mark: str, user: str) -> None:
    """Remove every tree row of a user (history included: it is the user's text)."""
    for table in TREE_TABLES:
        cur.execute(_sql(f"DELETE FROM {table} WHERE user_id=?", mark), (user,))


def read(cur: Any, mark: str, user: str, as_of: int | None = None) -> list[TreeNode]:
    """The live tree in tree order: each node's latest version, or its latest at revision ≤ `as_of`."""
    if as_of is None:
        cur.execute(_sql(f"SELECT {_COLUMNS} FROM tree_nodes WHERE user_id=? AND latest=1 AND deleted=0", mark), (user,))
        return tree_order(_node(r) for r in cur.fetchall())
    if not isinstance(as_of, int) or isinstance(as_of, bool) or as_of < 0:
        raise ValueError(f"as_of must be a generation (an integer >= 0), got {as_of!r}")
    cur.execute(_sql(f"SELECT {_COLUMNS} FROM tree_nodes t WHERE user_id=? AND revision<=? AND version = "
                     "(SELECT MAX(s.version) FROM tree_nodes s WHERE s.user_id=t.user_id AND s.node_id=t.node_id "
                     "AND s.revision<=?)", mark), (user, as_of, as_of))
    return tree_order(n for n in (_node(r) for r in cur.fetchall()) if not n.deleted)


def history(cur: Any, mark: str, user: str, node_id: str) -> list[TreeNode]:
    """Every version of one node, oldest first (tombstones included); `UnknownNodeError` if it has none."""
    cur.execute(_sql(f"SELECT {_COLUMNS} FROM tree_nodes WHERE user_id=? AND node_id=? ORDER BY version", mark),
                (user, node_id))
    rows = cur.fetchall()
    if not rows:
        raise UnknownNodeError(f"node {node_id!r} of user {user!r} has no version in the tree")
    return [_node(r) for r in rows]
