"""CompassMem's construction (paper §4.2, prompts App. F.1): a user's sessions → an event graph.

Per session, in dialogue order (`build_event_graph`):

1. **Events.** With an LLM, one extraction call (6-10 events, strict JSON: summary, turn refs,
   people ≤ 3, time) and, for two or more events, one relation call over the session's event pairs
   (free-form labels with evidence turns). Without one — or when a reply is still unusable after
   one retry — the labelled **non-LLM fallback**: events are the segments of the topic segmenter
   (`rmm.reflection.segment`; text = the turns, `source_text` = `FALLBACK_LABEL`), linked by
   ``next`` edges between consecutive events. A relation reply unusable twice leaves the LLM's
   events linked by ``next`` edges instead (counted).
2. **Fusion** of each new event with its nearest stored event e* by passage-vector cosine: below
   the merge threshold it is inserted; at or above it the LLM's coreference prompt decides
   (same event → merge, overlap → an edge labelled with its relation type, else insert) — without
   an LLM, or when the decision is unusable twice, at or above the threshold means merge. A merge
   keeps e*'s id (a cited id stays valid) and folds the new summary, turns and time into it; the
   edges the new event would have had are rewired onto e*, as `rmm.memory.graph.rewire` does (a
   loop is dropped, parallel edges pool their evidence). The fallback also links each new event to
   its nearest earlier events at or above the `similar` threshold (``similar`` edges).
3. **Topics.** The first time (no topic yet) k-means over all events with n = max(2, min(⌊N/5⌋,
   50)) (spherical, k-means++ seeded); afterwards each inserted event joins its nearest topic
   centroid when the cosine reaches δ, else starts a new topic; every T-th session all events are
   re-clustered. Topic ids carry their clustering's generation (``g003-t007``): topic membership
   in the store only grows, so a re-clustering writes a new generation and `current_topics` reads
   the newest one.

Writes: each session's new events, edges and topic rows go through `store.add_events`, one
transaction (a failure stores nothing of that session). Events merged into are then rewritten
with `bank.update` (their new text and vector), and the session is recorded as built in the
store's metadata; a crash between those steps leaves a consistent graph whose merged events lack
the last session's addition. Participants of a stored event are fixed at insertion (the graph
tables have no update), so a merge keeps e*'s.

Thresholds are cosines on the bank encoder's scale. The paper's (merge 0.9, δ 0.9) are on
BGE-M3's; `calibrate_thresholds` picks ours by quantile of nearest-neighbour cosines over
training conversations only, and `CALIBRATED` records the values with the command that chose them.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from rmm.errors import RmmError
from rmm.memory.graph import Edge, Event, Topic
from rmm.memory.validation import MAX_PARTICIPANTS
from rmm.reflection.segment import SegmenterConfig, TopicSegmenter, turn_line
from rmm.types import Dataset, Memory, Session, Turn

if TYPE_CHECKING:
    from rmm.llm.base import LLM
    from rmm.memory.bank import MemoryBank
    from rmm.memory.storage import MemoryStorage

__all__ = [
    "CALIBRATED",
    "CALIBRATION_QUANTILES",
    "FALLBACK_LABEL",
    "PAPER_THRESHOLDS",
    "BuildReport",
    "Calibration",
    "EventGraphBuilder",
    "EventGraphConfig",
    "Thresholds",
    "build_event_graph",
    "calibrate_thresholds",
    "current_topics",
    "kmeans",
    "n_topics",
    "thresholds_for",
]

log = logging.getLogger(__name__)

FALLBACK_LABEL = "[extractive event: non-LLM fallback segmentation]"
NEXT, SIMILAR, SAME_EVENT = "next", "similar", "same_event"
_META = "event-graph:"  # + user: JSON {"sessions": [ids built, in order]}
_TOPIC_ID = re.compile(r"g(\d+)-t(\d+)")
_MAX_TOPIC_SUMMARY = 160


@dataclass(frozen=True)
class Thresholds:
    """Cosine thresholds on one encoder's scale: `merge` (fusion: a new event this close to its
    nearest stored one is a merge candidate), `topic` (δ: joining the nearest topic), `similar`
    (the fallback's cross-session ``similar`` edges); `source` says how they were chosen."""

    merge: float
    topic: float
    similar: float
    source: str = ""

    def __post_init__(self) -> None:
        for name in ("merge", "topic", "similar"):
            value = getattr(self, name)
            if not -1.0 <= value <= 1.0:
                raise ValueError(f"{name} threshold must be a cosine in [-1, 1], got {value}")

    def key(self) -> str:
        return f"m{self.merge:.4f}-d{self.topic:.4f}-s{self.similar:.4f}"


# The paper's values (App. B.2), on BGE-M3's scale; `similar` is ours (the paper's graph has no such edge).
PAPER_THRESHOLDS = Thresholds(0.9, 0.9, 0.9, "paper values (merge 0.9, delta 0.9) on BGE-M3's cosine scale")

# Which quantile of which distribution each threshold is, over training conversations' fallback
# events (`calibrate_thresholds`): `merge` and `similar` of each event's nearest earlier-session
# event (a merge should be rare: the top 2%; `similar` edges link the top 10%), `topic` of each
# event's cosine to its own k-means centroid at the paper's cluster count (a quarter of the events
# k-means itself groups would start a new topic online). The quantiles are a judgement: the paper's
# 0.9 cannot be carried over without BGE-M3, which this machine does not have.
CALIBRATION_QUANTILES: dict[str, float] = {"merge": 0.98, "similar": 0.90, "topic": 0.25}

# Calibrated thresholds by encoder fingerprint, computed with
#   python -m rmm.bench.compass_build calibrate --retriever minilm
# (LoCoMo's training conversations: all but conv-30, conv-48, conv-49, which rmm train holds out
# with its defaults --heldout 0.3 --seed 0; the default segmenter).
# MiniLM (all-MiniLM-L6-v2): 1,523 nearest-earlier-event cosines (p05 0.47, p50 0.68, p95 0.83, max
# 0.92) and 1,580 own-centroid cosines (p05 0.67, p50 0.83, p95 0.92).
CALIBRATED: dict[str, Thresholds] = {
    "bert-d384-mean-l2:ac926ec96732d916": Thresholds(
        0.86, 0.7721, 0.7997,
        "calibrated for minilm on locomo users conv-26, conv-41, conv-42, conv-43, conv-44, conv-47, conv-50: "
        "merge = q0.98, similar = q0.9 of the nearest earlier-session event's cosine; delta = q0.25 of the cosine "
        "to the own k-means centroid"),
}


def thresholds_for(encoder: Any) -> Thresholds:
    """The calibrated thresholds of `encoder` (by its fingerprint), else the paper's with a warning."""
    found = CALIBRATED.get(str(getattr(encoder, "fingerprint", "")))
    if found is not None:
        return found
    log.warning("no calibrated event-graph thresholds for encoder %r: using the paper's (BGE-M3 scale); "
                "run python -m rmm.bench.compass_build calibrate", getattr(encoder, "name", encoder))
    return PAPER_THRESHOLDS


@dataclass(frozen=True)
class EventGraphConfig:
    """How the graph is built. `thresholds=None` takes `thresholds_for(bank.encoder)`.

    `recluster_every` is T (the paper's 4); `max_topics` and `topic_divisor` set k-means' n =
    max(2, min(⌊N/divisor⌋, max_topics)); `retries` re-asks an unusable reply that many times
    before the fallback; `max_merged_refs` stops an event from growing without bound (a merge that
    would exceed it becomes an edge instead); `similar_per_event` caps the fallback's ``similar``
    edges per new event; `structured` sends the JSON schemas (constrained decoding where the
    backend has it).
    """

    thresholds: Thresholds | None = None
    recluster_every: int = 4
    max_topics: int = 50
    topic_divisor: int = 5
    retries: int = 1
    max_merged_refs: int = 24
    similar_per_event: int = 2
    max_tokens: int = 2048
    structured: bool = False
    segmenter: SegmenterConfig = field(default_factory=SegmenterConfig)
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("recluster_every", "max_topics", "topic_divisor", "max_merged_refs", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.retries < 0 or self.similar_per_event < 0:
            raise ValueError("retries and similar_per_event must be >= 0")

    def key(self, thresholds: Thresholds) -> str:
        """What the graph depends on (for caching graphs built with it)."""
        return (f"{thresholds.key()}-T{self.recluster_every}-n{self.topic_divisor}-{self.max_topics}-"
                f"r{self.retries}-mr{self.max_merged_refs}-sp{self.similar_per_event}-"
                f"{'json-' if self.structured else ''}{self.segmenter.key()}-seed{self.seed}")


@dataclass
class BuildReport:
    """What one build did (sum reports over users with `+=`)."""

    users: int = 0
    sessions: int = 0
    skipped_sessions: int = 0  # already in the graph (recorded in the store's metadata)
    llm_sessions: int = 0  # sessions whose events came from the LLM
    fallback_sessions: int = 0  # sessions built by the non-LLM path (no LLM, or its output failed twice)
    extraction_failures: int = 0  # unusable extraction replies (retries included)
    relation_failures: int = 0  # sessions whose relation reply was unusable twice (→ `next` edges)
    fusion_failures: int = 0  # fusion decisions unusable twice (→ the threshold rule)
    llm_calls: int = 0
    turns: int = 0
    events_extracted: int = 0
    events_inserted: int = 0
    events_merged: int = 0
    edges: Counter[str] = field(default_factory=Counter)
    topics: int = 0  # topics of the current generation at the end (summed over users)
    reclusterings: int = 0
    seconds: float = 0.0
    thresholds: str = ""

    def __iadd__(self, other: BuildReport) -> BuildReport:
        for name, value in vars(other).items():
            if name == "edges":
                self.edges.update(value)
            elif name == "thresholds":
                self.thresholds = self.thresholds or value
            else:
                setattr(self, name, getattr(self, name) + value)
        return self

    def to_json(self) -> dict[str, Any]:
        out = {k: v for k, v in vars(self).items() if k != "edges"}
        out["edges"] = dict(sorted(self.edges.items()))
        return out


# ---------------------------------------------------------------------------------- topic clustering
def n_topics(n_events: int, divisor: int = 5, most: int = 50) -> int:
    """The paper's cluster count, max(2, min(⌊N/5⌋, 50)), never more than the events there are."""
    return min(n_events, max(2, min(n_events // divisor, most)))


def kmeans(vectors: torch.Tensor, k: int, *, seed: int = 0, iterations: int = 30) -> torch.Tensor:
    """Spherical k-means (cosine) with k-means++ seeding: each row's cluster in [0, k), every cluster
    non-empty. Deterministic for a seed."""
    n = vectors.shape[0]
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, {n}], got {k}")
    x = F.normalize(vectors.float(), dim=-1)
    generator = torch.Generator().manual_seed(seed)
    first = int(torch.randint(n, (1,), generator=generator))
    centres = [x[first]]
    for _ in range(1, k):
        distance = (1 - (x @ torch.stack(centres).T).max(dim=1).values).clamp_min(0)
        weights = distance if float(distance.sum()) > 0 else torch.ones(n)
        centres.append(x[int(torch.multinomial(weights, 1, generator=generator))])
    c = torch.stack(centres)
    assign = torch.full((n,), -1, dtype=torch.long)
    for _ in range(iterations):
        new = (x @ c.T).argmax(dim=1)
        for j in range(k):  # an empty cluster takes the row farthest from its centre
            if not bool((new == j).any()):
                own = (x * c[new]).sum(-1)
                counts = torch.bincount(new, minlength=k)
                own[counts[new] <= 1] = float("inf")
                new[int(own.argmin())] = j
        if torch.equal(new, assign):
            break
        assign = new
        c = F.normalize(torch.stack([x[assign == j].mean(0) for j in range(k)]), dim=-1)
    return assign


def current_topics(store: MemoryStorage, user: str) -> list[Topic]:
    """The topic layer as it stands: the newest generation's topics (``gNNN-tNNN``; a re-clustering
    writes a new generation because stored membership only grows). Topics with other ids (written
    by something else) are all returned when no generation is there."""
    topics = store.topics(user)
    generations = [int(m.group(1)) for t in topics if (m := _TOPIC_ID.fullmatch(t.id))]
    if not generations:
        return topics
    newest = max(generations)
    return [t for t in topics if (m := _TOPIC_ID.fullmatch(t.id)) and int(m.group(1)) == newest]


# ---------------------------------------------------------------------------------- the builder
@dataclass
class _Draft:
    """A new event of the session before fusion."""

    summary: str
    refs: list[str]
    participants: list[str]
    time: str | None = None
    extractive: bool = False


@dataclass
class _Plan:
    """A session's events and in-session edges (by draft position), from the LLM or the fallback."""

    drafts: list[_Draft]
    edges: list[tuple[int, int, str, tuple[str, ...]]]
    llm: bool
    vectors: torch.Tensor | None = None  # the drafts' passage vectors, when already encoded


@dataclass
class _State:
    """One user's graph as the builder needs it: events with unit vectors, the current topics."""

    ids: list[str] = field(default_factory=list)
    vectors: torch.Tensor | None = None
    memories: dict[str, Memory] = field(default_factory=dict)
    participants: dict[str, tuple[str, ...]] = field(default_factory=dict)
    generation: int = 0
    topics: dict[str, list[str]] = field(default_factory=dict)  # current generation: id → members
    sessions: list[str] = field(default_factory=list)

    def matrix(self, dim: int) -> torch.Tensor:
        return self.vectors if self.vectors is not None else torch.zeros(0, dim)


class EventGraphBuilder:
    """Builds users' event graphs in `bank` (see the module docstring); `report` accumulates."""

    def __init__(self, bank: MemoryBank, llm: LLM | None = None, config: EventGraphConfig | None = None) -> None:
        self.bank, self.llm = bank, llm
        self.config = config or EventGraphConfig()
        self.thresholds = self.config.thresholds or thresholds_for(bank.encoder)
        self.segmenter = TopicSegmenter(bank.encoder, self.config.segmenter)
        self.report = BuildReport(thresholds=self.thresholds.source)
        self.dim = int(bank.encoder.dim)

    @property
    def settings_key(self) -> str:
        llm = self.llm.name if self.llm is not None else "fallback"
        return f"{llm}-{self.config.key(self.thresholds)}"

    # ---- public ------------------------------------------------------------------------------
    def build(self, user: str, sessions: Sequence[Session]) -> BuildReport:
        """Add `sessions` (dialogue order) to `user`'s graph; sessions already built are skipped.
        Returns this call's report (also added to `self.report`)."""
        t0 = time.perf_counter()
        report = BuildReport(users=1, thresholds=self.thresholds.source)
        state = self._load(user)
        todo = [s for s in sessions if s.id not in state.sessions]
        report.skipped_sessions = len(sessions) - len(todo)
        wrong = [s.id for s in todo if s.user_id != user]
        if wrong:
            raise ValueError(f"sessions {wrong[:5]} belong to another user than {user!r}")
        plans: list[_Plan | None] = [None] * len(todo)
        if self.llm is None:  # the fallback's segments and vectors do not depend on the graph: all at once
            plans = list(self._fallback_plans(todo))
        for session, plan in zip(todo, plans):
            if not session.turns:
                continue
            self._session(user, session, state, report, plan)
        report.topics = len(state.topics)
        report.seconds = time.perf_counter() - t0
        self.report += report
        return report

    # ---- one session ---------------------------------------------------------------------------
    def _session(self, user: str, session: Session, state: _State, report: BuildReport, plan: _Plan | None) -> None:
        report.sessions += 1
        report.turns += len(session.turns)
        if plan is None:
            plan = self._llm_plan(session, report)
        if plan.llm:
            report.llm_sessions += 1
        else:
            report.fallback_sessions += 1
        drafts = plan.drafts
        report.events_extracted += len(drafts)
        if not drafts:
            return
        raw = plan.vectors if plan.vectors is not None else self._encode([d.summary for d in drafts])
        vectors = F.normalize(raw, dim=-1)  # cosines
        when = _session_time(session)
        turns = {t.id: t for t in session.turns}
        existing = state.matrix(self.dim)
        nearest: list[tuple[str, float] | None] = []
        if len(existing):
            sims = vectors @ existing.T
            best = sims.max(dim=1)
            nearest = [(state.ids[int(j)], float(c)) for c, j in zip(best.values, best.indices)]
        else:
            sims = torch.zeros(len(drafts), 0)
            nearest = [None] * len(drafts)
        decisions = self._fuse(drafts, nearest, state, when, report)
        node: list[str] = []
        new_events: list[Event] = []
        new_rows: list[int] = []
        edges: list[Edge] = []
        merged: dict[str, Memory] = {}
        for i, (draft, decision) in enumerate(zip(drafts, decisions)):
            kind, target, label = decision
            if kind == "merge":
                current = merged.get(target, state.memories[target])
                if len(set(current.refs) | set(draft.refs)) <= self.config.max_merged_refs:
                    merged[target] = _merged(current, draft, when, turns)
                    node.append(target)
                    report.events_merged += 1
                    continue
                kind, label = "edge", SAME_EVENT if plan.llm else SIMILAR
            memory = _event_memory(user, draft, when, turns)
            new_events.append(Event(memory, tuple(draft.participants[:MAX_PARTICIPANTS])))
            new_rows.append(i)
            node.append(memory.id)
            if kind == "edge" and target is not None:
                edges.append(Edge(memory.id, target, label or SIMILAR))
        for (a, b, label, evidence) in plan.edges:  # rewired onto merge targets; loops dropped
            if node[a] != node[b]:
                edges.append(Edge(node[a], node[b], label, evidence))
        if not plan.llm and self.config.similar_per_event and len(existing):
            edges += self._similar_edges(sims, new_rows, node, state, edges)
        ids_after = state.ids + [e.memory.id for e in new_events]
        vectors_after = torch.cat([existing, vectors[new_rows]]) if new_rows else existing.clone()
        merged_raw = self._encode([m.text for m in merged.values()])
        for memory_id, vector in zip(merged, F.normalize(merged_raw, dim=-1)):
            vectors_after[ids_after.index(memory_id)] = vector
        texts = {**{i: m.text for i, m in state.memories.items()}, **{e.memory.id: e.memory.text for e in new_events},
                 **{i: m.text for i, m in merged.items()}}
        topics, generation, memberships = self._topics(state, ids_after, vectors_after,
                                                       [e.memory.id for e in new_events], texts, report)
        edges = _pool(edges)
        self.bank.store.add_events(user, new_events, edges, topics, embeddings=raw[new_rows] if new_rows else None)
        for memory, vector in zip(merged.values(), merged_raw):
            self.bank.update(user, memory, embedding=vector)
        state.sessions.append(session.id)
        self.bank.store.set_meta(_META + user, json.dumps({"sessions": state.sessions}))
        report.events_inserted += len(new_events)
        report.edges.update(e.label for e in edges)
        state.ids, state.vectors = ids_after, vectors_after
        state.memories.update({e.memory.id: e.memory for e in new_events})
        state.memories.update(merged)
        state.participants.update({e.memory.id: e.participants for e in new_events})
        state.generation, state.topics = generation, memberships

    def _similar_edges(self, sims: torch.Tensor, rows: list[int], node: list[str], state: _State,
                       edges: list[Edge]) -> list[Edge]:
        """The fallback's cross-session links: each inserted event to its nearest stored events at
        or above the `similar` threshold (at most `similar_per_event`, none it is already linked to)."""
        linked = {(e.source, e.target) for e in edges}
        out: list[Edge] = []
        k = min(self.config.similar_per_event, sims.shape[1])
        for i in rows:
            values, indices = sims[i].topk(k)
            for value, j in zip(values.tolist(), indices.tolist()):
                target = state.ids[j]
                if value >= self.thresholds.similar and (node[i], target) not in linked:
                    out.append(Edge(node[i], target, SIMILAR))
        return out

    # ---- fusion ----------------------------------------------------------------------------------
    def _fuse(self, drafts: list[_Draft], nearest: list[tuple[str, float] | None], state: _State, when: str,
              report: BuildReport) -> list[tuple[str, str | None, str | None]]:
        """Per draft: ("insert", None, None), ("merge", e*, None) or ("edge", e*, label)."""
        out: list[tuple[str, str | None, str | None]] = [("insert", None, None)] * len(drafts)
        asks = [i for i, n in enumerate(nearest) if n is not None and n[1] >= self.thresholds.merge]
        for i in asks:
            out[i] = ("merge", nearest[i][0], None)  # type: ignore[index]
        if self.llm is None or not asks:
            return out
        from rmm.prompts.compass_parse import parse_fusion
        from rmm.prompts.compass_render import FUSION_SCHEMA, fusion_messages

        def prompt(i: int) -> list:
            target = state.memories[nearest[i][0]]  # type: ignore[index]
            stored = (target.text, (target.time_span or (None, None))[0], state.participants.get(target.id, ()))
            return fusion_messages((drafts[i].summary, drafts[i].time or when, drafts[i].participants), stored)

        decided = self._ask({i: prompt(i) for i in asks}, parse_fusion, FUSION_SCHEMA, report, "fusion")
        for i in asks:
            decision = decided.get(i)
            if decision is None:
                report.fusion_failures += 1  # the threshold rule stands
            elif decision.same_event:
                pass
            elif decision.has_overlap:
                out[i] = ("edge", nearest[i][0], decision.relation_type or "overlap")  # type: ignore[index]
            else:
                out[i] = ("insert", None, None)
        return out

    # ---- the LLM's plan ---------------------------------------------------------------------------
    def _ask(self, prompts: dict[int, list], parse: Any, schema: dict, report: BuildReport, what: str) -> dict[int, Any]:
        """One batched call for `prompts`, the unusable ones re-asked `retries` times; the parsed ones."""
        done: dict[int, Any] = {}
        pending = dict(prompts)
        for attempt in range(self.config.retries + 1):
            if not pending:
                break
            keys = list(pending)
            try:
                replies = self.llm.generate([pending[k] for k in keys],  # type: ignore[union-attr]
                                            json_schema=schema if self.config.structured else None,
                                            max_tokens=self.config.max_tokens)
                report.llm_calls += len(keys)
            except RmmError as exc:
                log.warning("%s call failed (attempt %d): %s", what, attempt + 1, exc)
                if what == "events":
                    report.extraction_failures += len(keys)
                continue
            for key, reply in zip(keys, replies):
                try:
                    done[key] = parse(reply)
                    del pending[key]
                except RmmError as exc:  # PromptParseError
                    log.warning("unusable %s reply (attempt %d): %s", what, attempt + 1, exc)
                    if what == "events":
                        report.extraction_failures += 1
        return done

    def _llm_plan(self, session: Session, report: BuildReport) -> _Plan:
        from rmm.prompts.compass_parse import parse_events, parse_relations
        from rmm.prompts.compass_render import (
            EVENTS_SCHEMA,
            RELATIONS_SCHEMA,
            events_messages,
            relations_messages,
            session_turn_ids,
        )

        ids = session_turn_ids(session)
        got = self._ask({0: events_messages(session)}, lambda r: parse_events(r, ids), EVENTS_SCHEMA, report, "events")
        if 0 not in got:
            log.warning("session %s: event extraction unusable after %d tries; using the non-LLM fallback",
                        session.id, self.config.retries + 1)
            (plan,) = self._fallback_plans([session])
            return plan
        events = got[0]
        drafts = [_Draft(e.summary, e.refs, e.participants, e.time) for e in events]
        if len(events) < 2:
            return _Plan(drafts, [], True)
        labels = [e.label for e in events]
        shown = [(e.label, e.summary, e.refs) for e in events]
        rel = self._ask({0: relations_messages(session, shown)}, lambda r: parse_relations(r, labels, ids),
                        RELATIONS_SCHEMA, report, "relations")
        if 0 not in rel:
            report.relation_failures += 1
            log.warning("session %s: relation extraction unusable; linking its events by %r", session.id, NEXT)
            return _Plan(drafts, _next_edges(drafts), True)
        return _Plan(drafts, [(r.source, r.target, r.label, r.evidence) for r in rel[0]], True)

    # ---- the fallback -------------------------------------------------------------------------------
    def _fallback_plans(self, sessions: Sequence[Session]) -> list[_Plan]:
        """Segments as events (every speaker's turns), `next` edges: the turns of all sessions encoded
        in one call, then every event in one more (encoding is nearly all the fallback's time)."""
        plans = []
        for segments in self.segmenter.segments_many(sessions):
            drafts = [_Draft("\n".join(turn_line(t) for t in seg), [t.id for t in seg], _speakers(seg), None, True)
                      for seg in segments]
            plans.append(_Plan(drafts, _next_edges(drafts), False))
        vectors = self._encode([d.summary for plan in plans for d in plan.drafts])
        offset = 0
        for plan in plans:
            plan.vectors = vectors[offset:offset + len(plan.drafts)]
            offset += len(plan.drafts)
        return plans

    # ---- topics ---------------------------------------------------------------------------------------
    def _topics(self, state: _State, ids: list[str], vectors: torch.Tensor, new_ids: list[str],
                texts: dict[str, str], report: BuildReport) -> tuple[list[Topic], int, dict[str, list[str]]]:
        """The topic rows this session writes, the generation after it and its memberships."""
        session_number = len(state.sessions) + 1
        recluster = not state.topics or session_number % self.config.recluster_every == 0
        if recluster and len(ids):
            generation = state.generation + 1
            k = n_topics(len(ids), self.config.topic_divisor, self.config.max_topics)
            assign = kmeans(vectors, k, seed=self.config.seed)
            members = {f"g{generation:03d}-t{j:03d}": [ids[i] for i in range(len(ids)) if int(assign[i]) == j]
                       for j in range(int(assign.max()) + 1)}
            members = {t: m for t, m in members.items() if m}
            if state.topics:
                report.reclusterings += 1
            written = [Topic(t, _topic_summary(m, ids, vectors, texts), tuple(m)) for t, m in members.items()]
            return written, generation, members
        members = {t: list(m) for t, m in state.topics.items()}
        row = {memory_id: i for i, memory_id in enumerate(ids)}
        centroids = {t: F.normalize(vectors[[row[i] for i in m]].mean(0), dim=0) for t, m in members.items()}
        changed: dict[str, list[str]] = {}
        for memory_id in new_ids:
            v = vectors[row[memory_id]]
            best = max(centroids, key=lambda t: float(v @ centroids[t])) if centroids else None
            if best is not None and float(v @ centroids[best]) >= self.thresholds.topic:
                topic = best
            else:
                numbers = [int(m.group(2)) for t in members if (m := _TOPIC_ID.fullmatch(t))]
                topic = f"g{max(state.generation, 1):03d}-t{max(numbers, default=-1) + 1:03d}"
                members[topic] = []
            members[topic].append(memory_id)
            changed.setdefault(topic, []).append(memory_id)
            centroids[topic] = F.normalize(vectors[[row[i] for i in members[topic]]].mean(0), dim=0)
        written = [Topic(t, _topic_summary(members[t], ids, vectors, texts) if t not in state.topics else "",
                         tuple(m)) for t, m in changed.items()]
        return written, max(state.generation, 1), members

    # ---- state ------------------------------------------------------------------------------------------
    def _load(self, user: str) -> _State:
        store = self.bank.store
        state = _State()
        if not store.has_user(user):
            return state
        events = [m for m in store.memories(user) if m.kind == "event"]
        if events:
            ids, vectors = store.embeddings(user, [m.id for m in events])
            state.ids, state.vectors = list(ids), F.normalize(torch.as_tensor(vectors).float(), dim=-1)
            state.memories = {m.id: m for m in events}
            state.participants = store.participants(user, state.ids)
        topics = current_topics(store, user)
        state.topics = {t.id: list(t.members) for t in topics}
        state.generation = max((int(m.group(1)) for t in topics if (m := _TOPIC_ID.fullmatch(t.id))), default=0)
        raw = store.get_meta(_META + user)
        state.sessions = list(json.loads(raw).get("sessions", [])) if raw else []
        return state

    def _encode(self, texts: list[str]) -> torch.Tensor:
        """Passage vectors as the encoder gives them (what the bank stores; cosines normalise them)."""
        if not texts:
            return torch.zeros(0, self.dim)
        return torch.as_tensor(self.bank.encoder.encode_passages(texts)).detach().float().cpu()


def build_event_graph(bank: MemoryBank, user: str, sessions: Sequence[Session], llm: LLM | None = None,
                      config: EventGraphConfig | None = None) -> BuildReport:
    """Add `sessions` (in dialogue order) to `user`'s event graph in `bank` and report what was done.

    Events are kind ``event`` memories of `bank` (searchable like any memory), edges and topics the
    graph rows of `rmm.memory.graph`, each session written in one `store.add_events` transaction.
    `llm=None` builds the labelled non-LLM fallback graph. Incremental: sessions recorded as built
    are skipped and new ones fused into the stored graph. Unusable LLM output is retried once, then
    the session (or the decision) falls back, counted in the report; nothing stored is lost.
    """
    return EventGraphBuilder(bank, llm, config).build(user, sessions)


# ---------------------------------------------------------------------------------- helpers
def _session_time(session: Session) -> str:
    """An event needs an explicit time: the session's, else its first timed turn's, else the session itself."""
    return session.time or next((t.time for t in session.turns if t.time), None) or f"session {session.id}"


def _speakers(turns: Sequence[Turn]) -> list[str]:
    return list(dict.fromkeys(t.speaker for t in turns if t.speaker))[:MAX_PARTICIPANTS]


def _next_edges(drafts: list[_Draft]) -> list[tuple[int, int, str, tuple[str, ...]]]:
    """Consecutive events of a session, evidenced by the turns on either side of their boundary."""
    return [(i, i + 1, NEXT, tuple(dict.fromkeys((drafts[i].refs[-1], drafts[i + 1].refs[0]))))
            for i in range(len(drafts) - 1)]


def _pool(edges: list[Edge]) -> list[Edge]:
    """One edge per (source, target, label), evidence pooled in order."""
    pooled: dict[tuple[str, str, str], list[str]] = {}
    for e in edges:
        pooled.setdefault((e.source, e.target, e.label), []).extend(e.evidence)
    return [Edge(s, t, lab, tuple(dict.fromkeys(ev))) for (s, t, lab), ev in pooled.items()]


def _topic_summary(members: list[str], ids: list[str], vectors: torch.Tensor, texts: dict[str, str]) -> str:
    """The topic's medoid event (nearest its centroid), first line, shortened: a readable name."""
    row = {memory_id: i for i, memory_id in enumerate(ids)}
    sub = vectors[[row[m] for m in members]]
    medoid = members[int((sub @ F.normalize(sub.mean(0), dim=0)).argmax())]
    line = next((ln for ln in texts.get(medoid, "").splitlines() if ln.strip()), "")
    return line[:_MAX_TOPIC_SUMMARY]


def _event_text(draft: _Draft, when: str) -> str:
    if draft.time and draft.time.strip().lower() != when.strip().lower():
        return f"{draft.summary} [time: {draft.time}]"
    return draft.summary


def _event_memory(user: str, draft: _Draft, when: str, turns: dict[str, Turn]) -> Memory:
    source = FALLBACK_LABEL if draft.extractive else "\n".join(turn_line(turns[r]) for r in draft.refs if r in turns)
    return Memory(id=Memory.new_id(), user_id=user, kind="event", text=_event_text(draft, when),
                  refs=list(dict.fromkeys(draft.refs)), source_text=source, time_span=(when, when))


def _merged(target: Memory, draft: _Draft, when: str, turns: dict[str, Turn]) -> Memory:
    """`target` with `draft` folded in: text appended, refs united, lineage, span widened forward."""
    start, end = target.time_span or (None, None)
    new_refs = [r for r in draft.refs if r not in target.refs]
    source = target.source_text
    if not draft.extractive:
        source = "\n".join(s for s in (source, *(turn_line(turns[r]) for r in new_refs if r in turns)) if s)
    return replace(target, text=f"{target.text}\n{_event_text(draft, when)}",
                   refs=list(dict.fromkeys([*target.refs, *draft.refs])), source_text=source,
                   merged_from=[*target.merged_from, Memory.new_id()], time_span=(start or when, when or end))


# ---------------------------------------------------------------------------------- calibration
@dataclass
class Calibration:
    """Calibrated thresholds and what they came from (for the record beside `CALIBRATED`)."""

    thresholds: Thresholds
    users: list[str]
    quantiles: dict[str, float]
    samples: dict[str, int]
    distributions: dict[str, dict[str, float]]

    def to_json(self) -> dict[str, Any]:
        t = self.thresholds
        return {"merge": t.merge, "topic": t.topic, "similar": t.similar, "source": t.source, "users": self.users,
                "quantiles": self.quantiles, "samples": self.samples, "distributions": self.distributions}


def calibrate_thresholds(dataset: Dataset, users: Sequence[str], encoder: Any, *,
                         segmenter: SegmenterConfig | None = None,
                         quantiles: dict[str, float] | None = None, seed: int = 0,
                         topic_divisor: int = 5, max_topics: int = 50) -> Calibration:
    """Thresholds for `encoder` by quantile (`CALIBRATION_QUANTILES`) over the fallback events of
    `users` — pass training users only (the caller holds the others out; nothing of a user not
    named is read). `merge` / `similar`: each event's nearest event of an earlier session;
    `topic`: each event's cosine to its own k-means centroid at the paper's cluster count."""
    quantiles = dict(CALIBRATION_QUANTILES if quantiles is None else quantiles)
    missing = sorted(set(CALIBRATION_QUANTILES) - set(quantiles))
    if missing:
        raise ValueError(f"quantiles need {missing}")
    unknown = [u for u in users if u not in dataset.sessions]
    if unknown or not users:
        raise ValueError(f"calibration needs users of {dataset.name}; unknown: {unknown[:5]}" if unknown
                         else "calibration needs at least one user")
    splitter = TopicSegmenter(encoder, segmenter or SegmenterConfig())
    nearest: list[float] = []
    own: list[float] = []
    for user in users:
        sessions = [s for s in dataset.sessions[user] if s.turns]
        segmented = splitter.segments_many(sessions)
        texts = ["\n".join(turn_line(t) for t in seg) for segs in segmented for seg in segs]
        if not texts:
            continue
        vectors = F.normalize(torch.as_tensor(encoder.encode_passages(texts)).float(), dim=-1)
        session_of = torch.tensor([i for i, segs in enumerate(segmented) for _ in segs])
        sims = vectors @ vectors.T
        for row in range(len(texts)):
            earlier = session_of < session_of[row]
            if bool(earlier.any()):
                nearest.append(float(sims[row][earlier].max()))
        if len(texts) >= 2:
            assign = kmeans(vectors, n_topics(len(texts), topic_divisor, max_topics), seed=seed)
            for j in range(int(assign.max()) + 1):
                members = vectors[assign == j]
                centre = F.normalize(members.mean(0), dim=0)
                own.extend((members @ centre).tolist())
    if not nearest or not own:
        raise ValueError("too few events to calibrate: the users need two or more sessions with turns")
    near, cent = torch.tensor(nearest), torch.tensor(own)

    def q(values: torch.Tensor, p: float) -> float:
        return round(float(torch.quantile(values, p)), 4)

    thresholds = Thresholds(
        merge=q(near, quantiles["merge"]), topic=q(cent, quantiles["topic"]), similar=q(near, quantiles["similar"]),
        source=(f"calibrated for {getattr(encoder, 'name', 'encoder')} on {dataset.name} users "
                f"{', '.join(users)}: merge = q{quantiles['merge']:g}, similar = q{quantiles['similar']:g} of the "
                f"nearest earlier-session event's cosine; delta = q{quantiles['topic']:g} of the cosine to the own "
                "k-means centroid"))
    spread = {name: {"p05": q(v, 0.05), "p50": q(v, 0.5), "p95": q(v, 0.95), "max": round(float(v.max()), 4)}
              for name, v in (("nearest_earlier_event", near), ("own_centroid", cent))}
    return Calibration(thresholds, list(users), quantiles, {"nearest_earlier_event": len(nearest),
                                                            "own_centroid": len(own)}, spread)
