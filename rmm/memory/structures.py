"""The event graph's and the XPath tree's store methods, written once for both stores.

`rmm.memory.graph` and `rmm.memory.tree` already hold SQL both stores run (``?`` placeholders a
store turns into its own); what was left per store was the same wrapper eleven times over: open a
transaction, check the user (and, to write, bump its generation), call the shared function. This
mixin is that wrapper; a store supplies its placeholder (`_mark`), the two transactions
(`_reading`, `_writing`), `_require_ids`, and `_memories_with` (its own insert, followed on the
same cursor by the rows that point at the new memories).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import torch

from rmm.memory import graph, tree
from rmm.memory.graph import Edge, Event, Topic
from rmm.memory.tree import NodeEdit, TreeNode
from rmm.memory.validation import as_matrix, check_user_name
from rmm.types import Memory

__all__ = ["StructureMethods"]


class StructureMethods:
    """`MemoryStorage`'s graph and tree methods over a store's own transactions."""

    _mark: str  # the store's SQL placeholder

    def _reading(self, user: str) -> AbstractContextManager[Any]:
        """A cursor on which `user` is known to exist (`UnknownUserError` otherwise)."""
        raise NotImplementedError

    def _writing(self, user: str) -> AbstractContextManager[Any]:
        """A cursor in one transaction on which `user` exists and its generation has been bumped
        (its row lock serialises the user's structure writes)."""
        raise NotImplementedError

    def _require_ids(self, cur: Any, user: str, ids: list[str]) -> None:
        raise NotImplementedError

    def _memories_with(self, user: str, memories: list[Memory], vectors: np.ndarray | None,
                       write: Callable[[Any], None]) -> None:
        raise NotImplementedError

    # -- the event graph (rmm.memory.graph) -----------------------------------------------------------
    def add_events(self, user: str, events: list[Event | Memory], edges: list[Edge] | None = None,
                   topics: list[Topic] | None = None, embeddings: torch.Tensor | np.ndarray | None = None) -> None:
        """Insert event memories with their edges and topic memberships in one transaction
        (`rmm.memory.graph`): a refused or failed write leaves none of them."""
        batch = graph.GraphWrite.check(user, events, edges or (), topics or ())
        self._memories_with(user, batch.memories, batch.vectors(embeddings),
                            lambda cur: graph.write(cur, self._mark, batch))

    def rewire(self, user: str, old_ids: list[str], new_id: str) -> None:
        """A merge's graph half: move the edges and memberships of `old_ids` onto the event `new_id`."""
        with self._writing(user) as cur:
            self._require_ids(cur, user, [*old_ids, new_id])
            graph.rewire(cur, self._mark, user, list(old_ids), new_id)

    def neighbours(self, user: str, memory_id: str, direction: graph.Direction = "out", label: str | None = None) -> list[Edge]:
        """The edges leaving / entering / touching one memory of `user` (`rmm.memory.graph.neighbours`)."""
        with self._reading(user) as cur:
            self._require_ids(cur, user, [memory_id])
            return graph.neighbours(cur, self._mark, user, memory_id, direction, label)

    def topics(self, user: str) -> list[Topic]:
        """Every topic of `user` with its members."""
        with self._reading(user) as cur:
            return graph.topics(cur, self._mark, user)

    def members(self, user: str, topic: str) -> list[str]:
        """The event ids in one topic of `user` (empty for a topic that does not exist)."""
        with self._reading(user) as cur:
            return graph.members(cur, self._mark, user, topic)

    def participants(self, user: str, ids: list[str]) -> dict[str, tuple[str, ...]]:
        """The participants of the given events of `user`."""
        with self._reading(user) as cur:
            return graph.participants(cur, self._mark, user, ids)

    # -- the XPath tree (rmm.memory.tree) -------------------------------------------------------------
    def add_nodes(self, user: str, nodes: list[TreeNode], memories: list[Memory] | None = None,
                  embeddings: torch.Tensor | np.ndarray | None = None) -> None:
        """Insert tree nodes (`rmm.memory.tree`), and the memories they show, in one transaction:
        a refused or failed write leaves neither."""
        batch = tree.TreeWrite.check(user, nodes, memories or ())
        shown = list(batch.memories)
        vectors = None if embeddings is None else as_matrix(embeddings, len(shown))
        self._memories_with(user, shown, vectors, lambda cur: tree.write(cur, self._mark, batch))

    def edit_nodes(self, user: str, edits: list[NodeEdit]) -> None:
        """Write each edited node's next version (`rmm.memory.tree.NodeEdit`), all or nothing."""
        check_user_name(user)
        edits = list(edits)
        with self._writing(user) as cur:
            tree.edit(cur, self._mark, user, edits)

    def remove_nodes(self, user: str, ids: list[str]) -> None:
        """Tombstone nodes and their subtrees (their memories stay; the history stays readable)."""
        check_user_name(user)
        with self._writing(user) as cur:
            tree.remove(cur, self._mark, user, list(ids))

    def tree(self, user: str, as_of: int | None = None) -> list[TreeNode]:
        """`user`'s tree in tree order: the latest versions, or as it was after generation `as_of`."""
        with self._reading(user) as cur:
            return tree.read(cur, self._mark, user, as_of)

    def node_history(self, user: str, node_id: str) -> list[TreeNode]:
        """Every version of one node of `user`, oldest first."""
        with self._reading(user) as cur:
            return tree.history(cur, self._mark, user, node_id)
