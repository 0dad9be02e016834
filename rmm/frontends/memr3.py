"""MemR³ (Du et al., `reference/papers/memr3.txt`): a closed retrieve / reflect / answer loop.

    start → retrieve(q) → generate → router → retrieve(q ⊕ Δq) → generate → …
                                            → reflect (reasoning F fed back) → generate → …
                                            → answer(q, draft w, evidence E) → end

One generate call per iteration updates the state — evidence E (concise bullets, each citing the
memories it comes from), gaps G (what is still missing) — and picks the next action with its
payload (a refined query Δq, reasoning F or a draft answer w). The router applies the paper's
deterministic overrides (Alg. 1); every retrieval goes through the agent's retriever → reranker
with the memories already shown masked out *inside the reranker, before its Gumbel top-M*, so no
memory is shown twice for a question and each selection stays a valid Plackett–Luce sample over
what is left (the paper's most important component: −13 points without it). LLM calls per
question ≤ n_max generate calls + 1 answer; memories ≤ n_max · n_chk.

Decisions where the paper is silent or that this codebase needs (digest §4):
* n_cap = 1: after one reflect the next action is a retrieval. The paper does not give n_cap;
  the authors' code (github.com/Leagein/memr3, `max_reflect_streak=1`) uses 1, and a second
  reflect in a row sees the same snippets and evidence plus only its own previous reasoning, so
  it rarely adds anything, while a retrieval always brings n_chk unseen memories (the mask).
* Router (Alg. 1, in its order): the n_max-th generate call is told to answer and answers; after
  an empty retrieval (the user's memories are all shown: the retriever over-fetches so that K
  unseen candidates remain while any exist) a retrieve becomes reflect — an `answer` is kept,
  where Alg. 1 read literally would reflect until n_max on a bank with nothing left to show; a
  reflect streak ≥ n_cap forces a retrieval. The directive in the prompt switches the same way.
* S (the latest snippets) stays in the prompt until the next retrieval, so a reflect call can
  still cite them; F is shown only after a reflect (as in the authors' code).
* Unreadable generate output keeps E and G as they were and counts as no decision, which the
  router turns into a retrieval with the question alone (new memories, thanks to the mask)
  unless an override applies. A retrieve without a query also searches with q alone.
* Memory ids: snippets carry handles local to the question (`M3` = the third memory retrieved);
  a bullet citing a handle that was not in its prompt loses that handle (never remapped).
* Final answer: the paper uses Zep's answer prompt over (q, w, E); ours (`memr3_answer.txt`)
  cites evidence items, and a cited item credits the memories it cites.
* Learning: each retrieval is one selection; a shown memory is +1 when some generate call's
  evidence or the final answer's cited evidence cites it, −1 otherwise. Rewards are only given
  when they are attributable: some generate call was read with every bullet citing a memory (or
  no evidence at all), or the final answer's citation was parseable over evidence that all
  cites memories. Otherwise the selections are skipped (the learner counts them).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from rmm.errors import RmmError
from rmm.frontends.memr3_trace import EvidenceRecord, IterationRecord, MemR3Trace
from rmm.frontends.rewards import reward_selections
from rmm.frontends.trace import LLMCall, QueryRecord
from rmm.policy.citations import parse_citations
from rmm.prompts.memr3_parse import Decision, Generation, parse_generation
from rmm.prompts.memr3_render import (
    MEMR3_SCHEMA,
    Directive,
    generate_messages,
    memr3_answer_messages,
)
from rmm.prompts.parse import PromptParseError
from rmm.types import Memory, Selection, Turn

if TYPE_CHECKING:
    from rmm.frontends.agent import Agent
    from rmm.types import Message

__all__ = ["MemR3Config", "MemR3Frontend", "MemR3FrontendError", "MemR3Response", "MemR3State", "directive_for",
           "route"]

log = logging.getLogger(__name__)

UNKNOWN = "I don't know."
Action = Literal["retrieve", "reflect", "answer"]


class MemR3FrontendError(RmmError, ValueError):
    """The MemR³ front end cannot run with what it was given (e.g. an LLM that cannot write JSON)."""


@dataclass
class MemR3Config:
    n_chk: int = 5  # memories shown per retrieval (the reranker's M)
    n_max: int = 5  # generate calls per question (iteration budget)
    n_cap: int = 1  # consecutive reflects before a retrieval is forced (module docstring)
    k: int | None = None  # unseen candidates reranked per retrieval (None: the agent's K, at least n_chk)
    answer: bool = True  # False: search only (retrieval evaluation), no final answer call
    json_schema: bool = True  # ask the backend for MEMR3_SCHEMA (constrained decoding where it has it)
    generate_tokens: int = 400
    answer_tokens: int = 128

    def __post_init__(self) -> None:
        for name in ("n_chk", "n_max", "n_cap", "generate_tokens", "answer_tokens"):
            _check_positive(name, getattr(self, name))
        if self.k is not None:
            _check_positive("k", self.k)
            if self.k < self.n_chk:
                raise ValueError(f"cannot show n_chk={self.n_chk} memories out of k={self.k} candidates")

    @property
    def max_calls(self) -> int:
        """LLM calls per question at most: n_max generate calls and the final answer."""
        return self.n_max + 1


def _check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


@dataclass
class MemR3State:
    """The paper's state s = (q, S, E, G, k) and the router's bookkeeping (F, Δq, M^ret, n_streak)."""

    question: str
    snippets: list[str] = field(default_factory=list)  # S: the latest retrieval's memory ids
    evidence: list[EvidenceRecord] = field(default_factory=list)  # E
    gaps: list[str] = field(default_factory=list)  # G
    iteration: int = 0  # k: generate calls made
    reasoning: str = ""  # F: shown to the generate call after a reflect
    last_query: str = ""  # Δq of the latest retrieval that had one
    retrieved: list[str] = field(default_factory=list)  # M^ret: the mask, in retrieval order
    reflect_streak: int = 0  # n_streak
    draft: str = ""  # w: the latest detailed_answer
    exhausted: bool = False  # the latest retrieval found nothing unseen

    def handle(self, memory_id: str) -> int:
        """The memory's number in the prompts (`M3` → 3): its position in retrieval order."""
        return self.retrieved.index(memory_id) + 1


def directive_for(state: MemR3State, config: MemR3Config) -> Directive:
    """The decision directive of the next generate call (paper App. A.1), by Alg. 1's order."""
    if state.iteration + 1 >= config.n_max:
        return "answer"
    if state.exhausted:
        return "reflect"
    if state.reflect_streak >= config.n_cap:
        return "retrieve"
    return "default"


def route(decision: Decision | None, state: MemR3State, config: MemR3Config) -> tuple[Action, str]:
    """Alg. 1 on the LLM's decision after generate call k = state.iteration: (action, why it was overridden)."""
    if state.iteration >= config.n_max:
        return "answer", "" if decision == "answer" else f"iteration budget n_max={config.n_max} spent"
    if state.exhausted:
        if decision in ("answer", "reflect"):
            return decision, ""
        return "reflect", "the last retrieval found no unseen memory"
    if state.reflect_streak >= config.n_cap:
        return "retrieve", "" if decision == "retrieve" else f"reflect streak reached n_cap={config.n_cap}"
    if decision is None:
        return "retrieve", "no readable decision: retrieve more"
    return decision, ""


@dataclass
class MemR3Response:
    answer: str
    cited: list[Memory]  # the memories behind the evidence the answer cites
    shown: list[Memory]  # every memory retrieved for the question, in retrieval order
    evidence: list[EvidenceRecord]  # E when the loop ended (what the final answer saw)
    trace: MemR3Trace
    selections: list[Selection]


@dataclass
class _Question:
    user: str
    history: list[Turn]
    state: MemR3State
    trace: MemR3Trace
    memories: dict[str, Memory] = field(default_factory=dict)
    selections: list[tuple[Selection, QueryRecord]] = field(default_factory=list)
    used: set[str] = field(default_factory=set)  # memories some evidence bullet cited
    attributed: bool = False  # some generate call was read with every bullet citing a memory
    answer_read: bool = False  # the answer's citation was parseable over fully attributed evidence


class MemR3Frontend:
    """MemR³ over an `Agent`: its bank, reranker/learner, sessions and LLM."""

    def __init__(self, agent: Agent, config: MemR3Config | None = None) -> None:
        self.agent, self.config = agent, config or MemR3Config()
        self.k = max(self.config.k or agent.k, self.config.n_chk)  # unseen candidates per retrieval
        if agent.llm.name.startswith("simulated"):  # it only cites memories: no evidence, gaps or decisions
            raise MemR3FrontendError("the MemR³ front end needs an LLM that writes text (hf:PATH, openai:URL@MODEL, "
                                     "vllm:PATH); the simulated LLM cannot write evidence, gaps or decisions")

    # ---- one question ---------------------------------------------------------------------------
    def respond(self, user: str, query: str, *, remember: bool = True) -> MemR3Response:
        """Answer `query` through the retrieve / reflect / answer loop; learn from what was cited."""
        if not isinstance(query, str) or not query.strip():
            raise ValueError("the message to answer must be a non-empty string")
        started = time.perf_counter()
        config = self.config
        q = _Question(user, self.agent.sessions.current(user).turns, MemR3State(query),
                      MemR3Trace(question=query, user=user, n_max=config.n_max, n_chk=config.n_chk, n_cap=config.n_cap))
        if self.agent.bank.store.has_user(user):
            q.trace.start = self._retrieve(q, "")
            while self._generate(q) != "answer":  # ends: the n_max-th call always answers
                pass
        else:
            q.trace.outcome, q.trace.stop_reason = "no-memories", "the user has no memories"
        answer, cited = self._answer(q)
        self._learn(q, cited)
        if remember:
            from rmm.frontends.agent import ASSISTANT

            self.agent.sessions.append(user, [(user, query), (ASSISTANT, answer)])
        self.agent.checkpoint_if_due(user)  # the agent's checkpoint cadence, shared by every front end
        trace = q.trace
        trace.answer, trace.cited, trace.draft = answer, cited, q.state.draft
        trace.evidence, trace.retrieved = list(q.state.evidence), list(q.state.retrieved)
        trace.memories = {i: m.text for i, m in q.memories.items()}
        trace.seconds = time.perf_counter() - started
        return MemR3Response(answer=answer, cited=[q.memories[i] for i in cited], shown=list(q.memories.values()),
                             evidence=list(q.state.evidence), trace=trace, selections=[s for s, _ in q.selections])

    # ---- the nodes ------------------------------------------------------------------------------
    def _retrieve(self, q: _Question, delta: str) -> QueryRecord:
        """S_k = Retrieve(q ⊕ Δq, M \\ M^ret): one reranked selection of n_chk unseen memories."""
        state = q.state
        text = f"{state.question} {delta}" if delta else state.question
        retriever = self.agent.retriever(q.user, k=self.k, m=self.config.n_chk)  # the agent's first stage
        (selection,) = retriever.select([text], q.user, explore=self.agent.learn, generator=self.agent.generator,
                                        exclude=[set(state.retrieved)])
        ids = [i for i in selection.memory_ids if i not in q.memories]  # all of them: the mask excluded the rest
        q.memories.update((m.id, m) for m in self.agent.bank.get(q.user, ids))
        state.retrieved += ids
        state.snippets, state.exhausted = ids, not ids
        state.last_query = delta or state.last_query
        record = QueryRecord(subgoal=delta, query=text, memory_ids=ids, new_ids=ids)
        if selection.chosen:
            q.selections.append((selection, record))
        return record

    def _generate(self, q: _Question) -> Action:
        """One generate call (Eq. 3) and the router (Alg. 1); runs the retrieval it decides on."""
        state, config = q.state, self.config
        directive = directive_for(state, config)
        state.iteration += 1
        carried = [(e.text, [state.handle(i) for i in e.memories]) for e in state.evidence]
        snippets = [(state.handle(i), q.memories[i]) for i in state.snippets]
        citable = {n for n, _ in snippets} | {n for _, handles in carried for n in handles}
        messages = generate_messages(state.question, directive=directive, evidence=carried, gaps=state.gaps,
                                     snippets=snippets, reasoning=state.reasoning, last_query=state.last_query)
        raw = self._call(q, "generate", messages, state.iteration, config.generate_tokens,
                         MEMR3_SCHEMA if config.json_schema else None)
        record = IterationRecord(iteration=state.iteration, directive=directive, decision=None, action="")
        generation: Generation | None = None
        try:
            generation = parse_generation(raw, citable)
        except PromptParseError as error:
            record.error = q.trace.calls[-1].error = str(error)
        if generation is not None:
            self._update(q, generation, record)
        record.decision = generation.decision if generation is not None else None
        action, record.override = route(record.decision, state, config)
        record.action = action
        q.trace.iterations.append(record)
        if action == "reflect":
            state.reflect_streak += 1
            state.reasoning = (generation.reasoning if generation is not None else "") or state.reasoning
            return action
        state.reflect_streak, state.reasoning = 0, ""
        if action == "retrieve":
            record.retrieval = self._retrieve(q, generation.retrieval_query if generation is not None else "")
        elif state.iteration >= config.n_max:
            q.trace.outcome, q.trace.stop_reason = "budget", f"iteration budget n_max={config.n_max} reached"
        else:
            q.trace.outcome, q.trace.stop_reason = "answered", f"the LLM answered at iteration {state.iteration}"
        return action

    def _update(self, q: _Question, generation: Generation, record: IterationRecord) -> None:
        """E_k, G_k and the payload from a readable generation; bullets map handles back to memory ids."""
        state = q.state
        known = {_key(e.text): e.memories for e in state.evidence}
        evidence = []
        for bullet in generation.evidence:
            memories = [state.retrieved[n - 1] for n in bullet.handles] or known.get(_key(bullet.text), [])
            evidence.append(EvidenceRecord(bullet.text, list(memories)))  # carried bullets keep their sources
        state.evidence, state.gaps = evidence, generation.gaps
        state.draft = generation.detailed_answer or state.draft
        q.used.update(i for e in evidence for i in e.memories)
        q.attributed = q.attributed or all(e.memories for e in evidence)
        record.evidence, record.gaps, record.warnings = list(evidence), list(generation.gaps), generation.warnings
        record.retrieval_query, record.reasoning = generation.retrieval_query, generation.reasoning
        record.draft = generation.detailed_answer

    def _answer(self, q: _Question) -> tuple[str, list[str]]:
        """Eq. 6: the final answer from q, the draft and E; (answer, ids of the memories it cites)."""
        if not self.config.answer:
            return "", []
        evidence = q.state.evidence
        raw = self._call(q, "answer", memr3_answer_messages(q.state.question, q.state.draft, [e.text for e in evidence],
                                                            q.history), -1, self.config.answer_tokens, None)
        citation = parse_citations(raw, len(evidence))
        readable = citation.cited is not None or citation.no_cite
        if not readable:
            q.trace.calls[-1].error = "no parseable citation"
        q.answer_read = readable and all(e.memories for e in evidence)
        q.trace.cited_evidence = list(citation.cited or [])
        cited = list(dict.fromkeys(i for index in citation.cited or [] for i in evidence[index].memories))
        return citation.answer.strip() or q.state.draft or UNKNOWN, cited

    # ---- learning and bookkeeping -----------------------------------------------------------------
    def _learn(self, q: _Question, cited: list[str]) -> None:
        """One reward per shown memory of every retrieval: +1 cited by evidence or the answer, else −1."""
        if not (self.agent.learn and q.selections):
            return
        helped = q.used.union(cited)
        attributable = q.attributed or q.answer_read
        reward_selections(self.agent.learner(q.user), q.selections, helped, attributable)

    def _call(self, q: _Question, step: str, messages: list[Message], iteration: int, max_tokens: int,
              schema: dict | None) -> str:
        """One LLM call, recorded in the trace with its tokens and seconds."""
        llm = self.agent.llm
        prompt_tokens, completion_tokens = llm.usage.prompt_tokens, llm.usage.completion_tokens
        started = time.perf_counter()
        (raw,) = llm.generate([messages], json_schema=schema, max_tokens=max_tokens)
        call = LLMCall(step=step, breadth=0, depth=iteration, prompt_tokens=llm.usage.prompt_tokens - prompt_tokens,
                       completion_tokens=llm.usage.completion_tokens - completion_tokens,
                       seconds=time.perf_counter() - started, output=raw)
        q.trace.calls.append(call)
        log.info("memr3 %s (k=%d): %d+%d tokens, %.1fs", step, iteration, call.prompt_tokens, call.completion_tokens,
                 call.seconds)
        return raw


def _key(text: str) -> str:
    return " ".join(text.lower().split())
