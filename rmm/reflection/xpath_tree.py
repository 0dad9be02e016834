"""Semantic XPath trees of rmm banks (issue 30 item 2): LoCoMo's native tree, and a tree of any bank
kept current by prospective reflection.

Two shapes, both written through `MemoryStorage.add_nodes` / `edit_nodes` (`rmm.memory.tree`), so a
node and the memory it shows land in one transaction:

* **LoCoMo's native tree** (`build_locomo_tree`), as the paper runs LoCoMo:
  ``Conversation → Session → Turn``. A Turn node shows the turn's memory (id = the turn id, text
  ``speaker: text``, exactly `rmm.eval.benchmark_bank.documents(..., "turn")`'s, so a turn bank is
  reused, not duplicated); a Session node has attributes ``date`` and ``session`` and, with
  ``session_memories=True``, shows a kind ``session`` memory (id ``session:<id>``, the session's
  text, refs = its turns) so ``[node~"…"]`` on a session reads a vector. That vector is the
  unit-normalised **mean of its turns' passage vectors**, our choice: an encoder truncates a whole
  session at its maximum length (MiniLM: 256 word pieces, about a third of a LoCoMo session), the
  mean reads every turn and costs no encoder call. A later `update` of the memory re-encodes its text.
  Session memories are ordinary memories: a flat search over the same bank can find them too.
* **A tree of any rmm bank** (`BankTree`): ``User → Session → Topic | Event | Turn | Summary``, a
  Topic/Event node with ``Turn`` children, one per dialogue turn it refers to (``ref`` attribute;
  it shows the turn's memory when the bank stores turns, else carries ``speaker`` and ``text`` when
  the session is known). `BankTree.session_reflected` is the reflector's hook
  (`ProspectiveReflector.listeners`, attached by `BankTree.attach`): after a session is reflected
  the memories it added get nodes under that session's node, and a memory it merged into keeps its
  node — the store already wrote a version with the new text (`rmm.memory.tree.memory_updated`) —
  which gains a version recording the sessions it now spans and Turn children for its new refs.
  `BankTree.sync` places whatever the tree does not show yet (a bank built before it had a tree,
  turns `Agent(store_turns=True)` stored after reflection), grouping by the memory's session time
  (`time_span[0]`; none: an ``undated`` session): the session a memory was first said in.

A tree write that fails is logged and counted (`TreeReport.failures`), never raised into the
reflector: the memories are stored already, and the next `sync` places what is missing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from rmm.errors import RmmError
from rmm.memory.tree import NodeEdit, TreeNode
from rmm.types import Memory, Session

if TYPE_CHECKING:
    from rmm.memory.bank import MemoryBank

__all__ = ["BankTree", "TreeReport", "build_locomo_tree", "locomo_nodes", "session_node_id"]

log = logging.getLogger(__name__)

KIND_TYPES = {"turn": "Turn", "topic": "Topic", "event": "Event", "session": "Summary"}
USER_NODE = "user"
CONVERSATION_NODE = "conversation"
UNDATED = "undated"
_MEMORY_NODE = "memory:"  # the prefix of a node placed for a memory (a Turn ref child is "ref:")


@dataclass
class TreeReport:
    """What a build or sync wrote (and what failed: logged, the memories stay stored)."""

    nodes_added: int = 0
    nodes_versioned: int = 0
    memories_added: int = 0
    failures: int = 0
    errors: list[str] = field(default_factory=list)

    def __iadd__(self, other: TreeReport) -> TreeReport:
        self.nodes_added += other.nodes_added
        self.nodes_versioned += other.nodes_versioned
        self.memories_added += other.memories_added
        self.failures += other.failures
        self.errors += other.errors
        return self


def session_node_id(session_id: str) -> str:
    return f"session:{session_id}"


def _turn_memory(user: str, session: Session, turn: Any) -> Memory:
    return Memory(id=turn.id, user_id=user, kind="turn", text=f"{turn.speaker}: {turn.text}", refs=[turn.id],
                  source_text=turn.text, time_span=(session.time, session.time))


def locomo_nodes(user: str, sessions: Sequence[Session], *,
                 session_memories: bool = True) -> tuple[list[TreeNode], list[Memory]]:
    """LoCoMo's ``Conversation → Session → Turn`` tree of one conversation: its nodes and the memories
    they show (every turn's; each session's with `session_memories`)."""
    speakers = list(dict.fromkeys(t.speaker for s in sessions for t in s.turns))
    nodes = [TreeNode(CONVERSATION_NODE, "Conversation", attributes={"speakers": ", ".join(speakers)} if speakers else {})]
    memories: list[Memory] = []
    for session in sessions:
        if not session.turns:
            continue
        attributes = {"session": session.id, **({"date": session.time} if session.time else {})}
        session_memory = None
        if session_memories:
            session_memory = Memory(id=session_node_id(session.id), user_id=user, kind="session", text=session.text(),
                                    refs=[t.id for t in session.turns], source_text=session.text(),
                                    time_span=(session.time, session.time))
            memories.append(session_memory)
        node_id = session_node_id(session.id)
        nodes.append(TreeNode(node_id, "Session", CONVERSATION_NODE, attributes=attributes,
                              memory_id=None if session_memory is None else session_memory.id))
        for turn in session.turns:
            memories.append(_turn_memory(user, session, turn))
            nodes.append(TreeNode(f"turn:{turn.id}", "Turn", node_id, attributes={"speaker": turn.speaker},
                                  memory_id=turn.id))
    return nodes, memories


def build_locomo_tree(bank: MemoryBank, user: str, sessions: Sequence[Session], *,
                      session_memories: bool = True) -> TreeReport:
    """Write LoCoMo's native tree of `user` into `bank` (module docstring), in one transaction.

    Turn memories the bank already holds (a turn bank) are reused; the others are encoded and
    stored with the nodes. Sessions whose node exists are skipped, so a second call adds only new
    sessions (a tree from another builder is refused rather than mixed)."""
    store = bank.store
    existing = {n.id: n for n in store.tree(user)} if store.has_user(user) else {}
    if existing and CONVERSATION_NODE not in existing:
        raise RmmError(f"user {user!r} already has a tree of another shape (no {CONVERSATION_NODE!r} node); "
                       "LoCoMo's native tree is built into a bank without one")
    nodes, memories = locomo_nodes(user, sessions, session_memories=session_memories)
    nodes = [n for n in nodes if n.id not in existing]
    if not nodes:
        return TreeReport()
    stored = {m.id for m in store.memories(user)} if store.has_user(user) else set()
    wanted = {n.memory_id for n in nodes if n.memory_id is not None}
    new = [m for m in memories if m.id in wanted and m.id not in stored]
    vectors = _vectors(bank, user, new, stored)
    store.add_nodes(user, nodes, new, embeddings=vectors if new else None)
    log.info("LoCoMo tree of %s: %d nodes, %d new memories", user, len(nodes), len(new))
    return TreeReport(nodes_added=len(nodes), memories_added=len(new))


def _vectors(bank: MemoryBank, user: str, new: list[Memory], stored: set[str]) -> torch.Tensor:
    """Passage vectors of `new`: turns encoded in one call, sessions the mean of their turns'."""
    turns = [m for m in new if m.kind == "turn"]
    encoded = bank.encoder.encode_passages([m.text for m in turns]) if turns else torch.zeros(0, bank.dim)
    turn_vectors = {m.id: v for m, v in zip(turns, torch.as_tensor(encoded).detach().float().cpu())}
    need = [r for m in new if m.kind == "session" for r in m.refs if r not in turn_vectors]
    if need:
        have = [r for r in dict.fromkeys(need) if r in stored]
        if have:
            turn_vectors.update(zip(have, bank.embeddings(user, have)))
    out = torch.zeros(len(new), bank.dim)
    for i, memory in enumerate(new):
        if memory.kind == "session":
            rows = [turn_vectors[r] for r in memory.refs if r in turn_vectors]
            out[i] = torch.nn.functional.normalize(torch.stack(rows).mean(0), dim=-1) if rows else 0.0
        else:
            out[i] = turn_vectors[memory.id]
    return out


def _index_session(sessions: dict[str, TreeNode], node: TreeNode) -> None:
    """Find a Session node by its session id (the reflector's) and by its date (a sync's)."""
    if "session" in node.attributes:
        sessions.setdefault(f"id:{node.attributes['session']}", node)
    sessions.setdefault(f"date:{node.attributes.get('date', UNDATED)}", node)


class BankTree:
    """The ``User → Session → Topic/Event/Turn → Turn`` tree of a bank's users, kept current.

    `attach(reflector)` makes every reflected session update the tree; `sync(user)` places memories
    the tree does not show yet. Both write through the bank's store: the new nodes in one transaction,
    then the versions of the nodes whose memories were merged into in another."""

    def __init__(self, bank: MemoryBank) -> None:
        self.bank = bank
        self.report = TreeReport()

    def attach(self, reflector: Any) -> None:
        """Register `session_reflected` with a `ProspectiveReflector` (once)."""
        listeners: list[Callable[[Session, list[Memory]], None]] = reflector.listeners
        if not any(getattr(f, "__self__", None) is self for f in listeners):
            listeners.append(self.session_reflected)

    # ---- the reflector's hook ---------------------------------------------------------------
    def session_reflected(self, session: Session, touched: list[Memory]) -> None:
        """After prospective reflection of `session`: nodes for what it added, versions for what it merged."""
        try:
            self.report += self._place(session.user_id, touched, session)
        except Exception as error:  # noqa: BLE001 - the memories are stored; the next sync places them
            self.report.failures += 1
            self.report.errors.append(f"{type(error).__name__}: {error}")
            log.warning("tree of %s not updated after session %s: %s", session.user_id, session.id, error,
                        exc_info=not isinstance(error, RmmError))

    # ---- reconciliation ---------------------------------------------------------------------
    def sync(self, user: str) -> TreeReport:
        """Give every memory of `user` the tree does not show yet a node; returns what was written."""
        store = self.bank.store
        if not store.has_user(user):
            return TreeReport()
        nodes = store.tree(user)
        shown = {n.memory_id for n in nodes if n.memory_id is not None}
        missing = [m for m in store.memories(user) if m.id not in shown]
        if not missing:
            return TreeReport()
        report = self._place(user, missing, None, nodes)
        self.report += report
        return report

    # ---- placement --------------------------------------------------------------------------
    def _place(self, user: str, memories: Iterable[Memory], session: Session | None,
               nodes: list[TreeNode] | None = None) -> TreeReport:
        store = self.bank.store
        nodes = store.tree(user) if nodes is None else nodes
        by_id = {n.id: n for n in nodes}
        showing = {n.memory_id: n for n in nodes if n.memory_id is not None and n.id.startswith(_MEMORY_NODE)}
        sessions: dict[str, TreeNode] = {}
        for n in nodes:
            if n.type == "Session":
                _index_session(sessions, n)
        turn_ids = self._stored_turns(user)
        new: list[TreeNode] = []
        edits: list[NodeEdit] = []
        if USER_NODE not in by_id:
            new.append(TreeNode(USER_NODE, "User", attributes={"name": user}))
        report = TreeReport()
        for memory in memories:
            parent = self._session_node(memory, session, sessions, new)
            old = showing.get(memory.id)
            if old is not None:  # merged into: a version naming the sessions it spans, Turn refs it gained
                spans = [s for s in old.attributes.get("sessions", "").split(", ") if s]
                here = parent.attributes.get("session") or parent.attributes.get("date", UNDATED)
                if here not in spans:
                    edits.append(NodeEdit(old.id, attributes={**old.attributes, "sessions": ", ".join([*spans, here])}))
                known = {n.attributes.get("ref") for n in nodes if n.parent == old.id}
                new += self._refs(old.id, memory, session, turn_ids, known)
                continue
            node_type = KIND_TYPES[memory.kind]
            here = parent.attributes.get("session") or parent.attributes.get("date", UNDATED)
            attributes = {"sessions": here} if node_type != "Turn" else {}
            if memory.kind == "turn" and session is not None:
                turn = next((t for t in session.turns if t.id == memory.id), None)
                if turn is not None:
                    attributes["speaker"] = turn.speaker
            node = TreeNode(f"{_MEMORY_NODE}{memory.id}", node_type, parent.id, attributes=attributes, memory_id=memory.id)
            new.append(node)
            showing[memory.id] = node
            if node_type != "Turn":
                new += self._refs(node.id, memory, session, turn_ids, set())
        if new:
            store.add_nodes(user, new)
            report.nodes_added = len(new)
        if edits:
            store.edit_nodes(user, edits)
            report.nodes_versioned = len(edits)
        return report

    def _stored_turns(self, user: str) -> set[str]:
        return {m.id for m in self.bank.store.memories(user) if m.kind == "turn"}

    @staticmethod
    def _session_node(memory: Memory, session: Session | None, sessions: dict[str, TreeNode],
                      new: list[TreeNode]) -> TreeNode:
        """The Session node a memory goes under: the reflected session's, else by its session time."""
        if session is not None:
            key, attributes = f"id:{session.id}", {"session": session.id, **({"date": session.time} if session.time else {})}
            node_id = session_node_id(session.id)
        else:
            when = memory.time_span[0] if memory.time_span and memory.time_span[0] else UNDATED
            key, attributes, node_id = f"date:{when}", {"date": when}, f"session@{when}"
        if key not in sessions:
            _index_session(sessions, TreeNode(node_id, "Session", USER_NODE, attributes=attributes))
            new.append(sessions[key])
        return sessions[key]

    @staticmethod
    def _refs(parent: str, memory: Memory, session: Session | None, turn_ids: set[str],
              known: set[str | None]) -> list[TreeNode]:
        """Turn children of a topic/event node: one per ref it does not have yet that can be shown or read."""
        turns = {t.id: t for t in session.turns} if session is not None else {}
        out = []
        for ref in dict.fromkeys(memory.refs):
            if ref in known:
                continue
            attributes = {"ref": ref}
            if ref in turns:
                attributes.update(speaker=turns[ref].speaker, text=turns[ref].text)
            elif ref not in turn_ids:
                continue  # nothing to show or read: the topic's own text already holds it
            out.append(TreeNode(f"ref:{memory.id}:{ref}", "Turn", parent, attributes=attributes,
                                memory_id=ref if ref in turn_ids else None))
        return out
