"""Semantic XPath's execution (Liu et al. §3.3, App. A): a parsed `Query` over a user's tree.

A query runs from the root as a weighted node set W ⊆ V × [0, 1], starting at {(root, 1)}; each step
moves along its axis (``/`` children, ``//`` descendants, a node keeping the weight of the node it
was reached from), keeps its node type (``*``: any), applies its position, then multiplies each
weight by the node's relevance to its predicate: ``E(P, W) = {(u, w · Rel(u, P))}``. Relevance is
recursive: a local match ``[attr~"s"]`` / ``[node~"s"]`` asks the scorer (`Scorer`), ``1-P``,
``P*P``, ``(P+P)/2``, ``min``, ``max`` combine two, and ``avg|min|max|gmean(S′)`` folds the
relevance P′ of the nodes S′ reaches from u (its axis, type and position, executed from {(u, 1)}).

Choices the paper leaves open, and ours:

- **Score calibration.** Rel must lie in [0, 1]. A scorer returns values in [0, 1] (the cosine
  scorer clips negative cosines to 0 by default, `rmm.memory.xpath_scorers`); the executor clips
  what it gets to [0, 1] (round-off) and refuses NaN (`ScorerError`).
- **Positions** ``[i]``, ``[-i]``, ``[i:j]`` are 1-based over the whole working set after the node
  test, in tree order (pre-order: a node before its subtree, siblings by position) — App. A's "tree
  order induced by the memory tree", not W3C XPath's per-parent positions. So ``//Turn[-1]`` is the
  user's last turn, while ``/Turn[-1]`` inside an aggregate is the last turn of that one node (the
  inner step runs from each node alone). An index past either end selects nothing; a slice is
  clipped to the set (``[-3:-1]`` of a two-node set is both); ``[i:j]`` includes both ends.
- **A node reached twice** (``//`` from a node and from its ancestor) appears once, with the larger
  of its weights: a set, not a bag, and the union of fuzzy sets is their maximum.
- **Empty aggregates.** An aggregate over no evidence (a Day without POIs) is 0 for every
  function: no evidence is no relevance, so an empty node never wins on a vacuous min or gmean.
  ``gmean`` of evidence containing a 0 is 0.
- **A node without the attribute** a local match names (``[title~"x"]`` on a node with no title)
  has relevance 0. ``node`` reads the node's memory text when it shows a memory, else its
  attributes as ``name: value`` lines (`rmm.memory.tree.TreeNode.content`).
- **Nothing is dropped by a predicate**: a node with weight 0 stays in the set (a later
  ``1-P`` cannot revive it, its weight is multiplied). The result is ranked by weight, ties in tree
  order (`Execution.ranked`); the root itself is in the result only for the empty query.
- **A local match used twice** is scored once: its scores are cached per (attribute, text) for the
  whole execution, so a predicate repeated across steps (``//Session[max(/Turn[node~Q])]/Turn[node~Q]``)
  scores each node once.

- **Versions.** A query reads the latest tree; ``TreeView.from_store(store, user, as_of=g)`` reads
  it as it was after generation g (`rmm.memory.tree`), a node whose text changed since being
  scored from its old text rather than the memory's new vector.

Execution is deterministic for a deterministic scorer (no sampling, stable sorts), and costs one
scorer call (two where some nodes have no vector) per distinct local match plus numpy work linear
in the nodes reached; a `TreeView` (the tree in flat arrays, its vectors unit-normalised) is built
once per tree and reused (`ViewCache`: per user, until the user's generation moves).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from rmm.errors import RmmError
from rmm.memory.tree import TreeNode, tree_order
from rmm.memory.xpath_syntax import (
    Aggregate,
    AggregateFunction,
    Axis,
    Complement,
    Index,
    Local,
    Maximum,
    Mean,
    Minimum,
    Product,
    Query,
    Relevance,
    Slice,
    Step,
    parse,
)

if TYPE_CHECKING:
    from rmm.memory.storage import MemoryStorage

__all__ = ["Execution", "Scorer", "ScorerError", "StepTrace", "TreeView", "ViewCache", "execute"]


class ScorerError(RmmError, ValueError):
    """A scorer that broke its contract (wrong length, NaN)."""


@runtime_checkable
class Scorer(Protocol):
    """Atom_loc of App. A.5: the relevance in [0, 1] of each text to a query string.

    `vectors`, when given, are the texts' passage vectors ([n, d], unit rows: the stored embeddings
    of the memories the nodes show), which a vector scorer uses instead of encoding the texts; a
    text scorer ignores them.
    """

    name: str

    def score(self, query: str, texts: Sequence[str], vectors: np.ndarray | None = None) -> np.ndarray: ...


@dataclass(frozen=True)
class TreeView:
    """A tree in flat pre-order arrays for execution. Index 0 is the root (no node); index i ≥ 1
    is `nodes[i]`; node i's subtree is indices i .. end[i]-1."""

    nodes: tuple[TreeNode | None, ...]
    types: np.ndarray            # [n] type code per index (-1: the root)
    type_codes: Mapping[str, int]
    end: np.ndarray              # [n] exclusive end of each subtree
    children: tuple[np.ndarray, ...]
    vectors: np.ndarray | None   # [n, d] unit rows (zeros where a node has none), or None
    has_vector: np.ndarray       # [n] bool
    contents: tuple[str, ...]    # [n] what a whole-node match reads ("" for the root)

    def __len__(self) -> int:
        return len(self.nodes)

    @classmethod
    def build(cls, nodes: Sequence[TreeNode], vectors: Mapping[str, Any] | None = None) -> TreeView:
        """The view of `nodes` (one user's tree, any order); `vectors` maps memory ids to their
        embeddings (a node showing a memory without one is scored from its text)."""
        ordered = tree_order(nodes)
        n = len(ordered) + 1
        index = {node.id: i + 1 for i, node in enumerate(ordered)}
        codes: dict[str, int] = {}
        types = np.full(n, -1, dtype=np.int32)
        parent = np.zeros(n, dtype=np.int64)
        for i, node in enumerate(ordered, start=1):
            types[i] = codes.setdefault(node.type, len(codes))
            parent[i] = 0 if node.parent is None else index[node.parent]
        depth = np.zeros(n, dtype=np.int64)
        for i in range(1, n):
            depth[i] = depth[parent[i]] + 1
        end = np.full(n, n, dtype=np.int64)
        stack: list[int] = [0]
        for i in range(1, n):
            while stack and depth[stack[-1]] >= depth[i]:
                end[stack.pop()] = i
            stack.append(i)
        kids: list[list[int]] = [[] for _ in range(n)]
        for i in range(1, n):
            kids[parent[i]].append(i)
        has_vector = np.zeros(n, dtype=bool)
        matrix = None
        if vectors:
            rows = {i: vectors[node.memory_id] for i, node in enumerate(ordered, start=1)
                    if node.memory_id is not None and node.memory_id in vectors}
            if rows:
                first = np.asarray(next(iter(rows.values())), dtype=np.float32).reshape(-1)
                matrix = np.zeros((n, first.shape[0]), dtype=np.float32)
                for i, vector in rows.items():
                    matrix[i] = np.asarray(vector, dtype=np.float32).reshape(-1)
                    has_vector[i] = True
                norms = np.linalg.norm(matrix, axis=1, keepdims=True)
                matrix /= np.where(norms > 0, norms, 1.0)
        return cls((None, *ordered), types, codes, end, tuple(np.asarray(k, dtype=np.int64) for k in kids),
                   matrix, has_vector, ("", *(node.content for node in ordered)))

    @classmethod
    def from_store(cls, store: MemoryStorage, user: str, as_of: int | None = None) -> TreeView:
        """`user`'s tree with the stored embeddings of the memories its nodes show. As of an older
        generation, a node whose text has changed since is scored from its old text, not the vector."""
        nodes = store.tree(user, as_of)
        shown = list(dict.fromkeys(n.memory_id for n in nodes if n.memory_id is not None))
        if not shown:
            return cls.build(nodes)
        ids, matrix = store.embeddings(user)
        wanted = set(shown)
        vectors = {i: matrix[j].numpy() for j, i in enumerate(ids) if i in wanted}
        if as_of is not None:
            current = {m.id: m.text for m in store.get(user, [i for i in shown if i in vectors])}
            stale = {n.memory_id for n in nodes if n.memory_id in current and current[n.memory_id] != n.text}
            vectors = {i: v for i, v in vectors.items() if i not in stale}
        return cls.build(nodes, vectors)


class ViewCache:
    """The latest `TreeView` of each user of one store, rebuilt when the user's generation moves
    (any write: a tree edit, a memory update). Reading and building a tree costs tens of
    milliseconds; a query on it, a few."""

    def __init__(self, store: MemoryStorage, size: int = 64) -> None:
        self.store = store
        self.size = size
        self._views: dict[str, tuple[int, TreeView]] = {}

    def get(self, user: str) -> TreeView:
        generation = self.store.generation(user)
        cached = self._views.get(user)
        if cached is not None and cached[0] == generation:
            return cached[1]
        view = TreeView.from_store(self.store, user)
        self._views.pop(user, None)
        self._views[user] = (generation, view)
        while len(self._views) > self.size:
            self._views.pop(next(iter(self._views)))
        return view


@dataclass(frozen=True)
class StepTrace:
    """One step of an execution: its text, how many nodes its axis reached, and the weighted set it left."""

    step: str
    reached: int
    indices: np.ndarray
    weights: np.ndarray


@dataclass(frozen=True)
class Execution:
    """The weighted node set a query ends with (indices into `view`, in tree order) and its steps."""

    query: Query
    view: TreeView
    indices: np.ndarray
    weights: np.ndarray
    steps: tuple[StepTrace, ...]

    def order(self) -> np.ndarray:
        """Positions into `indices` by weight, highest first; ties in tree order."""
        return np.lexsort((self.indices, -self.weights))

    def ranked(self, k: int | None = None) -> list[tuple[TreeNode | None, float]]:
        """(node, weight), best first (None is the root: only the empty query selects it)."""
        order = self.order()[:k] if k is not None else self.order()
        return [(self.view.nodes[int(self.indices[j])], float(self.weights[j])) for j in order]

    def memory_ids(self, k: int | None = None) -> list[str]:
        """The memories of the best nodes that show one, best first, each once (at most `k`)."""
        out: list[str] = []
        for j in self.order():
            node = self.view.nodes[int(self.indices[j])]
            if node is not None and node.memory_id is not None and node.memory_id not in out:
                out.append(node.memory_id)
                if k is not None and len(out) >= k:
                    break
        return out


def execute(query: Query | str, view: TreeView, scorer: Scorer) -> Execution:
    """Run `query` (an AST or its text: a `QuerySyntaxError` if malformed) over `view`."""
    if isinstance(query, str):
        query = parse(query)
    return _Run(view, scorer).query(query)


_EMPTY_I = np.zeros(0, dtype=np.int64)
_EMPTY_W = np.zeros(0, dtype=np.float64)


class _Run:
    """One execution: the view, the scorer, and the local-match cache."""

    def __init__(self, view: TreeView, scorer: Scorer) -> None:
        self.view = view
        self.scorer = scorer
        self.cache: dict[tuple[str | None, str], np.ndarray] = {}

    def query(self, query: Query) -> Execution:
        indices = np.zeros(1, dtype=np.int64)
        weights = np.ones(1, dtype=np.float64)
        steps = []
        for step in query.steps:
            reached, indices, weights = self.step(step, indices, weights)
            steps.append(StepTrace(str(step), reached, indices, weights))
        return Execution(query, self.view, indices, weights, tuple(steps))

    # -- structure ---------------------------------------------------------------------------

    def step(self, step: Step, indices: np.ndarray, weights: np.ndarray) -> tuple[int, np.ndarray, np.ndarray]:
        indices, weights = self.axis(step.axis, indices, weights)
        reached = len(indices)
        indices, weights = self.select(step, indices, weights)
        if step.predicate is not None and len(indices):
            weights = weights * self.rel(step.predicate, indices)
        return reached, indices, weights

    def axis(self, axis: Axis, indices: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        view = self.view
        if len(indices) == 1:  # the common case: one node (the root, or an aggregate's node)
            i = int(indices[0])
            reached = view.children[i] if axis is Axis.CHILD else np.arange(i + 1, view.end[i], dtype=np.int64)
            return reached, np.full(len(reached), weights[0])
        if axis is Axis.CHILD:
            parts = [view.children[int(i)] for i in indices]
        else:
            parts = [np.arange(int(i) + 1, view.end[int(i)], dtype=np.int64) for i in indices]
        if not parts:
            return _EMPTY_I, _EMPTY_W
        reached = np.concatenate(parts)
        if not len(reached):
            return _EMPTY_I, _EMPTY_W
        best = np.full(len(view), -1.0)
        np.maximum.at(best, reached, np.repeat(weights, [len(p) for p in parts]))
        kept = np.flatnonzero(best >= 0)  # tree order; a node reached twice keeps its larger weight
        return kept, best[kept]

    def select(self, step: Step, indices: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The node test, then the position (over the whole working set, 1-based, tree order)."""
        if step.node_type is not None and len(indices):
            code = self.view.type_codes.get(step.node_type)
            if code is None:
                return _EMPTY_I, _EMPTY_W
            mask = self.view.types[indices] == code
            indices, weights = indices[mask], weights[mask]
        if step.position is None or not len(indices):
            return indices, weights
        n = len(indices)
        if isinstance(step.position, Index):
            k = step.position.index
            j = k - 1 if k > 0 else n + k
            if not 0 <= j < n:
                return _EMPTY_I, _EMPTY_W
            return indices[j : j + 1], weights[j : j + 1]
        assert isinstance(step.position, Slice)
        start = step.position.start - 1 if step.position.start > 0 else n + step.position.start
        stop = step.position.stop if step.position.stop > 0 else n + step.position.stop + 1
        start, stop = max(start, 0), min(stop, n)
        if start >= stop:
            return _EMPTY_I, _EMPTY_W
        return indices[start:stop], weights[start:stop]

    # -- relevance ---------------------------------------------------------------------------

    def rel(self, relevance: Relevance, indices: np.ndarray) -> np.ndarray:
        """Rel(u, P) for each u in `indices`, in [0, 1]."""
        if isinstance(relevance, Local):
            return self.local(relevance, indices)
        if isinstance(relevance, Complement):
            return 1.0 - self.rel(relevance.operand, indices)
        if isinstance(relevance, Product):
            return self.rel(relevance.left, indices) * self.rel(relevance.right, indices)
        if isinstance(relevance, Mean):
            return (self.rel(relevance.left, indices) + self.rel(relevance.right, indices)) / 2.0
        if isinstance(relevance, Minimum):
            return np.minimum(self.rel(relevance.left, indices), self.rel(relevance.right, indices))
        if isinstance(relevance, Maximum):
            return np.maximum(self.rel(relevance.left, indices), self.rel(relevance.right, indices))
        assert isinstance(relevance, Aggregate)
        return self.aggregate(relevance, indices)

    def aggregate(self, aggregate: Aggregate, indices: np.ndarray) -> np.ndarray:
        """Agg({Rel(x, P′) | x ∈ E_S′(u)}) per u; E_S′(u) runs S′'s axis, type and position from {(u, 1)}."""
        inner = aggregate.step
        flat, sizes = self.evidence(inner, indices)
        out = np.zeros(len(indices))
        if not len(flat):
            return out
        assert inner.predicate is not None  # the AST refuses an aggregate without one
        scores = self.rel(inner.predicate, flat)
        full = sizes > 0
        starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))[full]
        function = aggregate.function
        if function is AggregateFunction.AVG:
            folded = np.add.reduceat(scores, starts) / sizes[full]
        elif function is AggregateFunction.MIN:
            folded = np.minimum.reduceat(scores, starts)
        elif function is AggregateFunction.MAX:
            folded = np.maximum.reduceat(scores, starts)
        else:  # gmean: exp(mean(log r)); a zero makes it zero
            with np.errstate(divide="ignore"):
                folded = np.exp(np.add.reduceat(np.log(scores), starts) / sizes[full])
        out[full] = folded
        return out

    def evidence(self, inner: Step, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """E_S′(u) of every u, concatenated in the order of `indices`, and their sizes."""
        view = self.view
        if inner.position is not None:  # positions count per u: one u at a time
            one = np.ones(1)
            parts = [self.select(inner, *self.axis(inner.axis, indices[j : j + 1], one))[0] for j in range(len(indices))]
            sizes = np.array([len(p) for p in parts], dtype=np.int64)
            return (np.concatenate(parts) if parts else _EMPTY_I), sizes
        if inner.axis is Axis.CHILD:
            parts = [view.children[i] for i in indices.tolist()]
        else:
            parts = [np.arange(i + 1, view.end[i], dtype=np.int64) for i in indices.tolist()]
        sizes = np.array([len(p) for p in parts], dtype=np.int64)
        flat = np.concatenate(parts) if parts else _EMPTY_I
        if inner.node_type is not None and len(flat):
            code = view.type_codes.get(inner.node_type)
            keep = np.zeros(len(flat), dtype=bool) if code is None else view.types[flat] == code
            segment = np.repeat(np.arange(len(indices)), sizes)
            flat, sizes = flat[keep], np.bincount(segment[keep], minlength=len(indices)).astype(np.int64)
        return flat, sizes

    def local(self, local: Local, indices: np.ndarray) -> np.ndarray:
        key = (local.attribute, local.text)
        cached = self.cache.get(key)
        if cached is None:
            cached = self.cache[key] = np.full(len(self.view), np.nan)
        todo = indices[np.isnan(cached[indices])]
        if len(todo):
            todo = np.unique(todo)
            cached[todo] = self.compute(local, todo)
        return cached[indices]

    def compute(self, local: Local, todo: np.ndarray) -> np.ndarray:
        view = self.view
        out = np.zeros(len(todo))
        if local.attribute is not None:
            values = [None if view.nodes[int(i)] is None else view.nodes[int(i)].attributes.get(local.attribute)  # type: ignore[union-attr]
                      for i in todo]
            have = [j for j, v in enumerate(values) if v is not None]
            if have:
                out[have] = self.call(local.text, [values[j] for j in have], None)  # type: ignore[misc]
            return out
        with_vector = view.has_vector[todo] if view.vectors is not None else np.zeros(len(todo), dtype=bool)
        if with_vector.any():
            rows = todo[with_vector]
            out[with_vector] = self.call(local.text, [view.contents[i] for i in rows.tolist()],
                                         view.vectors[rows])  # type: ignore[index]
        if not with_vector.all():
            rows = todo[~with_vector]
            out[~with_vector] = self.call(local.text, [view.contents[i] for i in rows.tolist()], None)
        return out

    def call(self, text: str, texts: list[str], vectors: np.ndarray | None) -> np.ndarray:
        scores = np.asarray(self.scorer.score(text, texts, vectors), dtype=np.float64).reshape(-1)
        if scores.shape[0] != len(texts):
            raise ScorerError(f"scorer {getattr(self.scorer, 'name', self.scorer)!r} returned {scores.shape[0]} "
                              f"scores for {len(texts)} texts")
        if np.isnan(scores).any():
            raise ScorerError(f"scorer {getattr(self.scorer, 'name', self.scorer)!r} returned NaN for {text!r}")
        return np.clip(scores, 0.0, 1.0)
