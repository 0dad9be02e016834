"""Question answering through the agent: SQuAD-style token F1, LLM-judge accuracy, per category."""

from __future__ import annotations

import re
import string
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from rmm.eval.retrieval import SEPARATE_CATEGORIES, GoldScorer
from rmm.frontends.agent import Agent
from rmm.frontends.controllers import (
    CONTROLLERS,
    ControllerConfig,
    controller_name,
    open_controller,
)
from rmm.llm.simulated import SimulatedLLM, gold_evidence_oracle
from rmm.memory.sessions import SessionLog
from rmm.types import Dataset

if TYPE_CHECKING:
    from rmm.frontends.trace import FrontendTrace
    from rmm.llm.base import LLM
    from rmm.memory.bank import MemoryBank
    from rmm.memory.hybrid import HybridRetriever

__all__ = ["QAReport", "evaluate_qa", "normalize_answer", "token_f1"]

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """Lower case, no punctuation, no articles, single spaces (SQuAD's official normalisation)."""
    return " ".join(_ARTICLES.sub(" ", str(text).lower().translate(_PUNCT)).split())


def token_f1(prediction: str, gold: str) -> float:
    """Harmonic mean of token precision and recall after normalisation (0 when either is empty,
    1 when both are)."""
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
    if not pred or not ref:
        return float(pred == ref)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


# ---- answering benchmark questions through the agent ---------------------------------------------
# This part sits above the agent (as `rmm.eval.retrieval` sits above the bank): it drives Algorithm 1
# over a benchmark's questions.


@dataclass
class QAReport:
    dataset: str
    llm: str
    judge: str | None
    granularity: str
    simulated: bool
    overall: dict[str, Any]
    by_category: dict[str, dict[str, Any]]
    rows: list[dict[str, Any]] = field(default_factory=list)
    reranker: dict[str, Any] = field(default_factory=dict)
    frontend: str = "direct"

    def to_json(self) -> dict:
        return asdict(self)


def evaluate_qa(dataset: Dataset, bank: MemoryBank | HybridRetriever, llm: LLM, judge: LLM | None, *, granularity: str = "turn",
                limit: int | None = None, k: int = 20, m: int = 5, progress: bool = True,
                judge_batch: int = 16, frontend: str = "direct", frontend_config: ControllerConfig | None = None,
                learn: bool = True, on_trace: Callable[[FrontendTrace], None] | None = None) -> QAReport:
    """Answer each question through the agent, then judge and score per category.

    `learn=True` is the paper's online setting (Gumbel-sampled M, reranker updated from the
    citations as the questions go by); `learn=False` shows the plain top-M and updates nothing.

    The bank's sessions are the dialogue so far; questions are not dialogue, so they are not
    appended to any session. Categories the benchmark reports separately stay out of `overall`.
    `frontend="goal"` answers through GOAL-MEM goal decomposition (`rmm.frontends.goal`),
    `frontend="memr3"` through MemR³'s retrieve / reflect / answer loop (`rmm.frontends.memr3`), each
    with `frontend_config` (default: the paper's); each row then carries the question's trace, which
    `on_trace` also receives as it comes.
    """
    if frontend != "direct" and frontend not in CONTROLLERS:
        raise ValueError(f"frontend must be 'direct', {', '.join(map(repr, CONTROLLERS))}, got {frontend!r}")
    if frontend_config is not None and controller_name(frontend_config) != frontend:
        raise ValueError(f"a {type(frontend_config).__name__} configures the {controller_name(frontend_config)} "
                         f"front end, not {frontend!r}")
    simulated = isinstance(llm, SimulatedLLM)
    questions = [q for q in dataset.questions if q.answer and not q.abstention][: limit or None]
    sessions = SessionLog(":memory:")
    if simulated:
        llm.citer.reset()  # it cites the shown memories that hit gold evidence; every evaluation draws alike
    agent = Agent.over(bank, llm, k=k, m=m, learn=learn, sessions=sessions, checkpoint_every=0)
    respond = agent.respond
    if frontend != "direct":
        respond = open_controller(agent, frontend_config or CONTROLLERS[frontend].config()).respond
    scorer = GoldScorer.for_dataset(dataset, "turn")
    rows: list[dict[str, Any]] = []
    for q in tqdm(questions, desc="answering", unit="q", disable=not progress):
        gold = set(q.evidence_turns)
        if simulated:
            llm.oracle = gold_evidence_oracle(gold)
        gold_turns = {"gold": gold} if frontend == "compass" else {}  # CompassMem's oracle policy reads them
        response = respond(q.user_id, q.text, remember=False, **gold_turns)
        hits = [bool(gold & set(mem.refs)) for mem in response.cited]
        shown_units = set().union(*(scorer.units(mem.refs) for mem in response.shown)) if response.shown else set()
        rows.append({
            "id": q.id, "category": q.category, "question": q.text, "gold": q.answer,
            "prediction": None if simulated else response.answer,
            "f1": None if simulated else token_f1(response.answer, q.answer),
            "cited_precision": sum(hits) / len(hits) if hits else None,
            "shown_recall": len(shown_units & gold) / len(gold) if gold else None,
            "judge": None,
        })
        if frontend != "direct":
            rows[-1]["trace"] = response.trace.to_json()
            if on_trace is not None:
                on_trace(response.trace)
    if judge is not None and not simulated:
        _judge(rows, judge, judge_batch)
    learner = agent.learner(questions[0].user_id) if questions else None
    sessions.close()
    return _summarize(dataset, rows, llm=llm.name, judge=None if simulated or judge is None else judge.name,
                      granularity=granularity, simulated=simulated, frontend=frontend,
                      reranker=asdict(learner.stats) if learner is not None else {})


def _judge(rows: list[dict[str, Any]], judge: LLM, batch_size: int) -> None:
    from rmm.prompts import PromptParseError, judge_messages, parse_judge

    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        replies = judge.generate([judge_messages(r["question"], r["gold"], r["prediction"]) for r in chunk],
                                 max_tokens=64)
        for row, reply in zip(chunk, replies):
            try:
                verdict = parse_judge(reply)
            except PromptParseError:
                verdict = None
            row["judge"] = None if verdict is None else float(verdict)


def _summarize(dataset: Dataset, rows: list[dict[str, Any]], **meta: Any) -> QAReport:
    separate = set(SEPARATE_CATEGORIES.get(dataset.name, ()))
    by_cat: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        by_cat[row["category"]].append(row)

    def means(rs: list[dict[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {"n": len(rs)}
        for key in ("judge", "f1", "cited_precision", "shown_recall"):
            values = [r[key] for r in rs if r[key] is not None]
            out[key] = sum(values) / len(values) if values else None
        return out

    by_category = {str(c): {"name": dataset.categories.get(c, "") if c is not None else "", **means(rs)}
                   for c, rs in sorted(by_cat.items(), key=lambda kv: (kv[0] is None, kv[0] or 0))}
    overall = means([r for c, rs in by_cat.items() if c not in separate for r in rs])
    return QAReport(dataset=dataset.name, overall=overall, by_category=by_category, rows=rows, **meta)
