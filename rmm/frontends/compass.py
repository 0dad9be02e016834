"""CompassMem's graph-guided search (paper §4.3, prompts App. F.2) as a controller over an `Agent`,
with the agent's reranker inside the search.

    planner → 2-5 sub-goals (Eq. 7)
    localization: the first stage's pool of `pool` events for the query, diversified over the first
        `topics` distinct topics in the pool's (first-stage) order; the reranker's Gumbel top-M of it
        (M = `start_k`) is the slate; the LLM picks start nodes from it (Ψ_start)
    explorers: pop a global priority queue, priority p(u) = max over unsatisfied sub-goals of the
        cosine between the node's and the sub-goal's vectors (Eq. 11); up to `explorers` nodes a
        batch, their decisions in one `generate` call; each is SKIP / EXPAND / ANSWER with ≤ 3 next
        nodes among the neighbours shown and the sub-goals now satisfied (Eq. 9-10)
    refinement: when the queue empties with sub-goals open, one refined query (Eq. 8) and a second
        localization (`refinements` rounds, paper: 1)
    responder: the answer from the kept nodes (the first slate when none was kept), citing them.

The reranker inside the search (our addition): the localization slate is a Gumbel top-M over the
pool, and where a node has more than M (`slate`) unvisited neighbours the explorer is shown a
Gumbel top-M of them, visited and queued ones masked before the draw (the reranker's `exclude`,
so the recorded log-probabilities are over the candidates left). A shown node gets +1 when an
explorer keeps it or the responder cites it, −1 otherwise; each sampled slate goes to the agent's
learner with the behaviour log-probabilities recorded when it was drawn. What is not sampled is not
learned from: the queue's order (greedy), a node with ≤ M unvisited neighbours (all shown), and
every slate when the agent does not learn (greedy top-M).

Policies: `llm` (the paper's agents); `heuristic` (no LLM, below; kept says nothing about
usefulness there, so only the responder's citations reward it);
`oracle` (keeps exactly the visited nodes that hold a gold turn and queues every shown neighbour:
the ceiling of the graph reachable from the slate within the budget; needs the question's gold
turn ids, `respond(..., gold=...)`).

The heuristic walk (every value chosen on LoCoMo's training conversations, `rmm.bench.compass
--users train`): the question is the one sub-goal. A node's walk score is the reranker's score for
the query plus `opener` when the node opens its session (no incoming `next` edge), 0 by default:
LoCoMo's session openers carry the "since we last talked" news its multi-hop questions gather (28 %
of their gold events, 12.5 % of all events), a prior of that benchmark's shape, not of memory, so it
is an option, not the default; its priority adds `lookahead` × the best walk score among its
neighbours (what expanding it reaches: a node inside a relevant stretch of conversation beats an
isolated look-alike). The localization slate
is the reranker's top-`start_k` of the pool (20; not diversified over topics: `topics` = the pool),
the `seeds` best of its nodes whose walk score clears `threshold` start the walk; the queue pops by
priority, a node is kept and its neighbours queued while its walk score clears `threshold`, within
`node_budget` kept nodes and `max_steps` visits. The kept nodes are then ordered for the responder
(and cut at a turn budget by the benchmarks) by maximal marginal relevance: priority − `diversity` ×
the highest cosine to a node already placed (`diversity=None`: the order kept). `lookahead=0,
opener=0, diversity=None, seeds=start_k=topics=5` is the walk as first written (reranker score
alone, keep order).

Malformed LLM output never crashes a question: an unreadable plan is asked once more, then the
question is its own sub-goal; an unreadable start selection or explorer decision is asked once
more (the explorers' retries batched in one call), then falls back (the slate's best nodes; SKIP
with no next node); an unreadable refinement falls back to the question with the open sub-goals;
an unreadable citation gives no reward from the answer. Each error is in the trace.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

from rmm.errors import RmmError
from rmm.frontends.compass_trace import CompassTrace, LocalizationRecord, SlateRecord, StepRecord
from rmm.frontends.rewards import reward_selections
from rmm.frontends.trace import LLMCall
from rmm.memory.graph import Edge
from rmm.policy.citations import parse_citations
from rmm.policy.retrieve import reranked
from rmm.prompts.compass_search_parse import (
    ExplorerStep,
    parse_action,
    parse_node_choice,
    parse_refinement,
    parse_subgoals,
)
from rmm.prompts.compass_search_render import (
    NeighbourView,
    NodeView,
    action_messages,
    compass_answer_messages,
    plan_messages,
    refine_messages,
    start_messages,
)
from rmm.prompts.parse import PromptParseError
from rmm.reflection.events import NEXT, current_topics
from rmm.types import Candidates, Memory, Selection, Turn

if TYPE_CHECKING:
    from rmm.frontends.agent import Agent
    from rmm.types import Message

__all__ = ["POLICIES", "CompassConfig", "CompassFrontend", "CompassFrontendError", "CompassResponse"]

log = logging.getLogger(__name__)

UNKNOWN = "I don't know."
Policy = Literal["llm", "heuristic", "oracle"]
POLICIES: tuple[str, ...] = ("llm", "heuristic", "oracle")
PAPER_START_K, PAPER_TOPICS = 5, 5  # the paper's k and p (the llm and oracle policies' defaults)
HEURISTIC_START_K = 20  # the heuristic's slate (its `seeds` best start the walk; training conversations)


class CompassFrontendError(RmmError, ValueError):
    """The CompassMem front end cannot run with what it was given (an LLM that cannot write text, no gold for the oracle)."""


@dataclass
class CompassConfig:
    policy: str = "llm"  # llm | heuristic | oracle (module docstring)
    pool: int = 50  # first-stage events per localization (paper: 50)
    start_k: int | None = None  # k: the localization slate, the reranker's M over the pool (paper: 5; heuristic: 20)
    topics: int | None = None  # p: the first distinct topics the pool is diversified over (paper: 5; heuristic: pool)
    slate: int = 5  # M: neighbours shown per node; a Gumbel top-M when more are unvisited
    explorers: int = 3  # nodes decided per batch, one generate call (paper: 3)
    max_steps: int = 24  # node visits (explorer decisions) per question
    node_budget: int = 15  # kept nodes per question
    refinements: int = 1  # refinement rounds (paper: 1)
    threshold: float = 0.3  # heuristic: keep and expand while a node's walk score clears it
    seeds: int = 10  # heuristic: start nodes, the best of the slate by priority (module docstring)
    lookahead: float = 0.3  # heuristic: priority = walk score + lookahead × the best neighbour's walk score
    opener: float = 0.0  # heuristic: walk score = the reranker's score + opener for a session-opening event
    diversity: float | None = 0.2  # heuristic: MMR weight ordering the kept nodes; None: the order kept
    retries: int = 1  # one more ask for an unreadable reply before falling back
    answer: bool = True  # False: search only (retrieval evaluation), no responder call
    plan_tokens: int = 160
    start_tokens: int = 160
    action_tokens: int = 200
    refine_tokens: int = 96
    answer_tokens: int = 96

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {list(POLICIES)}, got {self.policy!r}")
        heuristic = self.policy == "heuristic"
        pool = self.pool if isinstance(self.pool, int) else 0
        if self.start_k is None:  # the policy's default (the heuristic's chosen on the training conversations)
            self.start_k = min(HEURISTIC_START_K, pool) if heuristic else PAPER_START_K
        if self.topics is None:
            self.topics = max(pool, 1) if heuristic else PAPER_TOPICS
        for name in ("pool", "start_k", "topics", "slate", "explorers", "max_steps", "node_budget", "seeds",
                     "plan_tokens", "start_tokens", "action_tokens", "refine_tokens", "answer_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name in ("refinements", "retries"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if self.start_k > self.pool:
            raise ValueError(f"cannot show start_k={self.start_k} nodes out of a pool of {self.pool}")
        if not isinstance(self.threshold, (int, float)) or self.threshold != self.threshold:
            raise ValueError(f"threshold must be a number, got {self.threshold!r}")
        for name in ("lookahead", "opener", "diversity"):
            value = getattr(self, name)
            if value is None and name == "diversity":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")

    @property
    def uses_llm(self) -> bool:
        """Whether the search itself calls the LLM (the responder does under every policy when `answer`)."""
        return self.policy == "llm"


@dataclass
class CompassResponse:
    answer: str
    cited: list[Memory]  # the evidence nodes the answer cites
    shown: list[Memory]  # the evidence the responder saw (kept nodes, or the first slate)
    trace: CompassTrace
    selections: list[Selection]  # the sampled slates, in the order drawn


@dataclass
class _Queued:
    node: str
    path_length: int


@dataclass
class _Question:
    user: str
    query: str  # the current query (the refined one after a refinement)
    history: list[Turn]
    trace: CompassTrace
    gold: frozenset[str] | None
    memories: dict[str, Memory] = field(default_factory=dict)
    vectors: dict[str, torch.Tensor] = field(default_factory=dict)  # passage vectors, unit length
    handles: list[str] = field(default_factory=list)  # handle n = handles[n - 1]
    topic_of: dict[str, str] = field(default_factory=dict)
    subgoal_vectors: torch.Tensor | None = None
    query_vector: torch.Tensor | None = None  # the current query's embedding as the first stage gave it
    satisfied: list[bool] = field(default_factory=list)
    pool_scores: dict[str, float] = field(default_factory=dict)  # the reranker's scores of the pools' candidates
    edges: dict[str, list[Edge]] = field(default_factory=dict)  # each node's edges (both directions), read once
    walk_priorities: dict[str, float] = field(default_factory=dict)  # the heuristic's, for the current query
    queue: dict[str, _Queued] = field(default_factory=dict)
    visited: set[str] = field(default_factory=set)
    kept: list[str] = field(default_factory=list)
    first_slate: list[str] = field(default_factory=list)
    selections: list[tuple[Selection, SlateRecord]] = field(default_factory=list)
    readable: bool = False  # some explorer decision (or start selection) was read
    answer_read: bool = False
    stopped: str = ""  # why exploration ended early (budget, all satisfied)

    def handle(self, memory_id: str) -> int:
        if memory_id not in self.handles:
            self.handles.append(memory_id)
        return self.handles.index(memory_id) + 1


class CompassFrontend:
    """CompassMem's search over an `Agent`: its bank (events and their graph), reranker/learner, sessions, LLM."""

    def __init__(self, agent: Agent, config: CompassConfig | None = None) -> None:
        self.agent, self.config = agent, config or CompassConfig()
        if self.config.uses_llm and agent.llm.name.startswith("simulated"):
            raise CompassFrontendError("the CompassMem front end's llm policy needs an LLM that writes text (hf:PATH, "
                                       "openai:URL@MODEL, vllm:PATH); the simulated LLM cannot plan sub-goals or "
                                       "choose graph actions (--policy heuristic or oracle need none)")

    # ---- one question ---------------------------------------------------------------------------
    def respond(self, user: str, query: str, *, remember: bool = True,
                gold: Collection[str] | None = None) -> CompassResponse:
        """Answer `query` by searching the user's event graph; learn from what was kept and cited.
        `gold`: the question's gold turn ids (the oracle policy needs them; others ignore them)."""
        if not isinstance(query, str) or not query.strip():
            raise ValueError("the message to answer must be a non-empty string")
        config = self.config
        if config.policy == "oracle" and gold is None:
            raise CompassFrontendError("the oracle policy keeps the nodes that hold gold turns: give the question's "
                                       "gold turn ids (respond(..., gold=...))")
        started = time.perf_counter()
        q = _Question(user, query, self.agent.sessions.current(user).turns,
                      CompassTrace(question=query, user=user, policy=config.policy),
                      None if gold is None else frozenset(gold))
        if self.agent.bank.store.has_user(user):
            self._search(q)
        else:
            q.trace.outcome, q.trace.stop_reason = "no-memories", "the user has no memories"
        evidence = q.kept or q.first_slate
        q.trace.fallback = not q.kept and bool(evidence)
        answer, cited = self._answer(q, evidence)
        self._learn(q, cited)
        if remember:
            from rmm.frontends.agent import ASSISTANT

            self.agent.sessions.append(user, [(user, query), (ASSISTANT, answer)])
        self.agent.checkpoint_if_due(user)
        trace = q.trace
        trace.answer, trace.cited, trace.kept, trace.retrieved = answer, cited, list(q.kept), list(evidence)
        trace.satisfied = list(q.satisfied)
        trace.memories = {i: m.text for i, m in q.memories.items()}
        trace.seconds = time.perf_counter() - started
        return CompassResponse(answer=answer, cited=[q.memories[i] for i in cited],
                               shown=[q.memories[i] for i in evidence], trace=trace,
                               selections=[s for s, _ in q.selections])

    # ---- the search -----------------------------------------------------------------------------
    def _search(self, q: _Question) -> None:
        config = self.config
        q.topic_of = self._topics(q.user)
        self._plan(q)
        rounds = config.refinements if config.uses_llm else 0
        for round_ in range(rounds + 1):
            if round_ > 0:
                self._refine(q)
            self._localize(q, round_)
            self._explore(q)
            if all(q.satisfied) or q.stopped:
                break
        if config.policy == "heuristic" and config.diversity is not None:
            q.kept = self._diversified(q, q.kept)
        trace = q.trace
        if all(q.satisfied):
            trace.outcome, trace.stop_reason = "satisfied", "every sub-goal is satisfied"
        elif q.stopped:
            trace.outcome, trace.stop_reason = "budget", q.stopped
        else:
            trace.outcome = "exhausted"
            trace.stop_reason = "the queue emptied with sub-goals open" + (" after the refinement" if rounds else "")

    def _topics(self, user: str) -> dict[str, str]:
        """node → topic in the newest topic generation (`current_topics`; the first topic a node is in);
        empty when the store has no topic layer."""
        if getattr(self.agent.bank.store, "topics", None) is None:
            return {}
        out: dict[str, str] = {}
        for topic in current_topics(self.agent.bank.store, user):
            for member in topic.members:
                out.setdefault(member, topic.id)
        return out

    def _plan(self, q: _Question) -> None:
        """Eq. 7: the sub-goals (the question itself under the heuristic and oracle policies)."""
        subgoals = [q.query]
        if self.config.uses_llm:
            def read(raw: str) -> list[str]:
                return parse_subgoals(raw).subgoals

            plan, error = self._ask(q, "plan", [plan_messages(q.query)], self.config.plan_tokens, [read])
            if plan[0] is not None:
                subgoals = plan[0]
            q.trace.plan_error = error[0]
        q.trace.subgoals = list(subgoals)
        q.satisfied = [False] * len(subgoals)
        q.subgoal_vectors = _unit(self.agent.bank.encoder.encode_queries(list(subgoals)).float())

    def _refine(self, q: _Question) -> None:
        """Eq. 8: a refined query aimed at the open sub-goals (fallback: the question with them)."""
        subgoals = q.trace.subgoals
        messages = refine_messages(q.trace.question, subgoals, q.satisfied, [self._view(q, i) for i in q.kept])
        (refined,), (error,) = self._ask(q, "refine", [messages], self.config.refine_tokens,
                                         [lambda raw: parse_refinement(raw, len(subgoals)).query])
        if refined is None:
            refined = " ".join([q.trace.question, *(s for s, done in zip(subgoals, q.satisfied) if not done)])
        q.query, q.trace.refined_query, q.trace.refine_error = refined, refined, error

    # ---- localization -----------------------------------------------------------------------------
    def _localize(self, q: _Question, round_: int) -> None:
        """The pool, diversified over the first p topics, the reranker's slate of it, the start nodes."""
        config = self.config
        retriever = self.agent.retriever(q.user, k=config.pool, m=config.start_k)
        (pool,) = retriever.candidates([q.query], q.user, config.pool)
        q.query_vector = pool.query_embedding
        if len(pool):  # the full score (lexical and candidate features too) where the first stage gave them
            scored = reranked(self.agent.learner(q.user).reranker, pool)
            q.pool_scores = dict(zip(scored.memory_ids, scored.retriever_scores.tolist()))
        q.walk_priorities.clear()  # they were for the previous query's scores
        record = LocalizationRecord(round=round_, query=q.query, pool=len(pool), topics=0)
        q.trace.localizations.append(record)
        if len(pool) == 0:
            return
        masked = set(q.visited) | set(q.queue)
        if q.topic_of:  # the first p distinct topics in the pool's first-stage order (θ-independent)
            first: list[str] = []
            for memory_id in pool.memory_ids:
                topic = q.topic_of.get(memory_id, f"node:{memory_id}")
                if topic not in first and memory_id not in masked:
                    first.append(topic)
            first = first[: config.topics]
            record.topics = len(first)
            masked |= {i for i in pool.memory_ids if q.topic_of.get(i, f"node:{i}") not in first}
        slate_ids, record.slate = self._slate(q, pool, masked, config.start_k, "start")
        if round_ == 0:
            q.first_slate = list(slate_ids)
        if not slate_ids:
            return
        self._load(q, slate_ids)
        start = self._start_nodes(q, record, slate_ids)
        record.start = start
        for memory_id in start:
            q.queue.setdefault(memory_id, _Queued(memory_id, 1))
        q.trace.max_queue = max(q.trace.max_queue, len(q.queue))

    def _slate(self, q: _Question, candidates: Candidates, masked: Collection[str], m: int,
               kind: str, node: str = "") -> tuple[list[str], SlateRecord]:
        """The reranker's top-M of the candidates not masked: Gumbel-sampled (and kept for the learner)
        when the agent learns and more than M are left, else all of them / the greedy top-M."""
        masked = {i for i in candidates.memory_ids if i in masked}
        left = len(candidates) - len(masked)
        learner = self.agent.learner(q.user)
        sampled = self.agent.learn and left > m
        (selection,) = learner.reranker.select([candidates], m, tau=self.agent.tau, explore=sampled,
                                               generator=self.agent.generator,
                                               exclude=[masked] if masked else None)
        ids = selection.memory_ids
        record = SlateRecord(kind=kind, query=q.query, memory_ids=list(ids), candidates=left, sampled=sampled,
                             node=node)
        if sampled and selection.chosen:
            q.selections.append((selection, record))
        return list(ids), record

    def _start_nodes(self, q: _Question, record: LocalizationRecord, slate: list[str]) -> list[str]:
        """Ψ_start: the LLM's pick among the slate (≤ start_k); the heuristic's nodes over the threshold;
        the oracle's whole slate."""
        config = self.config
        if config.policy == "oracle":
            return list(slate)
        if config.policy == "heuristic":
            scores = self._walk_scores(q, slate)
            clear = [i for i in slate if scores[i] >= config.threshold]
            priorities = self._priorities(q, clear)
            return sorted(clear, key=lambda i: -priorities[i])[: config.seeds]
        groups: dict[str, list[NodeView]] = {}
        cosines = self._cosines(q, slate)
        for memory_id in slate:
            view = self._view(q, memory_id, score=cosines[memory_id])
            groups.setdefault(q.topic_of.get(memory_id, f"node:{memory_id}"), []).append(view)
        shown = {q.handle(i) for i in slate}
        messages = start_messages(q.query, q.trace.subgoals, list(groups.items()), config.start_k)
        (handles,), (error,) = self._ask(q, "start", [messages], config.start_tokens,
                                         [lambda raw: parse_node_choice(raw, shown, config.start_k).handles])
        record.error = error
        if handles is None:  # fallback: the slate's best nodes, one per explorer
            return slate[: config.explorers]
        q.readable = True
        return [q.handles[h - 1] for h in handles]

    # ---- exploration ------------------------------------------------------------------------------
    def _explore(self, q: _Question) -> None:
        """Pop the global queue, a batch of explorers at a time, until it empties, every sub-goal is
        satisfied or a budget is spent."""
        config = self.config
        batch = 0
        while q.queue and not all(q.satisfied):
            if len(q.trace.steps) >= config.max_steps:
                q.stopped = f"step budget max_steps={config.max_steps} spent"
                return
            if len(q.kept) >= config.node_budget:
                q.stopped = f"node budget node_budget={config.node_budget} kept"
                return
            batch += 1
            width = config.explorers if config.uses_llm else 1
            width = min(width, config.max_steps - len(q.trace.steps))
            popped = [self._pop(q) for _ in range(min(width, len(q.queue)))]
            contexts = [self._context(q, item, priority) for item, priority in popped]
            decisions = self._decide(q, [item for item, _ in popped], contexts)
            for explorer, ((item, priority), (neighbours, slate), (decision, error)) in enumerate(
                    zip(popped, contexts, decisions), 1):
                self._step(q, batch, explorer, item, priority, neighbours, slate, decision, error)
            q.trace.max_queue = max(q.trace.max_queue, len(q.queue))

    def _pop(self, q: _Question) -> tuple[_Queued, float]:
        """The queued node of highest priority (recomputed: satisfied sub-goals drop out of Eq. 11)."""
        ids = list(q.queue)
        priorities = self._priorities(q, ids)
        best = max(ids, key=lambda i: (priorities[i], -ids.index(i)))
        item = q.queue.pop(best)
        q.visited.add(best)
        return item, priorities[best]

    def _context(self, q: _Question, item: _Queued, priority: float) -> tuple[list[NeighbourView], SlateRecord | None]:
        """The node's neighbours as shown to its explorer: all unvisited ones when ≤ M, else the
        reranker's Gumbel top-M of them with the visited and queued ones masked."""
        edges = self._edges(q, item.node)
        direction: dict[str, tuple[str, bool]] = {}
        for edge in edges:
            other, outgoing = edge.other(item.node), edge.source == item.node
            if other != item.node:
                direction.setdefault(other, (edge.label, outgoing))
        if not direction:
            return [], None
        ids = list(direction)
        masked = (q.visited | set(q.queue)) & set(ids)
        if len(ids) - len(masked) == 0:
            return [], None
        slate: SlateRecord | None = None
        if len(ids) - len(masked) > self.config.slate:
            self._load(q, ids)
            shown, slate = self._slate(q, self._candidates(q, ids), masked, self.config.slate, "neighbours",
                                       item.node)
        else:
            shown = [i for i in ids if i not in masked]
            self._load(q, shown)
        return [NeighbourView(self._view(q, i), *direction[i]) for i in shown], slate

    def _candidates(self, q: _Question, ids: list[str]) -> Candidates:
        """Neighbours as a candidate list for the reranker: stored vectors, scored against the current query."""
        query = q.query_vector
        vectors = self.agent.bank.embeddings(q.user, ids).float()
        if query is None:
            query = self.agent.bank.encoder.encode_queries([q.query])[0].float()
        return Candidates(query=q.query, memory_ids=list(ids), retriever_scores=vectors @ query.float(),
                          embeddings=vectors, query_embedding=query, user_id=q.user)

    def _decide(self, q: _Question, items: list[_Queued], contexts: list[tuple[list[NeighbourView], SlateRecord | None]]
                ) -> list[tuple[ExplorerStep, str | None]]:
        """Each popped node's decision: the LLM's (one batched call, one batched retry), or the policy's."""
        config = self.config
        if config.policy == "heuristic":
            out = []
            for item, (neighbours, _) in zip(items, contexts):
                keep = self._walk_scores(q, [item.node])[item.node] >= config.threshold
                nxt = [n.node.number for n in neighbours] if keep else []
                out.append((ExplorerStep("EXPAND" if keep else "SKIP", nxt, []), None))
            return out
        if config.policy == "oracle":
            out = []
            for item, (neighbours, _) in zip(items, contexts):
                keep = bool(q.gold & set(q.memories[item.node].refs))
                covered = set().union(*(q.memories[i].refs for i in [*q.kept, item.node] if i in q.memories)) & q.gold
                done = keep and covered >= q.gold
                action = "ANSWER" if done else ("EXPAND" if keep else "SKIP")
                out.append((ExplorerStep(action, [n.node.number for n in neighbours], [1] if done else []), None))
            return out
        kept = [self._view(q, i) for i in q.kept]
        batch = [action_messages(q.query, q.trace.subgoals, q.satisfied, kept, self._view(q, item.node), neighbours)
                 for item, (neighbours, _) in zip(items, contexts)]
        readers = [_action_reader({n.node.number for n in neighbours}, len(q.trace.subgoals))
                   for neighbours, _ in contexts]
        steps, errors = self._ask(q, "explore", batch, config.action_tokens, readers)
        out = []
        for step, error in zip(steps, errors):
            if step is None:
                out.append((ExplorerStep("SKIP", [], [], warnings=["unreadable: fell back to SKIP"]), error))
            else:
                q.readable = True
                out.append((step, error))
        return out

    def _step(self, q: _Question, batch: int, explorer: int, item: _Queued, priority: float,
              neighbours: list[NeighbourView], slate: SlateRecord | None, decision: ExplorerStep,
              error: str | None) -> None:
        """Apply one decision: keep the node (EXPAND / ANSWER), mark sub-goals, queue the next nodes."""
        node = item.node
        if decision.action != "SKIP" and node not in q.kept and len(q.kept) < self.config.node_budget:
            q.kept.append(node)
        for number in decision.satisfied:
            q.satisfied[number - 1] = True
        next_ids = [q.handles[n - 1] for n in decision.next_nodes]
        if decision.action != "ANSWER" or not self.config.uses_llm:  # ANSWER ends this explorer's path
            for memory_id in next_ids:
                if memory_id not in q.visited:
                    q.queue.setdefault(memory_id, _Queued(memory_id, item.path_length + 1))
        if decision.action == "ANSWER" and self.config.policy == "oracle":
            q.satisfied = [True] * len(q.satisfied)
        q.trace.steps.append(StepRecord(
            step=len(q.trace.steps) + 1, batch=batch, explorer=explorer, node=node, path_length=item.path_length,
            priority=float(priority), action=decision.action, next_nodes=next_ids, satisfied=list(decision.satisfied),
            neighbours=slate if slate is not None or not neighbours else SlateRecord(
                "neighbours", q.query, [v.node.memory.id for v in neighbours], len(neighbours), False, node),
            reasoning=decision.reasoning, error=error, warnings=list(decision.warnings)))

    # ---- the responder and learning ---------------------------------------------------------------
    def _answer(self, q: _Question, evidence: list[str]) -> tuple[str, list[str]]:
        """The responder: (answer, ids of the evidence nodes it cites)."""
        if not self.config.answer:
            return "", []
        self._load(q, evidence)
        memories = [q.memories[i] for i in evidence]
        raw = self._call(q, "answer", [compass_answer_messages(q.trace.question, memories, q.history)],
                         self.config.answer_tokens, shown=[memories])[0]
        citation = parse_citations(raw, len(memories))
        q.answer_read = citation.cited is not None or citation.no_cite
        if not q.answer_read:
            q.trace.calls[-1].error = "no parseable citation"
        q.trace.cited_evidence = list(citation.cited or [])
        cited = list(dict.fromkeys(evidence[i] for i in citation.cited or [] if 0 <= i < len(evidence)))
        return citation.answer.strip() or UNKNOWN, cited

    def _learn(self, q: _Question, cited: list[str]) -> None:
        """+1 per shown node kept or cited, −1 otherwise, for every sampled slate; nothing when nothing
        attributable was read (the heuristic's keeps are its own score: only citations count there)."""
        if not (self.agent.learn and q.selections):
            return
        policy = self.config.policy
        helped = set(cited) if policy == "heuristic" else set(q.kept) | set(cited)
        attributable = q.answer_read or (policy == "oracle") or (policy == "llm" and q.readable)
        reward_selections(self.agent.learner(q.user), q.selections, helped, attributable)

    # ---- helpers ----------------------------------------------------------------------------------
    def _load(self, q: _Question, ids: Sequence[str]) -> None:
        """Fetch the nodes (and their unit vectors) not read yet."""
        missing = [i for i in dict.fromkeys(ids) if i not in q.memories]
        if not missing:
            return
        for memory in self.agent.bank.get(q.user, missing):
            q.memories[memory.id] = memory
        vectors = _unit(self.agent.bank.embeddings(q.user, missing).float())
        q.vectors.update(zip(missing, vectors))

    def _view(self, q: _Question, memory_id: str, score: float | None = None) -> NodeView:
        self._load(q, [memory_id])
        participants = getattr(self.agent.bank.store, "participants", None)
        people = participants(q.user, [memory_id]).get(memory_id, ()) if participants is not None else ()
        return NodeView(q.handle(memory_id), q.memories[memory_id], people, score=score)

    def _cosines(self, q: _Question, ids: Sequence[str]) -> dict[str, float]:
        self._load(q, ids)
        query = _unit(q.query_vector.float()[None])[0] if q.query_vector is not None else None
        return {i: float(q.vectors[i] @ query) if query is not None else 0.0 for i in ids}

    def _scores(self, q: _Question, ids: Sequence[str]) -> dict[str, float]:
        """The reranker's deterministic scores of the nodes for the current query (the heuristic's ranking):
        as the current pool scored them (with its lexical and candidate features) for pool members, from
        the vectors alone (features absent, i.e. zero, as for a memory below the first stage's depth) else."""
        out = {i: q.pool_scores[i] for i in ids if i in q.pool_scores}
        rest = [i for i in dict.fromkeys(ids) if i not in out]
        if rest:
            candidates = self._candidates(q, rest)
            reranker = self.agent.learner(q.user).reranker
            scores = reranker.fast_scores(candidates.query_embedding[None].to(reranker.W_q.weight),
                                          candidates.embeddings[None].to(reranker.W_q.weight))[0]
            out.update(zip(rest, scores.tolist()))
        return out

    def _edges(self, q: _Question, memory_id: str) -> list[Edge]:
        """The node's edges in both directions (read once per question)."""
        if memory_id not in q.edges:
            q.edges[memory_id] = self.agent.bank.store.neighbours(q.user, memory_id, "both")
        return q.edges[memory_id]

    def _others(self, q: _Question, memory_id: str) -> list[str]:
        """The node's neighbours (either direction), each once, in edge order."""
        return list(dict.fromkeys(e.other(memory_id) for e in self._edges(q, memory_id) if e.source != e.target))

    def _walk_scores(self, q: _Question, ids: Sequence[str]) -> dict[str, float]:
        """The heuristic's node scores: the reranker's, plus `opener` for a node that opens its session
        (no incoming `next` edge)."""
        scores = self._scores(q, ids)
        bonus = self.config.opener
        if not bonus:
            return scores
        return {i: s + bonus * (not any(e.label == NEXT and e.target == i for e in self._edges(q, i)))
                for i, s in scores.items()}

    def _priorities(self, q: _Question, ids: list[str]) -> dict[str, float]:
        """Eq. 11 (max cosine to an unsatisfied sub-goal); the heuristic's: the walk score plus
        `lookahead` × the best walk score among the node's neighbours."""
        if self.config.policy == "heuristic":
            missing = [i for i in dict.fromkeys(ids) if i not in q.walk_priorities]
            if missing:
                own = self._walk_scores(q, missing)
                gamma = self.config.lookahead
                around = {i: self._others(q, i) for i in missing} if gamma else {}
                reached = self._walk_scores(q, list(dict.fromkeys(n for ns in around.values() for n in ns)))
                for i in missing:
                    best = max((reached[n] for n in around.get(i, ())), default=0.0)
                    q.walk_priorities[i] = own[i] + gamma * best
            return {i: q.walk_priorities[i] for i in ids}
        self._load(q, ids)
        open_ = [j for j, done in enumerate(q.satisfied) if not done] or list(range(len(q.satisfied)))
        goals = q.subgoal_vectors[open_]
        return {i: float((goals @ q.vectors[i]).max()) for i in ids}

    def _diversified(self, q: _Question, kept: list[str]) -> list[str]:
        """The kept nodes by maximal marginal relevance: each next is the best priority − `diversity` ×
        its highest cosine to a node already placed (ties: the order kept)."""
        if len(kept) < 2:
            return list(kept)
        self._load(q, kept)
        priorities = self._priorities(q, kept)
        vectors = torch.stack([q.vectors[i] for i in kept])
        cosines = vectors @ vectors.T
        left, placed = list(range(len(kept))), []
        while left:
            def value(j: int) -> float:
                nearest = max((float(cosines[j, p]) for p in placed), default=0.0)
                return priorities[kept[j]] - self.config.diversity * nearest  # type: ignore[operator]
            best = max(left, key=lambda j: (value(j), -j))
            left.remove(best)
            placed.append(best)
        return [kept[j] for j in placed]

    def _ask(self, q: _Question, step: str, batch: list[list[Message]], max_tokens: int,
             readers: Sequence[Any]) -> tuple[list[Any], list[str | None]]:
        """One batched call, read by `readers` (one per conversation); the unreadable ones asked again
        (`retries` times, batched). Returns (values or None, the last error of each or None)."""
        values: list[Any] = [None] * len(batch)
        errors: list[str | None] = [None] * len(batch)
        pending = list(range(len(batch)))
        for attempt in range(self.config.retries + 1):
            if not pending:
                break
            raws = self._call(q, step if attempt == 0 else f"{step}-retry", [batch[i] for i in pending], max_tokens)
            still = []
            for i, raw in zip(pending, raws):
                try:
                    values[i], errors[i] = readers[i](raw), None
                except PromptParseError as error:
                    errors[i] = str(error)
                    still.append(i)
            pending = still
        for i in pending:
            log.warning("compass %s: unreadable after %d tries: %s", step, self.config.retries + 1, errors[i])
        return values, errors

    def _call(self, q: _Question, step: str, batch: list[list[Message]], max_tokens: int,
              shown: list[list[Memory]] | None = None) -> list[str]:
        """One batched LLM call, recorded in the trace (tokens and seconds split evenly over its conversations);
        `shown` hands a simulated LLM the memories an answer may cite."""
        llm = self.agent.llm
        prompt_tokens, completion_tokens = llm.usage.prompt_tokens, llm.usage.completion_tokens
        started = time.perf_counter()
        raws = llm.generate(batch, max_tokens=max_tokens, shown=shown)
        n = len(batch)
        seconds = time.perf_counter() - started
        used_prompt = llm.usage.prompt_tokens - prompt_tokens
        used_completion = llm.usage.completion_tokens - completion_tokens
        for index, raw in enumerate(raws):
            q.trace.calls.append(LLMCall(step=step, breadth=index, depth=len(q.trace.steps),
                                         prompt_tokens=used_prompt // n + (index < used_prompt % n),
                                         completion_tokens=used_completion // n + (index < used_completion % n),
                                         seconds=seconds / n, output=raw))
        log.info("compass %s: %d conversations, %d+%d tokens, %.1fs", step, n, used_prompt, used_completion, seconds)
        return list(raws)


def _action_reader(shown: set[int], n_subgoals: int) -> Any:
    def read(raw: str) -> ExplorerStep:
        return parse_action(raw, shown, n_subgoals)
    return read


def _unit(vectors: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(vectors, dim=-1)
