"""Does a controller retrieve more of the gold evidence than one direct query? (retrieval side)

For each question (LoCoMo category 1, multi-hop, by default) the controller — GOAL-MEM or
MemR³ (`rmm.frontends.controllers`) — runs its search and we take the union of every memory its
queries retrieved; the direct baseline is a single query with the question text through the same
retriever → reranker, retrieving the same number of distinct memories (equal budget per
question). Both are scored by the fraction of the gold evidence turns they cover. No answer is
judged: the final answer does not change what was retrieved, so it is skipped unless asked for
(`answer=True`). Learning is off, so every question sees the same (untrained or checkpointed)
reranker for both arms.

Beside it, R@T (`rmm.eval.metrics.recall_at_turns`, T in dialogue turns): the controller's memories
walked in the order it retrieved them, the direct query's in its rank order, each included whole
while the turns shown add up to at most T — so a controller whose memories show more text (a
session, an event, a graph walk) does not win by that alone.

Rows and JSON name the controller: `recall_goal` / `goal_ids` / `grounded` for GOAL-MEM,
`recall_memr3` / `memr3_ids` / `answered` (the LLM chose to answer before n_max) for MemR³.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from rmm.eval.metrics import TURN_BUDGETS
from rmm.eval.retrieval import GoldScorer
from rmm.frontends.agent import Agent
from rmm.frontends.controllers import (
    CONTROLLERS,
    ControllerConfig,
    controller_name,
    open_controller,
)
from rmm.frontends.goal import GoalConfig
from rmm.memory.sessions import SessionLog
from rmm.types import Dataset, Question

if TYPE_CHECKING:
    from rmm.frontends.trace import FrontendTrace
    from rmm.llm.base import LLM
    from rmm.memory.bank import MemoryBank
    from rmm.memory.hybrid import HybridRetriever

__all__ = ["ControllerRecallReport", "evaluate_controller_recall"]

log = logging.getLogger(__name__)


@dataclass
class ControllerRecallReport:
    dataset: str
    llm: str
    category: int | None
    n: int
    recall_controller: float  # mean fraction of gold turns covered by the controller's union of memories
    recall_direct: float  # … by one direct query with the same number of memories
    memories_per_question: float
    settled: float  # fraction of questions whose search ended on its own terms (goal: grounded; MemR³: answered)
    llm_calls: float  # per question
    prompt_tokens: float
    completion_tokens: float
    seconds: float  # LLM seconds per question
    frontend: str = "goal"
    recall_turns_controller: dict[str, float] = field(default_factory=dict)  # "recall_turns@T" → mean R@T
    recall_turns_direct: dict[str, float] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    rows: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """The report with the controller's own names: `recall_goal` and `grounded`, or `recall_memr3` and `answered`."""
        out = asdict(self)
        out[f"recall_{self.frontend}"] = out.pop("recall_controller")
        out[f"recall_turns_{self.frontend}"] = out.pop("recall_turns_controller")
        out[CONTROLLERS[self.frontend].settled] = out.pop("settled")
        return out


def evaluate_controller_recall(dataset: Dataset, bank: MemoryBank | HybridRetriever, llm: LLM, *, category: int | None = 1,
                               limit: int | None = None, k: int = 20, m: int = 5,
                               config: ControllerConfig | None = None, answer: bool = False, progress: bool = True,
                               on_trace: Callable[[Question, FrontendTrace], None] | None = None,
                               budgets: Sequence[int] = TURN_BUDGETS) -> ControllerRecallReport:
    """Gold-evidence recall of the controller's retrieved union vs a direct query at equal budget,
    and R@T of both at each turn budget in `budgets`.

    `config` picks the controller (a `GoalConfig` — the default — or a `MemR3Config`)."""
    config = replace(config or GoalConfig(), answer=answer)
    name = controller_name(config)
    settled = CONTROLLERS[name].settled
    scorer = GoldScorer.for_dataset(dataset, "turn")
    questions = [q for q in dataset.questions
                 if (category is None or q.category == category) and scorer.gold(q) and not q.abstention]
    questions = questions[: limit or None]
    sessions = SessionLog(":memory:")
    agent = Agent.over(bank, llm, k=k, m=m, learn=False, sessions=sessions, checkpoint_every=0)
    controller = open_controller(agent, config)
    rows: list[dict[str, Any]] = []
    try:
        for q in tqdm(questions, desc=f"{name} front end", unit="q", disable=not progress):
            gold_turns = {"gold": set(q.evidence_turns)} if name == "compass" else {}  # the oracle policy's
            response = controller.respond(q.user_id, q.text, remember=False, **gold_turns)
            trace = response.trace
            union = trace.retrieved
            direct = _direct(agent, q, len(union))
            gold = scorer.gold(q)
            usage = trace.usage
            turns = {arm: scorer.turn_budgets(_ranked_refs(bank, q, ids), q, budgets)
                     for arm, ids in ((name, union), ("direct", direct))}
            rows.append({
                "id": q.id, "question": q.text, "gold_answer": q.answer, "gold_turns": sorted(gold),
                "n_memories": len(union), f"recall_{name}": _recall(bank, scorer, q, union, gold),
                "recall_direct": _recall(bank, scorer, q, direct, gold), f"{name}_ids": union, "direct_ids": direct,
                **{f"{key}_{arm}": value for arm, row in turns.items() for key, value in row.items()},
                settled: trace.outcome == settled, "answer": response.answer or None, "outcome": trace.outcome,
                "llm_calls": usage.calls, "prompt_tokens": usage.prompt_tokens,
                "completion_tokens": usage.completion_tokens, "seconds": usage.seconds, "trace": trace.to_json(),
            })
            if on_trace is not None:
                on_trace(q, trace)
    finally:
        sessions.close()

    def mean(key: str) -> float:
        return sum(float(r[key]) for r in rows) / len(rows) if rows else 0.0

    return ControllerRecallReport(
        dataset=dataset.name, llm=llm.name, category=category, n=len(rows), recall_controller=mean(f"recall_{name}"),
        recall_direct=mean("recall_direct"), memories_per_question=mean("n_memories"), settled=mean(settled),
        llm_calls=mean("llm_calls"), prompt_tokens=mean("prompt_tokens"), completion_tokens=mean("completion_tokens"),
        seconds=mean("seconds"), frontend=name, config={**asdict(config), "k": k, "m": m}, rows=rows,
        recall_turns_controller={f"recall_turns@{t}": mean(f"recall_turns@{t}_{name}") for t in budgets},
        recall_turns_direct={f"recall_turns@{t}": mean(f"recall_turns@{t}_direct") for t in budgets})


def _direct(agent: Agent, question: Question, n: int) -> list[str]:
    """The top-n distinct memories of one query with the question itself (the reranker's order)."""
    if n == 0 or not agent.bank.store.has_user(question.user_id):
        return []
    retriever = agent.retriever(question.user_id, k=max(agent.k, n), m=min(agent.m, n))  # the controller's first stage
    (found,) = retriever.search([question.text], question.user_id, n)
    return list(dict.fromkeys(found.memory_ids))[:n]


def _ranked_refs(bank: MemoryBank, question: Question, ids: list[str]) -> list[list[str]]:
    """Each memory's turn refs, in the order of `ids` (the order they were shown)."""
    found = {m.id: m.refs for m in bank.get(question.user_id, ids)} if ids else {}
    return [found[i] for i in ids if i in found]


def _recall(bank: MemoryBank, scorer: GoldScorer, question: Question, ids: list[str], gold: set[str]) -> float:
    if not gold:
        return 0.0
    covered = set().union(*(scorer.units(m.refs) for m in bank.get(question.user_id, ids))) if ids else set()
    return len(covered & gold) / len(gold)
