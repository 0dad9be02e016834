"""Semantic XPath as a controller (Liu et al., `reference/papers/semantic-xpath.txt`; issue 30 item 6).

    question, Σ → LLM writes a query → parse (one retry with the parser's message) → template if
    still unreadable → execute over the user's tree → top-K leaves → reranker (Gumbel top-M) →
    answer with citations → rewards to the agent's learner

The tree is the bank's (`rmm.reflection.xpath_tree`): LoCoMo's native tree when one was built into
the bank, else `BankTree`'s ``User → Session → …``, which this controller keeps current — it attaches
to the agent's reflector (every reflected session updates the tree) and places, before each
question, whatever memory the tree does not show yet (`BankTree.sync`; a no-op when nothing moved).

Decisions where the paper is silent or this codebase needs one:

* **Prompt**: ours (`rmm/prompts/xpath_query.txt`): Σ with node counts and attributes, the grammar
  in a few lines, example queries built from this tree's own types, one worked exchange.
* **Fallbacks**: a reply without a query or a query the parser refuses gets one retry showing the
  parser's message (its column); a second failure, or a query that selects no memory (a type the
  tree does not have, a position past the end), runs the **template**
  ``//P[max(/L[node~Q])]/L[node~Q]`` — L the tree's most common memory-bearing type, P the type most
  of them sit under, Q the question — the best LLM-free query of the issue's figure. With
  ``query_policy="template"`` no LLM writes queries at all (an evaluation without a text LLM).
* **What the reranker sees** (issue 30 item 5): the top-K memories of the result (by XPath weight;
  a memory shown by several nodes counts once, at its best) become `Candidates` with their stored
  embeddings and the XPath weight as the candidate feature ``xpath_weight``. The controller asks the
  agent's learners for that feature (`LearnerRegistry.request_features`: appended to
  `LearnerConfig.extra_features`, after the hybrid first stage's features when those are on; a
  checkpoint saved without it gains it at 0), so the reranker weighs it from 0 like every candidate
  feature: an untrained reranker orders the K leaves by its own score — the encoder's cosine
  with the leaf's memory — and only *which* K leaves are candidates comes from the tree, until the
  feature's weight is learned from the citations. A learner the agent was given already built
  without it (`Agent(learner=...)`) keeps its terms, with a warning: there the weight is not learned. When the query's ranking is the leaves' own cosine (``//L[node~Q]``
  with the cosine scorer), the two orders are the same. A reranker weighing other features gets
  zeros in the others' columns (as a dense first stage's candidates do); one weighing none ignores it.
* **Learning**: the shown M are a Gumbel top-M sample (`agent.learn`) with the behaviour log-probs
  recorded at sampling time; the answer's citations are the rewards (+1 cited, −1 shown and not
  cited), recorded with the agent's learner (`reflect_citations`); a greedy selection (not
  learning) is never learned from.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch

from rmm.errors import RmmError
from rmm.frontends.xpath_trace import QueryAttempt, StepRecord, XPathTrace
from rmm.memory.tree import Schema, TreeNode, induce_schema
from rmm.memory.xpath_exec import Execution, Scorer, TreeView, ViewCache, execute
from rmm.memory.xpath_scorers import CosineScorer
from rmm.memory.xpath_syntax import Aggregate, AggregateFunction, Axis, Local, Query, QuerySyntaxError, Step, parse
from rmm.policy.xpath_scorer import RerankerScorer
from rmm.prompts.parse import PromptParseError
from rmm.prompts.xpath_query import example_queries, parse_query_reply, retry_messages, xpath_query_messages
from rmm.reflection import reflect_citations
from rmm.reflection.xpath_tree import BankTree
from rmm.types import Candidates, Memory, Selection

if TYPE_CHECKING:
    from rmm.frontends.agent import Agent
    from rmm.policy.reranker import ResidualLinearReranker
    from rmm.types import Message

__all__ = ["SCORERS", "XPATH_FEATURE", "XPathConfig", "XPathFrontend", "XPathFrontendError", "XPathResponse",
           "leaf_types", "template_query", "xpath_candidates"]

log = logging.getLogger(__name__)

XPATH_FEATURE = "xpath_weight"
SCORERS = ("cosine", "reranker")
POLICIES = ("llm", "template")
UNKNOWN = "I don't know."


class XPathFrontendError(RmmError, ValueError):
    """The Semantic XPath front end cannot run with what it was given."""


@dataclass
class XPathConfig:
    query_policy: Literal["llm", "template"] = "llm"  # who writes the query (template: no LLM)
    scorer: Literal["cosine", "reranker"] = "cosine"  # the local matches' scorer (rmm.memory.xpath_scorers)
    leaves: int = 10  # K: the result's best memories handed to the reranker
    m: int | None = None  # memories shown (None: the agent's M, at most `leaves`)
    retries: int = 1  # queries the parser's message is shown back for
    answer: bool = True  # False: query and select only (retrieval evaluation), no answer call
    query_tokens: int = 160
    steps_shown: int = 5  # best nodes per step in the trace

    def __post_init__(self) -> None:
        if self.query_policy not in POLICIES:
            raise ValueError(f"query_policy must be one of {POLICIES}, got {self.query_policy!r}")
        if self.scorer not in SCORERS:
            raise ValueError(f"scorer must be one of {SCORERS}, got {self.scorer!r}")
        for name in ("leaves", "query_tokens", "steps_shown"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if isinstance(self.retries, bool) or not isinstance(self.retries, int) or self.retries < 0:
            raise ValueError(f"retries must be an int >= 0, got {self.retries!r}")
        if self.m is not None and (isinstance(self.m, bool) or not isinstance(self.m, int) or not 1 <= self.m <= self.leaves):
            raise ValueError(f"m must be an int in [1, leaves={self.leaves}], got {self.m!r}")


@dataclass
class XPathResponse:
    answer: str
    cited: list[Memory]
    shown: list[Memory]
    selections: list[Selection]
    trace: XPathTrace


# -- the tree's shape and the template -------------------------------------------------------------
def leaf_types(nodes: list[TreeNode]) -> tuple[str, str | None] | None:
    """(L, P): the most common type of nodes showing a memory and the type most of them sit under
    (None: the root); None for a tree that shows no memory. Ties go to the first in tree order."""
    by_id = {n.id: n for n in nodes}
    counts = Counter(n.type for n in nodes if n.memory_id is not None)
    if not counts:
        return None
    leaf = counts.most_common(1)[0][0]
    parents = Counter(None if n.parent is None else by_id[n.parent].type
                      for n in nodes if n.type == leaf and n.memory_id is not None and (n.parent is None or n.parent in by_id))
    return leaf, parents.most_common(1)[0][0]


def template_query(question: str, leaf: str, parent: str | None) -> Query:
    """``//P[max(/L[node~Q])]/L[node~Q]`` (``//L[node~Q]`` when L sits under the root)."""
    text = " ".join(question.split()) or "?"
    match = Local(None, text)
    if parent is None:
        return Query((Step(Axis.DESCENDANT, leaf, None, match),))
    inner = Aggregate(AggregateFunction.MAX, Step(Axis.CHILD, leaf, None, match))
    return Query((Step(Axis.DESCENDANT, parent, None, inner), Step(Axis.CHILD, leaf, None, match)))


def xpath_candidates(execution: Execution, k: int, question: str, user: str, embeddings: torch.Tensor,
                     query_embedding: torch.Tensor, feature_names: tuple[str, ...]) -> Candidates:
    """The execution's best `k` memories as the reranker's candidates (module docstring): `embeddings`
    are theirs ([k', d], in `best_memories` order), the XPath weight their ``xpath_weight`` feature."""
    ids, weights = best_memories(execution, k)
    w = torch.tensor(weights, dtype=torch.float32)
    if XPATH_FEATURE in feature_names:
        features = torch.zeros(len(ids), len(feature_names))
        features[:, feature_names.index(XPATH_FEATURE)] = w
        names = tuple(feature_names)
    elif not feature_names:  # a reranker without features ignores it; the record keeps it
        features, names = w.reshape(-1, 1), (XPATH_FEATURE,)
    else:  # other features only: zeros for them (as a dense first stage's candidates)
        features, names = None, ()
    return Candidates(query=question, memory_ids=ids, retriever_scores=w, embeddings=embeddings,
                      query_embedding=query_embedding, user_id=user, features=features, feature_names=names)


def best_memories(execution: Execution, k: int) -> tuple[list[str], list[float]]:
    """The memories of the best nodes showing one, best first, each once at its best weight (≤ k)."""
    ids: list[str] = []
    weights: list[float] = []
    for j in execution.order():
        node = execution.view.nodes[int(execution.indices[j])]
        if node is not None and node.memory_id is not None and node.memory_id not in ids:
            ids.append(node.memory_id)
            weights.append(float(execution.weights[j]))
            if len(ids) >= k:
                break
    return ids, weights


# -- the controller ----------------------------------------------------------------------------------
class XPathFrontend:
    """Semantic XPath over an `Agent`: its bank (and the tree in it), reranker/learner, sessions and LLM."""

    def __init__(self, agent: Agent, config: XPathConfig | None = None, *, scorer: Scorer | None = None) -> None:
        self.agent, self.config = agent, config or XPathConfig()
        self.m = min(self.config.m or agent.m, self.config.leaves)
        if self.config.query_policy == "llm" and agent.llm.name.startswith("simulated"):
            raise XPathFrontendError("the Semantic XPath front end's llm policy needs an LLM that writes text "
                                     "(hf:PATH, openai:URL@MODEL, vllm:PATH); the simulated LLM cannot write queries "
                                     "(--query-policy template needs none)")
        lacking = agent.learners.request_features((XPATH_FEATURE,))  # learned from 0 (module docstring)
        agent.learner_config = agent.learners.config
        for key in lacking:
            log.warning("the reranker of %r was built without the %r feature: the XPath weight is not learned "
                        "there (build it with feature_names ending in %r)", key or "(shared)", XPATH_FEATURE,
                        XPATH_FEATURE)
        self._scorer = scorer
        self._cosine: CosineScorer | None = None
        self._scorers: dict[int, RerankerScorer] = {}
        self.tree = BankTree(agent.bank)
        self.tree.attach(agent.reflector)
        self._synced: dict[str, int] = {}  # user → store generation the tree was last synced at
        self.views = ViewCache(agent.bank.store)  # read and built again only when the user's generation moves

    def scorer(self, user: str) -> Scorer:
        """The local matches' scorer: given, or the config's over the agent's encoder (and reranker)."""
        if self._scorer is not None:
            return self._scorer
        if self.config.scorer == "reranker":  # one per reranker (per user with per-user rerankers): its query cache
            reranker = self.agent.learner(user).reranker
            scorer = self._scorers.get(id(reranker))
            if scorer is None or scorer.reranker is not reranker:
                scorer = self._scorers[id(reranker)] = RerankerScorer(reranker, self.agent.bank.encoder)
            return scorer
        if self._cosine is None:
            self._cosine = CosineScorer(self.agent.bank.encoder)
        return self._cosine

    # ---- one question ---------------------------------------------------------------------------
    def respond(self, user: str, query: str, *, remember: bool = True) -> XPathResponse:
        """Answer `query` from the memories an XPath query over the user's tree finds; learn from citations."""
        if not isinstance(query, str) or not query.strip():
            raise ValueError("the message to answer must be a non-empty string")
        started = time.perf_counter()
        agent = self.agent
        trace = XPathTrace(question=query, user=user, scorer=self._scorer_name())
        history = agent.sessions.current(user).turns
        selection: Selection | None = None
        shown: list[Memory] = []
        if agent.bank.store.has_user(user):
            self._sync(user)
            selection, shown = self._search(user, query, trace)
        else:
            trace.outcome, trace.stop_reason = "no-memories", "the user has no memories"
        answer, cited = self._answer(user, query, selection, shown, history, trace)
        if remember:
            from rmm.frontends.agent import ASSISTANT

            agent.sessions.append(user, [(user, query), (ASSISTANT, answer)])
        agent.checkpoint_if_due(user)
        trace.answer, trace.cited = answer, [m.id for m in cited]
        trace.retrieved = [m.id for m in shown]
        trace.memories = {m.id: m.text for m in shown}
        trace.seconds = time.perf_counter() - started
        return XPathResponse(answer, cited, shown, [selection] if selection is not None and selection.chosen else [],
                             trace)

    def _scorer_name(self) -> str:
        if self._scorer is not None:
            return str(getattr(self._scorer, "name", type(self._scorer).__name__))
        return self.config.scorer

    def _sync(self, user: str) -> None:
        generation = self.agent.bank.store.generation(user)
        if self._synced.get(user) != generation:
            self.tree.sync(user)
            self._synced[user] = self.agent.bank.store.generation(user)

    def query(self, user: str, question: str, trace: XPathTrace) -> Execution | None:
        """Write (LLM, one retry, template) and run the question's query over the user's tree as it is
        now; the attempts, the query and its steps go into `trace`. None: the tree shows no memory."""
        view = self.views.get(user)
        nodes = [n for n in view.nodes if n is not None]
        schema = induce_schema(nodes)
        trace.schema = schema.describe()
        shape = leaf_types(nodes)
        if shape is None:
            trace.outcome, trace.stop_reason = "no-memories", "the user's tree shows no memory"
            return None
        scorer = self.scorer(user)
        execution = None
        if self.config.query_policy == "llm":
            execution = self._llm_query(user, question, schema, shape, view, scorer, trace)
        if execution is None:
            template = template_query(question, *shape)
            execution = execute(template, view, scorer)
            trace.attempts.append(QueryAttempt("template", str(template)))
            trace.fallback = "template"
            trace.outcome = "fallback"
            trace.stop_reason = ("template query (policy template)" if self.config.query_policy == "template"
                                 else "the LLM wrote no usable query")
        trace.query = str(execution.query)
        trace.steps = self._steps(execution)
        return execution

    def _search(self, user: str, question: str, trace: XPathTrace) -> tuple[Selection | None, list[Memory]]:
        agent = self.agent
        execution = self.query(user, question, trace)
        if execution is None:
            return None, []
        ids, _ = best_memories(execution, self.config.leaves)
        if not ids:
            trace.stop_reason = "the query selected no memory"
            return None, []
        reranker: ResidualLinearReranker = agent.learner(user).reranker
        embeddings = agent.bank.embeddings(user, ids)
        query_embedding = torch.as_tensor(agent.bank.encoder.encode_queries([question])).detach().float().cpu()[0]
        candidates = xpath_candidates(execution, self.config.leaves, question, user, embeddings, query_embedding,
                                      reranker.feature_names)
        trace.candidates = [(i, float(w)) for i, w in zip(candidates.memory_ids, candidates.retriever_scores.tolist())]
        (selection,) = reranker.select([candidates], self.m, tau=agent.tau, explore=agent.learn,
                                       generator=agent.generator)
        trace.shown, trace.sampled = selection.memory_ids, selection.explore
        return selection, agent.bank.get(user, selection.memory_ids) if selection.chosen else []

    def _llm_query(self, user: str, question: str, schema: Schema, shape: tuple[str, str | None], view: TreeView,
                   scorer: Scorer, trace: XPathTrace) -> Execution | None:
        """The LLM's query, executed; one retry per `config.retries` with the parser's message; None: fall back."""
        leaf, parent = shape
        attributes = schema.attributes.get(parent, ()) if parent is not None else ()
        messages = xpath_query_messages(question, trace.schema, example_queries(leaf, parent, attributes))
        for attempt in range(self.config.retries + 1):
            source = "llm" if attempt == 0 else "retry"
            raw = self._call(messages, trace, source)
            record = QueryAttempt(source, "", raw=raw)
            trace.attempts.append(record)
            try:
                record.text = parse_query_reply(raw)
                query = parse(record.text)
            except (PromptParseError, QuerySyntaxError) as error:
                record.error = str(error)
                messages = retry_messages(messages, raw, record.error)
                continue
            execution = execute(query, view, scorer)
            if not best_memories(execution, 1)[0]:
                record.error = "the query selected no memory"
                return None  # it parsed: a retry showing no parser message would guess blindly
            trace.outcome = "queried"
            trace.fallback = "" if attempt == 0 else "retry"
            trace.stop_reason = "the LLM's query ran" + ("" if attempt == 0 else " after a retry")
            return execution
        return None

    def _steps(self, execution: Execution) -> list[StepRecord]:
        out = []
        view = execution.view
        for s in execution.steps:
            order = np.lexsort((s.indices, -s.weights))[: self.config.steps_shown]
            top = []
            for j in order:
                node = view.nodes[int(s.indices[j])]
                top.append(("(root)" if node is None else node.id, "" if node is None else node.type, float(s.weights[j])))
            out.append(StepRecord(s.step, s.reached, len(s.indices), top))
        return out

    def _answer(self, user: str, question: str, selection: Selection | None, shown: list[Memory], history: list,
                trace: XPathTrace) -> tuple[str, list[Memory]]:
        """The agent's answer prompt over the shown memories; citations → rewards (sampled selections only)."""
        agent = self.agent
        if not self.config.answer:
            return "", []
        started, before = time.perf_counter(), (agent.llm.usage.prompt_tokens, agent.llm.usage.completion_tokens)
        raw = agent.generate(question, shown, history)
        self._record_call(trace, "answer", raw, started, before)
        learner = agent.learner(user) if selection is not None and selection.chosen else None
        feedback = reflect_citations(raw, selection if learner is not None else None, learner,
                                     structured=agent.structured, learn=agent.learn and bool(selection and selection.explore))
        if learner is not None and agent.learn and selection is not None and selection.explore:
            trace.reward = feedback.rewards
        if feedback.rewards is None and shown:
            trace.calls[-1].error = "no parseable citation"
        cited = [shown[i] for i in feedback.citation.cited or [] if 0 <= i < len(shown)]
        return feedback.citation.answer.strip() or UNKNOWN, cited

    # ---- LLM calls ----------------------------------------------------------------------------
    def _call(self, messages: list[Message], trace: XPathTrace, step: str) -> str:
        llm = self.agent.llm
        started, before = time.perf_counter(), (llm.usage.prompt_tokens, llm.usage.completion_tokens)
        (raw,) = llm.generate([messages], max_tokens=self.config.query_tokens)
        self._record_call(trace, step, raw, started, before)
        return raw

    def _record_call(self, trace: XPathTrace, step: str, raw: str, started: float, before: tuple[int, int]) -> None:
        from rmm.frontends.trace import LLMCall

        usage = self.agent.llm.usage
        trace.calls.append(LLMCall(step=step, breadth=0, depth=len(trace.calls), prompt_tokens=usage.prompt_tokens - before[0],
                                   completion_tokens=usage.completion_tokens - before[1],
                                   seconds=time.perf_counter() - started, output=raw))
        log.info("xpath %s: %d+%d tokens", step, trace.calls[-1].prompt_tokens, trace.calls[-1].completion_tokens)
