"""Recall@K evaluation of a retriever on a benchmark, per category and overall, with R@T (recall
within a budget of T dialogue turns shown, `rmm.eval.metrics.recall_at_turns`) beside it.

This module sits above the bank (it builds one document set per user and searches it); the pure
metric functions live in `rmm.eval.metrics`. A question is only searched against its own user's
memories, and questions without gold evidence at the chosen granularity are skipped (counted).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

from tqdm.auto import tqdm

from rmm.eval.metrics import TURN_BUDGETS, aggregate, score_question, score_turn_budgets
from rmm.policy.reranker import candidate_subset
from rmm.types import Candidates, Dataset, Memory, Question, Retriever

log = logging.getLogger(__name__)

# LoCoMo's adversarial category has no answer in the conversation by design; the benchmark's
# convention (and ours) is to report it beside, not inside, the headline number.
SEPARATE_CATEGORIES: dict[str, tuple[int, ...]] = {"locomo": (5,)}


@dataclass
class GoldScorer:
    """Maps retrieved memories to gold units: turn ids (turn/topic) or session ids (session)."""

    granularity: str
    turn_session: dict[str, str]

    @classmethod
    def for_dataset(cls, dataset: Dataset, granularity: str) -> GoldScorer:
        mapping = {t.id: s.id for sessions in dataset.sessions.values() for s in sessions for t in s.turns}
        return cls(granularity, mapping)

    def gold(self, question: Question) -> set[str]:
        return set(question.evidence_sessions if self.granularity == "session" else question.evidence_turns)

    def units(self, refs: Iterable[str]) -> set[str]:
        if self.granularity == "session":
            return {self.turn_session[r] for r in refs if r in self.turn_session}
        return set(refs)

    def score(self, ranked_refs: Sequence[Iterable[str]], question: Question, ks: Sequence[int],
              n_relevant: int | None = None, budgets: Sequence[int] = TURN_BUDGETS) -> dict[str, float]:
        """Every metric at every k on this granularity's gold units, and R@T at every turn budget on the
        gold turns (`recall_turns@T`; whatever the granularity, so memories of any size compare)."""
        refs = [list(r) for r in ranked_refs]
        row = score_question([self.units(r) for r in refs], self.gold(question), ks, n_relevant)
        row.update(self.turn_budgets(refs, question, budgets))
        return row

    @staticmethod
    def turn_budgets(ranked_refs: Sequence[Iterable[str]], question: Question,
                     budgets: Sequence[int] = TURN_BUDGETS) -> dict[str, float]:
        """R@T alone (`recall_turns@T`) of memories given by their turn refs, best first; `{}` for a
        question without gold turns."""
        return score_turn_budgets([list(r) for r in ranked_refs], question.evidence_turns, budgets)


def headroom_captured(reranked_at_m: float, base_at_m: float, base_at_k: float) -> float | None:
    """Share of the headroom the reranker captured: (reranked R@M − base R@M) / (base R@K − base R@M).

    A reranker of the top-K can at best bring every gold memory of the K candidates into the top M,
    so base R@K is its ceiling. 1 = all of it, 0 = none, negative = it lost ground. None when there is
    no headroom (base R@K = base R@M): nothing could be captured, and a ratio would divide by zero.
    """
    if base_at_k < base_at_m:
        raise ValueError(f"recall@K ({base_at_k}) below recall@M ({base_at_m}): K must be the larger cut-off")
    room = base_at_k - base_at_m
    if room <= 1e-12:
        return None
    return (reranked_at_m - base_at_m) / room


def clamped_headroom(before: float, after: float, at_k: float) -> tuple[float, float | None]:
    """The ceiling recall@K, clamped to at least recall@M (true for every question; only float
    summation over questions could say otherwise), and the share of headroom captured up to it."""
    ceiling = max(at_k, before)
    return ceiling, headroom_captured(after, before, ceiling)


def headroom_by_cutoff(base: RetrievalReport, reranked: RetrievalReport) -> dict[str, dict[str, float | None]]:
    """For each cut-off M below the ceiling K: the retriever's and the reranked recall@M, the
    ceiling recall@K (the retriever's) and the share of headroom captured (None: no headroom)."""
    k = base.ceiling
    out: dict[str, dict[str, float | None]] = {}
    if k is None or f"recall@{k}" not in base.overall:
        return out
    for m in base.ks:
        if m >= k:
            continue
        before, after = base.overall[f"recall@{m}"], reranked.overall[f"recall@{m}"]
        ceiling, captured = clamped_headroom(before, after, base.overall[f"recall@{k}"])
        out[f"recall@{m}"] = {"retriever": before, "reranked": after, f"ceiling_recall@{k}": ceiling,
                              "captured": captured}
    return out


def scorable(questions: Iterable[Question], scorer: GoldScorer) -> list[Question]:
    return [q for q in questions if scorer.gold(q) and not q.abstention]


@dataclass
class RetrievalReport:
    dataset: str
    retriever: str
    granularity: str
    ks: list[int]
    overall: dict[str, float]
    by_category: dict[str, dict[str, float | str | int]]
    separate: dict[str, dict[str, float | str | int]] = field(default_factory=dict)
    skipped: int = 0
    ceiling: int | None = None  # K of the candidate set a reranker reorders; recall@K is in every row
    headroom: dict[str, dict[str, float | None]] = field(default_factory=dict)  # a reranked report's, per cut-off
    turn_budgets: list[int] = field(default_factory=list)  # T of each `recall_turns@T` (dialogue turns shown)

    def ceiling_recall(self) -> float | None:
        """Headline recall@K of the top-K candidates: the most any reordering of them can reach."""
        return None if self.ceiling is None else self.overall.get(f"recall@{self.ceiling}")

    def to_json(self) -> dict:
        return asdict(self)


def summarize(dataset: Dataset, rows: dict[str, dict[str, float]], questions: Sequence[Question],
              **meta) -> RetrievalReport:
    """Means per category, a headline over the non-separate categories, separate ones beside it."""
    separate = set(SEPARATE_CATEGORIES.get(dataset.name, ()))
    per_cat: dict[int | None, list[dict[str, float]]] = defaultdict(list)
    for q in questions:
        if q.id in rows:
            per_cat[q.category].append(rows[q.id])
    by_category = {
        str(c): {"name": dataset.categories.get(c, str(c)) if c is not None else "all", "n": len(r), **aggregate(r)}
        for c, r in sorted(per_cat.items(), key=lambda kv: (kv[0] is None, kv[0] or 0))
    }
    headline = [r for c, rs in per_cat.items() if c not in separate for r in rs]
    overall = {"n": len(headline), **aggregate(headline)}
    return RetrievalReport(dataset=dataset.name, overall=overall, by_category=by_category,
                           separate={k: v for k, v in by_category.items() if int(k) in separate}
                           if separate else {}, **meta)


Rank = Callable[[list[Candidates]], list[list[str]]]
"""Reorders each query's candidates (e.g. a reranker): their memory ids, best first."""


def evaluate(dataset: Dataset, retriever: Retriever, granularity: str, ks: Sequence[int] = (5, 10), *,
             retriever_name: str = "", batch_size: int = 256, progress: bool = True, rank: Rank | None = None,
             ceiling: int | None = None) -> RetrievalReport:
    """Search every scorable question in its user's bank and score the top max(ks).

    `rank` may reorder each query's candidates (e.g. a reranker); by default the retriever's order.
    `ceiling` K also scores recall@K (and the other metrics at K): the ceiling of a reranker of the
    top K, reported beside the cut-offs `ks`.
    """
    (report,) = evaluate_orders(dataset, retriever, granularity, ks, {retriever_name: rank}, batch_size=batch_size,
                                progress=progress, ceiling=ceiling).values()
    return report


def evaluate_orders(dataset: Dataset, retriever: Retriever, granularity: str, ks: Sequence[int],
                    orders: Mapping[str, Rank | None], *, batch_size: int = 256, progress: bool = True,
                    ceiling: int | None = None, budgets: Sequence[int] = TURN_BUDGETS) -> dict[str, RetrievalReport]:
    """One report per entry of `orders` (name → `rank`, None = the retriever's order), all scored from
    one search per question: the retriever's top max(ks, ceiling) is searched once and each order of
    it scored, so the reports differ by their order only (a reranked report and its base run's).

    R@T (`budgets`, in dialogue turns) may need more memories than that (25 turn memories for
    T = 25), so the search goes max(budgets) deep; a `rank` still reorders only the top max(ks,
    ceiling), and the rest of the list follows in the retriever's order (the usual reading of a
    reranker of the top K), so every order walks a list long enough to fill each budget."""
    scorer = GoldScorer.for_dataset(dataset, granularity)
    questions = scorable(dataset.questions, scorer)
    skipped = len(dataset.questions) - len(questions)
    if skipped:
        log.info("skipping %d questions without gold evidence at %s granularity", skipped, granularity)
    by_user: dict[str, list[Question]] = defaultdict(list)
    for q in questions:
        by_user[q.user_id].append(q)
    rows: dict[str, dict[str, dict[str, float]]] = {name: {} for name in orders}
    refs_cache: dict[tuple[str, str], list[str]] = {}
    scored = sorted(set(ks) | ({ceiling} if ceiling else set()))
    depth = max(scored)  # what a `rank` reorders
    search_depth = max([depth, *budgets])  # each memory costs at least one turn: enough to fill any budget
    bar = tqdm(total=len(questions), desc=f"eval {' / '.join(orders) or 'retriever'} ({granularity})",
               disable=not progress, unit="q")
    for user, qs in by_user.items():
        for start in range(0, len(qs), batch_size):
            chunk = qs[start:start + batch_size]
            results = retriever.search([q.text for q in chunk], user, search_depth)
            head = [c if len(c) <= depth else candidate_subset(c, range(depth)) for c in results]
            for name, rank in orders.items():
                ranked_ids = ([ids + c.memory_ids[depth:] for ids, c in zip(rank(head), results)] if rank
                              else [c.memory_ids for c in results])
                missing = [m for ids in ranked_ids for m in ids if (user, m) not in refs_cache]
                if missing:
                    refs_cache.update({(user, m.id): m.refs for m in _get_memories(retriever, user, missing)})
                for q, ids in zip(chunk, ranked_ids):
                    rows[name][q.id] = scorer.score([refs_cache[(user, m)] for m in ids[:search_depth]], q, scored,
                                                    budgets=budgets)
            bar.update(len(chunk))
    bar.close()
    return {name: summarize(dataset, rows[name], questions, retriever=name, granularity=granularity, ks=list(ks),
                            skipped=skipped, ceiling=ceiling, turn_budgets=list(budgets)) for name in orders}


def _get_memories(retriever: Retriever, user: str, ids: list[str]) -> list[Memory]:
    """The memories behind retrieved ids (both the bank and BM25 expose their store)."""
    store = getattr(retriever, "store", None)
    if store is None:
        raise TypeError(f"{type(retriever).__name__} exposes no `store` to map results back to memories")
    return store.get(user, list(dict.fromkeys(ids)))
