"""GOAL-MEM (Liang et al., `reference/papers/goal-mem.txt`): backward chaining before retrieval.

Instead of one query per message, the LLM turns the message into an NL-Logic goal and the
subgoals that would establish it; each subgoal is one query through the agent's retriever →
reranker; one batched unification call checks which subgoals the retrieved facts ground (type
consistency, agreement with the bindings so far, entailment); unresolved subgoals are refined
into more basic ones and searched again (depth loop, D_max = 5) until all are grounded, nothing
new is retrieved, or the question's budget of 60 distinct memories is spent; a failed
decomposition is handed to the next one (breadth loop, B_max = 3). `GoalFrontend._search` is
the paper's Algorithm 1. LLM calls per question ≤ 1 + B_max(2 + 2·D_max) (37 at the defaults).

Decisions where the paper is silent (digest §1.2 and §1.5 list the gaps):
* Parse + decompose is one call (the decomposition's `Goal:` line is φ); the "1 +" of the call
  bound is the final answer (or the fallback answer).
* Queries: a subgoal is sent with its NL-Logic markup stripped (`(x:career_field)` → "career
  field"), a refined subgoal as the refinement's `Retrieval Queries` line. One selection of M
  (of K) per query, Gumbel-sampled when the agent learns, greedy otherwise.
* Budget: at most `budget` distinct memories per question over all breadths. A selection that
  would cross it is cut to the prefix of its picks that fits — a prefix of a Plackett–Luce
  sample is itself a valid sample, so the learner can still use it. Once the budget is spent the
  search stops (another decomposition could only re-read memories already judged).
* θ starts empty at every breadth (Alg. 1 line 10); F (supporting facts) accumulates over the
  breadth's depths; bindings that conflict with θ keep the earlier value and are logged.
* The depth frontier is the still-unresolved set U (Eq. 6; Alg. 1 refines the previous refined
  set instead) — one batched refinement call per depth, as the complexity analysis counts.
  `Refinement Status: stop`, an unreadable refinement or only repeated subgoals end the depth
  loop like "nothing new retrieved" does. Success needs every active subgoal grounded by an
  explicit `<= Fact N` (or Known Info) line *and* every answer variable of the goal bound.
* Failure (no breadth grounds): the defined fallback answers from what was found anyway — the
  facts that grounded some subgoal first, then the other retrieved memories in retrieval order,
  at most `fallback_facts` — with the same cited-answer prompt; when no decomposition could be
  read (so nothing was retrieved) it first retrieves with the question itself, as the direct
  front end does (no LLM call, within the budget). `fallback="unknown"` answers "I don't know."
  without a call.
* Prompts: each worked example is given as a user → assistant exchange before the case, not
  inside the instructions: small chat models copy an assistant turn's format far more reliably.
* Malformed output: an unreadable decomposition ends that breadth (the next one is told to keep
  the format); an unreadable unification grounds nothing; an answer without a parseable
  citation keeps its text and gives no citation.
* Learning: each subgoal query's selection is rewarded per shown memory, +1 if the final answer
  cited it or a unification grounded a subgoal with it, −1 otherwise; with neither a readable
  unification nor a parseable citation the selections are skipped (the learner counts them).
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal

from rmm.errors import RmmError
from rmm.frontends.rewards import reward_selections
from rmm.frontends.trace import (
    BreadthStep,
    DepthStep,
    GoalTrace,
    GroundingRecord,
    LLMCall,
    QueryRecord,
    RefineRecord,
    UnifyRecord,
)
from rmm.policy.citations import parse_citations
from rmm.prompts import (
    Decomposition,
    PromptParseError,
    decompose_messages,
    goal_answer_messages,
    parse_decomposition,
    parse_refinement,
    parse_unification,
    refine_messages,
    unify_messages,
)
from rmm.types import Memory, Selection, Turn

if TYPE_CHECKING:
    from rmm.frontends.agent import Agent
    from rmm.types import Message

__all__ = ["GoalConfig", "GoalFrontend", "GoalFrontendError", "GoalResponse", "ground_goal", "retrieval_query"]

log = logging.getLogger(__name__)

UNKNOWN = "I don't know."


class GoalFrontendError(RmmError, ValueError):
    """The goal front end cannot run with what it was given (e.g. an LLM that cannot decompose)."""


@dataclass
class GoalConfig:
    b_max: int = 3  # decompositions tried (breadth)
    d_max: int = 5  # refinement steps per decomposition (depth)
    budget: int = 60  # distinct memories per question
    k: int | None = None  # candidates per subgoal query (None: the agent's K)
    m: int | None = None  # memories selected per subgoal query (None: the agent's M)
    max_subgoals: int = 5  # K_max: subgoals kept per decomposition or refinement
    fallback: Literal["answer", "unknown"] = "answer"
    fallback_facts: int = 10
    answer: bool = True  # False: search only (retrieval evaluation), no final answer call
    decompose_tokens: int = 256
    unify_tokens: int = 320
    refine_tokens: int = 200
    answer_tokens: int = 128

    def __post_init__(self) -> None:
        for name in ("b_max", "d_max", "budget", "max_subgoals", "fallback_facts", "decompose_tokens",
                     "unify_tokens", "refine_tokens", "answer_tokens"):
            value = getattr(self, name)
            least = 0 if name == "d_max" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
        for name in ("k", "m"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        if self.fallback not in ("answer", "unknown"):
            raise ValueError(f"fallback must be 'answer' or 'unknown', got {self.fallback!r}")

    @property
    def max_calls(self) -> int:
        """The paper's bound on LLM calls per question (App. B)."""
        return 1 + self.b_max * (2 + 2 * self.d_max)


@dataclass
class GoalResponse:
    answer: str
    cited: list[Memory]  # the answer's facts it cites
    shown: list[Memory]  # every memory retrieved for the question, in retrieval order
    supporting: list[Memory]  # F: the facts that grounded the goal (empty on fallback)
    grounded: bool
    trace: GoalTrace
    selections: list[Selection]


@dataclass
class _Branch:
    """One breadth step: ψ(b), and over its depths Ψ(b,≤d), S, U, θ, F and M(b,d)."""

    decomposition: Decomposition
    goal: str
    subgoals: list[str]  # Ψ(b,≤d): every subgoal of this breadth so far
    record: BreadthStep
    resolved: list[str] = field(default_factory=list)  # S
    unresolved: dict[str, str] = field(default_factory=dict)  # U: subgoal → why
    theta: dict[str, str] = field(default_factory=dict)
    known: list[str] = field(default_factory=list)
    pool: list[str] = field(default_factory=list)  # M(b,d): memory ids in retrieval order
    support: list[str] = field(default_factory=list)  # F
    tried: list[str] = field(default_factory=list)  # missing info and refined subgoals already asked for
    final_answer: str = ""

    @property
    def grounded(self) -> bool:
        return bool(self.resolved) and not self.unresolved

    @property
    def step(self) -> DepthStep:
        return self.record.steps[-1]


@dataclass
class _Question:
    user: str
    text: str
    history: list[Turn]
    trace: GoalTrace
    memories: dict[str, Memory] = field(default_factory=dict)  # every distinct memory retrieved, in order
    selections: list[tuple[Selection, QueryRecord]] = field(default_factory=list)
    grounding_ids: list[str] = field(default_factory=list)  # memories some unification grounded a subgoal with
    failed: list[str] = field(default_factory=list)  # what the next decomposition must not repeat
    goal: str = ""
    unify_read: bool = False
    answer_read: bool = False


class GoalFrontend:
    """GOAL-MEM over an `Agent`: its bank, reranker/learner, sessions and LLM."""

    def __init__(self, agent: Agent, config: GoalConfig | None = None) -> None:
        if agent.llm.name.startswith("simulated"):
            raise GoalFrontendError(
                "the goal front end needs an LLM that writes text (hf:PATH, openai:URL@MODEL, vllm:PATH): "
                "the simulated LLM only cites memories and cannot decompose, unify or refine")
        self.agent = agent
        self.config = config or GoalConfig()
        self.k = self.config.k or agent.k
        self.m = self.config.m or agent.m
        if self.m > self.k:
            raise ValueError(f"cannot select M={self.m} memories out of K={self.k} candidates")

    # ---- one question ---------------------------------------------------------------------------
    def respond(self, user: str, query: str, *, remember: bool = True) -> GoalResponse:
        """Answer `query` through goal decomposition; learn from what grounded and what was cited."""
        if not isinstance(query, str) or not query.strip():
            raise ValueError("the message to answer must be a non-empty string")
        started = time.perf_counter()
        q = _Question(user, query, self.agent.sessions.current(user).turns,
                      GoalTrace(question=query, user=user, budget=self.config.budget))
        if self.agent.bank.store.has_user(user):
            branch = self._search(q)
        else:
            branch, q.trace.stop_reason = None, "the user has no memories"
        answer, cited, facts = self._answer(q, branch)
        self._learn(q, set(cited))
        if remember:
            from rmm.frontends.agent import ASSISTANT

            self.agent.sessions.append(user, [(user, query), (ASSISTANT, answer)])
        self.agent.checkpoint_if_due(user)
        trace = q.trace
        trace.answer, trace.cited, trace.answer_facts = answer, cited, facts
        trace.retrieved = list(q.memories)
        trace.memories = {i: m.text for i, m in q.memories.items()}
        trace.seconds = time.perf_counter() - started
        supporting = [q.memories[i] for i in branch.support] if branch is not None else []
        return GoalResponse(answer=answer, cited=[q.memories[i] for i in cited], shown=list(q.memories.values()),
                            supporting=supporting, grounded=branch is not None, trace=trace,
                            selections=[s for s, _ in q.selections])

    def _search(self, q: _Question) -> _Branch | None:
        """Algorithm 1: a grounded breadth step, or None (the FAILURE FLAG)."""
        for b in range(1, self.config.b_max + 1):
            branch = self._decompose(q, b)  # φ (at b = 1) and ψ(b); θ ← ∅, M(b,0) ← ∅
            if branch is None:
                continue
            self._retrieve(q, branch, branch.subgoals)  # M(b,0): one query per subgoal
            self._unify(q, branch)  # θ(b,0), U(b,0), F
            for d in range(1, self.config.d_max + 1):
                if branch.grounded or self._budget_spent(q):
                    break
                subgoals, queries = self._refine(q, branch, d)  # ψ(b,d) from U(b,d-1)
                if not subgoals:
                    branch.record.outcome = "stopped"
                    break
                new = self._retrieve(q, branch, subgoals, queries)  # M(b,d) = M(b,d-1) ∪ …
                self._unify(q, branch)  # θ(b,d), U(b,d), F over Ψ(b,≤d) \ S(b,d-1)
                if not new and not branch.grounded:
                    branch.record.outcome = "no-new-memory"
                    break
            if branch.grounded:
                branch.record.outcome, q.trace.stop_reason = "grounded", f"grounded at breadth {b}"
                return branch
            self._fail(q, branch)
            if self._budget_spent(q):
                q.trace.stop_reason = f"budget of {self.config.budget} memories spent"
                return None
        q.trace.stop_reason = q.trace.stop_reason or f"no decomposition grounded in {self.config.b_max} tries"
        return None

    # ---- the steps ------------------------------------------------------------------------------
    def _decompose(self, q: _Question, b: int) -> _Branch | None:
        record = BreadthStep(breadth=b)
        q.trace.breadths.append(record)
        raw = self._call(q, "decompose", decompose_messages(q.text, goal=q.goal, avoid=q.failed), b, 0,
                         self.config.decompose_tokens)
        try:
            decomposition = parse_decomposition(raw, q.text)
        except PromptParseError as error:
            record.error = q.trace.calls[-1].error = str(error)
            record.outcome = "malformed"
            q.failed.append(f"(attempt {b} did not follow the output format: write Goal, Rule, Variables, Subgoals)")
            return None
        q.goal = q.goal or decomposition.goal
        q.trace.goal = q.goal
        subgoals = decomposition.subgoals[: self.config.max_subgoals]
        record.goal, record.rule, record.subgoals = decomposition.goal, decomposition.rule, list(subgoals)
        record.variables = [f"({v.name}:{v.type})" + (f": {v.description}" if v.description else "")
                            for v in decomposition.variables]
        record.difference = decomposition.difference
        record.steps.append(DepthStep(depth=0, subgoals=list(subgoals)))
        return _Branch(decomposition, goal=decomposition.goal or q.goal or q.text, subgoals=list(subgoals),
                       record=record)

    def _retrieve(self, q: _Question, branch: _Branch, subgoals: list[str], queries: list[str] | None = None) -> int:
        """One retriever → reranker selection per subgoal (one batch); returns how many memories are new."""
        texts = queries or [retrieval_query(s) for s in subgoals]
        step, new = branch.step, 0
        for subgoal, text, (selection, ids) in zip(subgoals, texts, self._select(q, texts)):
            fresh = [i for i in ids if i not in branch.pool]
            branch.pool += fresh
            new += len(fresh)
            record = QueryRecord(subgoal=subgoal, query=text, memory_ids=ids, new_ids=fresh)
            step.queries.append(record)
            if selection.chosen:
                q.selections.append((selection, record))
        step.new_memories = new
        return new

    def _select(self, q: _Question, texts: list[str]) -> list[tuple[Selection, list[str]]]:
        """Retriever → reranker for a batch of queries, each cut to the budget; memories fetched once."""
        retriever = self.agent.retriever(q.user, k=self.k, m=self.m)  # the agent's first stage (dense or hybrid)
        out = []
        for selection in retriever.select(texts, q.user, explore=self.agent.learn, generator=self.agent.generator):
            selection = self._within_budget(q, selection)
            ids = list(dict.fromkeys(selection.memory_ids))
            unseen = [i for i in ids if i not in q.memories]
            if unseen:
                q.memories.update({m.id: m for m in self.agent.bank.get(q.user, unseen)})
            out.append((selection, ids))
        return out

    def _retrieve_question(self, q: _Question) -> None:
        """The fallback's own search when no decomposition retrieved anything: the question as one query."""
        ((selection, ids),) = self._select(q, [q.text])
        record = QueryRecord(subgoal="", query=q.text, memory_ids=ids, new_ids=ids)
        q.trace.fallback_queries.append(record)
        if selection.chosen:
            q.selections.append((selection, record))

    def _unify(self, q: _Question, branch: _Branch) -> None:
        """One batched unification over the active subgoals Ψ \\ S and every fact of M(b,d)."""
        active = [s for s in branch.subgoals if s not in branch.resolved]
        facts = [q.memories[i] for i in branch.pool]
        step = branch.step
        if not facts:
            branch.unresolved = {s: "no memory was retrieved" for s in active}
            return self._close_step(branch)
        raw = self._call(q, "unify", unify_messages(q.text, branch.goal, branch.decomposition.rule, active, facts,
                                                    substitution=branch.theta, known=branch.known),
                         branch.record.breadth, step.depth, self.config.unify_tokens)
        try:
            result = parse_unification(raw, len(facts))
        except PromptParseError as error:
            q.trace.calls[-1].error = str(error)
            step.unify = UnifyRecord(status=None, substitution={}, grounded=[], unresolved={}, error=str(error))
            branch.unresolved = {s: branch.unresolved.get(s) or "the unification was unreadable" for s in active}
            return self._close_step(branch)
        q.unify_read = True
        conflicts = _merge(branch.theta, result.substitution)
        grounded: list[GroundingRecord] = []
        for line in result.grounded:
            target = _match(line.subgoal, active)
            if target is None or target in branch.resolved:
                continue
            ids = [branch.pool[i] for i in line.facts]
            conflicts += _merge(branch.theta, line.bindings)
            branch.resolved.append(target)
            branch.support += [i for i in ids if i not in branch.support]
            q.grounding_ids += [i for i in ids if i not in q.grounding_ids]
            grounded.append(GroundingRecord(target, ids, line.known_info, line.bindings))
        why = {s: u.why for u in result.unresolved if (s := _match(u.subgoal, active))}
        branch.unresolved = {s: why.get(s, "") for s in active if s not in branch.resolved}
        if not branch.unresolved:
            self._require_answer_variables(branch)
        branch.known = list(dict.fromkeys(branch.known + result.known_info))[:12]
        branch.final_answer = result.final_answer or branch.final_answer
        step.unify = UnifyRecord(status=result.status, substitution=result.substitution, grounded=grounded,
                                 unresolved=dict(branch.unresolved), final_answer=result.final_answer,
                                 known_info=result.known_info, conflicts=conflicts)
        return self._close_step(branch)

    def _require_answer_variables(self, branch: _Branch) -> None:
        """Paper §4.4: grounded means every answer variable of the goal is bound, too."""
        missing = [v.name for v in branch.decomposition.variables if v.name not in branch.theta]
        if not missing:
            return
        mentions = re.compile(r"\(\s*(?:" + "|".join(map(re.escape, missing)) + r")\s*:")
        holders = [s for s in branch.subgoals if mentions.search(s)] or [branch.goal]
        if branch.goal in holders and branch.goal not in branch.subgoals:
            branch.subgoals.append(branch.goal)
        for s in holders:
            if s in branch.resolved:
                branch.resolved.remove(s)
            branch.unresolved[s] = f"answer variable {', '.join(missing)} is not bound"

    def _refine(self, q: _Question, branch: _Branch, d: int) -> tuple[list[str], list[str]]:
        """One batched refinement of U: the new subgoals and their retrieval queries ([] = stop)."""
        step = DepthStep(depth=d, subgoals=[])
        branch.record.steps.append(step)
        facts = [q.memories[i] for i in branch.pool]
        raw = self._call(q, "refine", refine_messages(q.text, branch.goal, branch.decomposition.rule,
                                                      list(branch.unresolved.items()), facts,
                                                      substitution=branch.theta, known=branch.known,
                                                      tried=branch.tried),
                         branch.record.breadth, d, self.config.refine_tokens)
        try:
            result = parse_refinement(raw)
        except PromptParseError as error:
            q.trace.calls[-1].error = str(error)
            step.refine = RefineRecord(status="unreadable", error=str(error))
            return [], []
        step.refine = RefineRecord(status=result.status, missing_info=result.missing_info,
                                   relation_type=result.relation_type, subgoals=result.subgoals,
                                   queries=result.queries, rationale=result.rationale)
        if result.status == "stop":
            return [], []
        known = {_normal(s) for s in branch.subgoals + branch.tried}
        pairs: list[tuple[str, str]] = []
        for i, subgoal in enumerate(result.subgoals or result.queries):
            if _normal(subgoal) in known or len(pairs) == self.config.max_subgoals:
                continue
            known.add(_normal(subgoal))
            query = result.queries[i] if i < len(result.queries) and result.subgoals else retrieval_query(subgoal)
            pairs.append((subgoal, query))
        subgoals, queries = [s for s, _ in pairs], [r for _, r in pairs]
        branch.tried += [t for t in (result.missing_info, *subgoals) if t]
        branch.subgoals += subgoals
        step.subgoals = subgoals
        return subgoals, queries

    def _answer(self, q: _Question, branch: _Branch | None) -> tuple[str, list[str], list[str]]:
        """GENERATE(u, φ^g, F) when grounded, else the defined fallback; (answer, cited ids, fact ids)."""
        trace = q.trace
        if branch is not None:
            trace.outcome = "grounded"
            facts = list(branch.support)
            goal = trace.grounded_goal = ground_goal(branch.goal, branch.theta)
            trace.bindings, trace.supporting = dict(branch.theta), list(branch.support)
        else:
            has_memories = self.agent.bank.store.has_user(q.user)
            trace.outcome = "fallback" if has_memories else "no-memories"
            if has_memories and not q.memories:
                self._retrieve_question(q)
            facts = list(dict.fromkeys(q.grounding_ids + list(q.memories)))[: self.config.fallback_facts]
            goal = q.goal
        if not self.config.answer:
            return "", [], facts
        if branch is None and self.config.fallback == "unknown":
            return UNKNOWN, [], facts
        shown = [q.memories[i] for i in facts]
        breadth = branch.record.breadth if branch is not None else len(trace.breadths)
        raw = self._call(q, "answer", goal_answer_messages(q.text, goal, shown, q.history), breadth, -1,
                         self.config.answer_tokens, shown=shown)
        citation = parse_citations(raw, len(shown))
        q.answer_read = citation.cited is not None or citation.no_cite
        if not q.answer_read:
            trace.calls[-1].error = "no parseable citation"
        answer = citation.answer.strip() or (branch.final_answer if branch is not None else "") or UNKNOWN
        return answer, [facts[i] for i in citation.cited or []], facts

    # ---- learning, budget, bookkeeping ------------------------------------------------------------
    def _learn(self, q: _Question, cited: set[str]) -> None:
        """Reward each subgoal query's selection by whether grounding or the answer used its memories."""
        if not self.agent.learn or not q.selections:
            return
        used = set(q.grounding_ids) | cited
        reward_selections(self.agent.learner(q.user), q.selections, used, q.unify_read or q.answer_read)

    def _within_budget(self, q: _Question, selection: Selection) -> Selection:
        """The longest prefix of the picks that keeps the question within its memory budget."""
        room = self.config.budget - len(q.memories)
        keep, unseen = 0, set()
        for memory_id in selection.memory_ids:
            if memory_id not in q.memories and memory_id not in unseen:
                if len(unseen) == room:
                    break
                unseen.add(memory_id)
            keep += 1
        if keep == len(selection.chosen):
            return selection
        logp = selection.logp[:keep] if selection.logp is not None else None
        return replace(selection, chosen=selection.chosen[:keep], logp=logp)  # keeps τ, version, mask

    def _budget_spent(self, q: _Question) -> bool:
        return len(q.memories) >= self.config.budget

    def _fail(self, q: _Question, branch: _Branch) -> None:
        """Tell the next decomposition what did not work: the rule and what stayed unresolved."""
        if not branch.record.outcome:
            branch.record.outcome = "budget-spent" if self._budget_spent(q) else "depth-exhausted"
        rule = branch.decomposition.rule or " AND ".join(branch.decomposition.subgoals)
        unresolved = "; ".join(branch.unresolved) or "nothing grounded"
        q.failed.append(f"{rule} (unresolved: {unresolved})")

    def _close_step(self, branch: _Branch) -> None:
        step = branch.step
        step.bindings, step.resolved, step.unresolved = dict(branch.theta), list(branch.resolved), list(branch.unresolved)

    def _call(self, q: _Question, step: str, messages: list[Message], breadth: int, depth: int, max_tokens: int,
              shown: list[Memory] | None = None) -> str:
        llm = self.agent.llm
        before_prompt, before_completion = llm.usage.prompt_tokens, llm.usage.completion_tokens
        started = time.perf_counter()
        (raw,) = llm.generate([messages], max_tokens=max_tokens, shown=[shown] if shown is not None else None)
        q.trace.calls.append(LLMCall(step=step, breadth=breadth, depth=depth,
                                     prompt_tokens=llm.usage.prompt_tokens - before_prompt,
                                     completion_tokens=llm.usage.completion_tokens - before_completion,
                                     seconds=time.perf_counter() - started, output=raw))
        call = q.trace.calls[-1]
        log.info("goal %s (b=%d, d=%d): %d+%d tokens, %.1fs", step, breadth, depth, call.prompt_tokens,
                 call.completion_tokens, call.seconds)
        log.debug("goal %s output: %r", step, raw[:300])
        return raw


# ---- NL-Logic helpers --------------------------------------------------------------------------------
_TYPED = re.compile(r"\(\s*([^():]{1,80}?)\s*:\s*([^()]{1,80}?)\s*\)")
_PAREN = re.compile(r"\(\s*([^()]{1,120}?)\s*\)")
_VARIABLE = re.compile(r"[a-z][0-9_]{0,3}")


def retrieval_query(subgoal: str) -> str:
    """A subgoal as a search query: `(x:career_field)` → "career field", `(Caroline)` → "Caroline"."""
    def typed(match: re.Match[str]) -> str:
        name, kind = match.group(1), match.group(2)
        return kind.replace("_", " ") if _VARIABLE.fullmatch(name) else name

    text = _PAREN.sub(r"\1", _TYPED.sub(typed, subgoal))
    return " ".join(text.split()) or subgoal


def ground_goal(goal: str, theta: dict[str, str]) -> str:
    """φ^g: the goal with each bound variable `(x:type)` replaced by its value."""
    def bind(match: re.Match[str]) -> str:
        value = theta.get(match.group(1))
        return f"({value})" if value else match.group(0)

    return _TYPED.sub(bind, goal)


def _normal(text: str) -> str:
    return " ".join(re.sub(r"[^a-z0-9 ]", " ", text.lower()).split())


def _match(text: str, candidates: list[str]) -> str | None:
    """The candidate subgoal an LLM line refers to: same words, or clearly the most overlapping."""
    key = _normal(text)
    if not key:
        return None
    normals = [_normal(c) for c in candidates]
    if key in normals:
        return candidates[normals.index(key)]
    words = set(key.split())
    best, best_score = None, 0.5
    for candidate, normal in zip(candidates, normals):
        other = set(normal.split())
        score = len(words & other) / len(words | other) if other else 0.0
        if score > best_score:
            best, best_score = candidate, score
    return best


def _merge(theta: dict[str, str], bindings: dict[str, str]) -> list[str]:
    """θ ← θ ∪ δ; a variable already bound keeps its value (the conflict is returned for the trace)."""
    conflicts = []
    for name, value in bindings.items():
        if name not in theta:
            theta[name] = value
        elif _normal(theta[name]) != _normal(value) and _normal(value) not in _normal(theta[name]) \
                and _normal(theta[name]) not in _normal(value):
            conflicts.append(f"{name}: kept {theta[name]!r}, rejected {value!r}")
    return conflicts
