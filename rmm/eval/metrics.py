"""Retrieval metrics over gold *units* (turn ids or session ids), per question.

Each retrieved memory is given as the set of gold-unit ids it covers (a turn memory covers its
turn, a session memory its session, a topic memory every turn in its `refs`), so one function
serves every granularity: the evaluator maps memories to units, these functions only count.

Definitions (K = k, top = the first k retrieved memories, or all of them when fewer):
- `recall_at_k`: share of the gold units covered by `top` (the LoCoMo paper's fractional recall).
  A unit covered by several memories counts once.
- `recall_any_at_k` / `recall_all_at_k`: 1.0 if at least one / every gold unit is covered.
- `ndcg_at_k`: LongMemEval's nDCG with binary relevance (`src/retrieval/eval_utils.py`): the
  DCG discount is 1 at rank 1 and log2(rank) from rank 2 on, and the ideal DCG puts
  `n_relevant` relevant items (default: one per gold unit) at the top ranks.

Equal-turn-budget recall (`recall_at_turns`, reported as R@T beside R@K): memories differ in size
(a turn memory shows one dialogue turn, a session memory all of its turns, a topic or an event the
turns in its refs, a graph walk whatever it visited), so R@K rewards a memory for showing more text.
R@T compares them at the same number of dialogue turns shown. Walk the ranking in order; each
memory costs the number of distinct turns it shows (its refs; a memory with no refs still costs 1:
it is shown); include memories while the cumulative cost stays ≤ T. The first memory that would
cross T is excluded and the walk stops there, so the included memories are the longest prefix of
the ranking that fits — the analogue of R@K's top-k prefix, and what a system that fills a turn
budget in rank order would show. No partial memories: a memory is shown whole or not at all, and
which of its turns a cut would keep is not defined by a ranking, so crediting part of it would
count turns that no reader of the budget saw. A memory larger than T therefore never counts (a
LoCoMo session of ~20 turns at T = 15 scores 0). The score is the same fractional recall as R@K,
over gold *turns*: the share of the gold evidence turns covered by the included memories' refs.

An empty gold set has no defined recall: every function raises `ValueError`, and the evaluator
skips such questions (LoCoMo has 4 of them; LongMemEval's abstention questions are excluded).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence

RankedUnits = Sequence[Collection[str]]

TURN_BUDGETS: tuple[int, ...] = (15, 25)
"""The turn budgets T of R@T every evaluation reports beside R@K (dialogue turns shown)."""


def _check(gold: Collection[str], k: int) -> set[str]:
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    gold_set = set(gold)
    if not gold_set:
        raise ValueError("gold is empty: recall is undefined (skip questions without evidence)")
    return gold_set


def _covered(ranked: RankedUnits, gold: set[str], k: int) -> set[str]:
    covered: set[str] = set()
    for units in ranked[:k]:
        covered.update(gold.intersection(units))
    return covered


def recall_at_k(ranked: RankedUnits, gold: Collection[str], k: int) -> float:
    """Fraction of the gold units covered by the top k memories."""
    gold_set = _check(gold, k)
    return len(_covered(ranked, gold_set, k)) / len(gold_set)


def recall_any_at_k(ranked: RankedUnits, gold: Collection[str], k: int) -> float:
    """1.0 if any gold unit is covered by the top k memories, else 0.0."""
    gold_set = _check(gold, k)
    return 1.0 if _covered(ranked, gold_set, k) else 0.0


def recall_all_at_k(ranked: RankedUnits, gold: Collection[str], k: int) -> float:
    """1.0 if every gold unit is covered by the top k memories, else 0.0."""
    gold_set = _check(gold, k)
    return 1.0 if _covered(ranked, gold_set, k) == gold_set else 0.0


def turn_cost(refs: Collection[str]) -> int:
    """Dialogue turns a memory shows: its distinct refs, at least 1 (a memory with none is still shown)."""
    return max(1, len(set(refs)))


def within_turns(ranked_refs: Sequence[Collection[str]], budget: int) -> list[Collection[str]]:
    """The longest prefix of the ranking whose memories show at most `budget` dialogue turns in all
    (the memory that would cross the budget ends the walk, excluded: no partial memories)."""
    if budget < 1:
        raise ValueError(f"the turn budget must be at least 1, got {budget}")
    shown: list[Collection[str]] = []
    spent = 0
    for refs in ranked_refs:
        spent += turn_cost(refs)
        if spent > budget:
            break
        shown.append(refs)
    return shown


def recall_at_turns(ranked_refs: Sequence[Collection[str]], gold_turns: Collection[str], budget: int) -> float:
    """R@T: share of the gold turns covered by the ranked memories that fit a budget of T dialogue
    turns (`within_turns`). `ranked_refs` are each memory's turn refs, best first; `gold_turns` the
    question's evidence turns (turn ids at every granularity, so sizes compare)."""
    gold_set = _check(gold_turns, budget)
    shown = within_turns(ranked_refs, budget)
    return len(_covered(shown, gold_set, len(shown))) / len(gold_set) if shown else 0.0


def score_turn_budgets(ranked_refs: Sequence[Collection[str]], gold_turns: Collection[str],
                       budgets: Sequence[int] = TURN_BUDGETS) -> dict[str, float]:
    """R@T at every budget, keyed `"recall_turns@{T}"`; `{}` without gold turns (a question with
    only session-level evidence has no turn recall, and is left out of R@T's means)."""
    if not set(gold_turns):
        return {}
    return {f"recall_turns@{t}": recall_at_turns(ranked_refs, gold_turns, t) for t in budgets}


def _dcg(relevances: Sequence[float], discount: str) -> float:
    if discount == "longmemeval":
        # LongMemEval / Järvelin–Kekäläinen: rank 1 undiscounted, rank i >= 2 divided by log2(i).
        return sum(rel if i == 0 else rel / math.log2(i + 1) for i, rel in enumerate(relevances))
    if discount == "standard":
        return sum(rel / math.log2(i + 2) for i, rel in enumerate(relevances))
    raise ValueError(f"discount must be 'longmemeval' or 'standard', got {discount!r}")


def ndcg_at_k(
    ranked: RankedUnits,
    gold: Collection[str],
    k: int,
    n_relevant: int | None = None,
    *,
    unique_coverage: bool = True,
    discount: str = "longmemeval",
) -> float:
    """Binary-relevance nDCG@k with the ideal DCG of `n_relevant` relevant items.

    A memory is relevant if it covers a gold unit. With `unique_coverage` (default) it is only
    relevant if it covers a gold unit no higher-ranked memory already covered, so duplicates
    (two topic memories citing the same turn) cannot push the score past what one retrieval of
    each gold unit earns; for one-unit-per-memory rankings (LongMemEval's turn and session
    documents) both readings are identical. `n_relevant` defaults to the number of gold units,
    which is LongMemEval's ideal (every relevant corpus document at the top); pass the number
    of relevant memories in the bank when that differs. The result is clipped to 1.0.
    """
    gold_set = _check(gold, k)
    n_ideal = len(gold_set) if n_relevant is None else n_relevant
    if n_ideal < 1:
        raise ValueError(f"n_relevant must be at least 1, got {n_relevant}")
    relevances: list[float] = []
    seen: set[str] = set()
    for units in ranked[:k]:
        hits = gold_set.intersection(units)
        if unique_coverage:
            new = hits - seen
            seen |= hits
            relevances.append(1.0 if new else 0.0)
        else:
            relevances.append(1.0 if hits else 0.0)
    ideal = _dcg([1.0] * min(n_ideal, k), discount)
    return min(1.0, _dcg(relevances, discount) / ideal)


METRICS: dict[str, Callable[[RankedUnits, Collection[str], int], float]] = {
    "recall": recall_at_k,
    "recall_any": recall_any_at_k,
    "recall_all": recall_all_at_k,
    "ndcg": ndcg_at_k,
}


def score_question(
    ranked: RankedUnits,
    gold: Collection[str],
    ks: Sequence[int] = (5, 10),
    n_relevant: int | None = None,
) -> dict[str, float]:
    """Every metric at every k for one question, keyed `"{metric}@{k}"` (e.g. `recall_any@5`)."""
    row: dict[str, float] = {}
    for k in ks:
        for name, fn in METRICS.items():
            if fn is ndcg_at_k:
                row[f"{name}@{k}"] = ndcg_at_k(ranked, gold, k, n_relevant)
            else:
                row[f"{name}@{k}"] = fn(ranked, gold, k)
    return row


def aggregate(rows: list[dict[str, float]]) -> dict[str, float]:
    """Mean of each key over the rows that have it (keys in first-seen order); `{}` for no rows."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for row in rows:
        for key, value in row.items():
            sums[key] = sums.get(key, 0.0) + float(value)
            counts[key] = counts.get(key, 0) + 1
    return {key: sums[key] / counts[key] for key in sums}
