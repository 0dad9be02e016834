"""The online-training report: the figures `rmm train` prints, plots and writes as JSON.

The headline covers the dataset's own categories (LoCoMo 1–4 with the adversarial category 5
reported apart; MSC 1 persona and 2 followup), and every figure comes in pairs — the retriever
alone and with the learned reranker, prequential on the training stream and on held-out questions.
Every figure is read at M, the memories the generator is shown (`OnlineConfig.eval_k`, which only
a study sets lower). Beside them, the ceiling: recall@K of the K candidates the reranker reorders,
and the share of the headroom between the retriever's recall@M and that ceiling which the reranker
captured. R@T (`recall_turns@T`, recall within T dialogue turns) walks the same M memories shown,
so runs over memories of different sizes (turn, topic, session) compare at equal text shown. How
learning went is told on the same questions for both (`same_question_lift`): the
retriever alone and the reranker over the first and the last tenth of the training stream.

What needs no gold (`reward_figures`, the report's `rewards`): the cited ratio, the reward per
shown slot, and the learning curve of rewards over every rewarded question, gold or not. It is
what a run on questions without gold turn ids (a real generator's citations) can be judged by;
recall, nDCG and the headroom cover only the questions with gold.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from rmm.eval.retrieval import SEPARATE_CATEGORIES, RetrievalReport, clamped_headroom, summarize
from rmm.policy.registry import SHARED
from rmm.policy.retrieve import RerankedRetriever
from rmm.training.online_plot import running_mean
from rmm.training.splits import Split
from rmm.types import Dataset, Question

if TYPE_CHECKING:
    from rmm.training.online import OnlineTrainer

__all__ = ["OnlineReport", "build_report", "headline", "headline_questions", "headroom", "reward_figures",
           "same_question_lift", "split_summary", "turn_budget_metrics"]

Rows = dict[str, dict[str, float]]  # question id → metric → value
# Figures that vary from run to run; a simulated run's report leaves them out, so it is repeatable.
TIMINGS = ("seconds", "seconds_per_question", "questions_per_second", "completion_tokens_per_second")


@dataclass
class OnlineReport:
    retriever: dict[str, Any]
    reranker_prequential: dict[str, Any]
    retriever_heldout: dict[str, Any]
    reranker_heldout: dict[str, Any]
    reranker_heldout_whole_bank: dict[str, Any]
    citer: str
    split: str
    config: dict[str, Any]
    cited_ratio: list[float] = field(default_factory=list)
    prequential_curve: dict[str, list[float]] = field(default_factory=dict)  # running means, headline questions
    learner: dict[str, Any] = field(default_factory=dict)
    headline_questions: str = ""  # which questions the table's figures and the curves cover
    generation: dict[str, Any] = field(default_factory=dict)  # citer kind/model, parse failures, calls, tokens, speed
    staleness: dict[str, Any] = field(default_factory=dict)  # learner steps between sampling and update
    dropped_questions: int = 0  # per-user split: evidence spanning the training and held-out sessions
    headroom: dict[str, Any] = field(default_factory=dict)  # ceiling recall@K and the share captured (`headroom`)
    split_summary: str = ""  # the split in one short line (counts, a few users); `split` has every user
    split_users: dict[str, list[str]] = field(default_factory=dict)  # "train" / "heldout" → every user id
    questions: dict[str, int] = field(default_factory=dict)  # the dataset's, scorable, training, held-out
    same_questions: dict[str, Any] = field(default_factory=dict)  # `same_question_lift` of the training stream
    rewards: dict[str, Any] = field(default_factory=dict)  # `reward_figures`: what is measured without gold

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def headline_questions(dataset: Dataset) -> str:
    """Which questions the headline figures cover, in the dataset's own categories
    (e.g. LoCoMo without category 5; MSC's 1 persona and 2 followup)."""
    separate = SEPARATE_CATEGORIES.get(dataset.name, ())
    kept = sorted(c for c in dataset.categories if c not in separate)
    if not kept:
        return f"{dataset.name}, all questions"
    run = len(kept) > 2 and kept == list(range(kept[0], kept[-1] + 1))
    span = f"{kept[0]}–{kept[-1]}" if run else ", ".join(map(str, kept))
    if not separate:
        names = ", ".join(dataset.categories[c] for c in kept if dataset.categories.get(c))
        return f"{dataset.name} categories {span}" + (f" ({names})" if names and not run else "")
    left_out = ", ".join(f"{c} {dataset.categories.get(c, '')}".strip() for c in separate)
    return f"{dataset.name} categories {span}; {left_out} reported apart"


def headline(report: OnlineReport) -> list[tuple[str, float, float]]:
    """(metric, retriever, reranker) rows for the before/after table."""
    k = report.config["eval_k"]
    rows = []
    for metric in (f"recall@{k}", f"recall_any@{k}", f"ndcg@{k}"):
        rows.append((f"prequential {metric}", report.retriever.get(metric, math.nan),
                     report.reranker_prequential.get(metric, math.nan)))
    for metric, label in turn_budget_metrics(report.retriever):
        rows.append((f"prequential {label}", report.retriever[metric],
                     report.reranker_prequential.get(metric, math.nan)))
    for metric in (f"recall@{k}", f"recall_any@{k}", f"ndcg@{k}"):
        rows.append((f"held-out {metric}", report.retriever_heldout.get(metric, math.nan),
                     report.reranker_heldout.get(metric, math.nan)))
    for metric, label in turn_budget_metrics(report.retriever_heldout):
        rows.append((f"held-out {label}", report.retriever_heldout[metric],
                     report.reranker_heldout.get(metric, math.nan)))
    rows.append((f"held-out recall@{k}, whole-bank search", report.retriever_heldout.get(f"recall@{k}", math.nan),
                 report.reranker_heldout_whole_bank.get(f"recall@{k}", math.nan)))
    return rows


def turn_budget_metrics(figures: dict[str, Any]) -> list[tuple[str, str]]:
    """(key, label) of each R@T among `figures`, smallest T first: `("recall_turns@15", "R@15t")`."""
    budgets = sorted(int(key.partition("@")[2]) for key in figures if key.startswith("recall_turns@"))
    return [(f"recall_turns@{t}", f"R@{t}t") for t in budgets]


def split_summary(split: Split, per_user: bool, examples: int = 3) -> str:
    """The split in one line a person can read: counts and the first few users of each side (MSC
    holds out hundreds); every user id is in the report's `split_users` (`--json`)."""
    if per_user:
        return split.description  # counts only already

    def users(ids: list[str]) -> str:
        shown = ", ".join(ids[:examples]) + (f", … {len(ids) - examples} more" if len(ids) > examples else "")
        return f"{len(ids)} user{'s' * (len(ids) != 1)} ({shown})"

    return (f"shared reranker: train on {users(split.train_users)}, {len(split.train):,} questions; "
            f"held out {users(split.heldout_users)}, {len(split.heldout):,} questions")


def same_question_lift(rows: dict[str, Rows], questions: list[Question], metric: str,
                       share: float = 0.1) -> dict[str, Any]:
    """The retriever alone and the reranker on the same questions, over the first and the last
    `share` of the training stream (`questions` in stream order): the lift in each window compares
    like with like, so its change says whether the reranker learned. (A cited ratio of the first
    steps against the last compares different questions of a non-stationary stream.)"""
    if not questions:
        return {}
    n = max(1, int(len(questions) * share))

    def window(qs: list[Question]) -> dict[str, float]:
        return {name: sum(rows[name][q.id][metric] for q in qs) / len(qs) for name in ("retriever", "reranker")}

    return {"metric": metric, "questions": n, "stream": len(questions), "first": window(questions[:n]),
            "last": window(questions[-n:])}


def headroom(report: OnlineReport) -> dict[str, Any]:
    """Per stream (prequential, held-out): the ceiling recall@K of the candidates, recall@M of the
    retriever and of the reranker, and the share of the headroom captured (None: no headroom, or
    a report without recall@K)."""
    k, m = report.config.get("k"), report.config["eval_k"]
    out: dict[str, Any] = {"k": k, "m": m}
    for name, base, reranked in (("prequential", report.retriever, report.reranker_prequential),
                                 ("heldout", report.retriever_heldout, report.reranker_heldout)):
        ceiling, before, after = (base.get(f"recall@{k}"), base.get(f"recall@{m}"), reranked.get(f"recall@{m}"))
        captured = None
        if None not in (ceiling, before, after) and not any(map(math.isnan, (ceiling, before, after))):
            ceiling, captured = clamped_headroom(before, after, ceiling)
        out[name] = {f"retriever_recall@{k}": ceiling, f"retriever_recall@{m}": before,
                     f"reranker_recall@{m}": after, "captured": captured}
    return out


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def reward_figures(trainer: OnlineTrainer, share: float = 0.1) -> dict[str, Any]:
    """What the citations say without gold: the cited ratio (all rewarded questions, and those
    with and without gold apart), the mean reward and cited ratio at each shown slot (position 0 is
    the reranker's first pick), the running mean of the per-question mean reward over the stream
    (the learning curve), and its first and last `share`. Different questions fill the two
    windows, so a change there is a hint, not a same-question lift (recall on gold says that)."""
    rewards, gold = trainer.mean_reward, trainer.rewarded_gold
    slots = trainer.slots
    n = max(1, int(len(rewards) * share)) if rewards else 0
    cited = trainer.cited_ratio[-len(gold):] if gold else []
    with_gold = [c for c, g in zip(cited, gold) if g]
    without = [c for c, g in zip(cited, gold) if not g]
    return {
        "rewarded": len(rewards),
        "rewarded_without_gold": len(without),
        "cited_ratio": _mean(trainer.cited_ratio),
        "cited_ratio_with_gold": _mean(with_gold),
        "cited_ratio_without_gold": _mean(without),
        "reward_per_slot": [r / c if c else None for r, c in zip(slots["reward"], slots["shown"])],
        "cited_per_slot": [r / c if c else None for r, c in zip(slots["cited"], slots["shown"])],
        "reward_curve": running_mean(rewards),
        "mean_reward_first": _mean(rewards[:n]), "mean_reward_last": _mean(rewards[-n:]) if n else None,
        "window": n,
        "without_gold_trained": len({q.id for _, q in trainer.stream if not trainer.scorer.gold(q)}),
        "without_gold_heldout_unused": trainer.heldout_without_gold,
        "recall": ("recall, nDCG and the headroom need gold turn ids: they cover the "
                   f"{len(trainer.with_gold)} questions with gold only"),
    }


def build_report(trainer: OnlineTrainer) -> OnlineReport:
    """Score the held-out questions with the trained reranker(s) and assemble the whole report."""
    cfg, split = trainer.cfg, trainer.split
    held: dict[str, Rows] = {"retriever": {}, "reranker": {}, "reranker_bank": {}}
    for q in split.heldout:
        c = trainer.cands[q.id]
        held["retriever"][q.id] = trainer.score(c, list(range(len(c))), q)
        held["reranker"][q.id] = trainer.score(c, trainer.greedy(c, q.user_id), q)
    for user in dict.fromkeys(q.user_id for q in split.heldout):
        # Reranker-aware first stage: search the whole bank with the learned query transform.
        qs = [q for q in split.heldout if q.user_id == user]
        whole = RerankedRetriever(trainer.bank, trainer.learner_for(user).reranker, k=cfg.k, m=cfg.m, scope="bank")
        for q, sel in zip(qs, whole.select([q.text for q in qs], user)):
            held["reranker_bank"][q.id] = trainer.score(sel.candidates, sel.chosen, q)

    def summary(rows: Rows, qs: list[Question]) -> dict[str, Any]:
        rep: RetrievalReport = summarize(trainer.dataset, rows, qs, retriever="", granularity="turn",
                                         ks=[cfg.eval_k])
        return {**rep.overall, "by_category": rep.by_category}

    train_qs = [q for e, q in trainer.stream if e == 0 and q.id in trainer.rows["reranker"]]
    # The curves cover the questions `summarize` puts in the headline, so they end at the table's figures.
    separate = set(SEPARATE_CATEGORIES.get(trainer.dataset.name, ()))
    metric = f"recall@{cfg.eval_k}"
    headline_stream = [q for q in train_qs if q.category not in separate]
    curve = {name: running_mean([rows[q.id][metric] for q in headline_stream])
             for name, rows in trainer.rows.items()}
    learners = {k: asdict(learner.stats) for k, learner in trainer.learners.items()}
    report = OnlineReport(
        retriever=summary(trainer.rows["retriever"], train_qs),
        reranker_prequential=summary(trainer.rows["reranker"], train_qs),
        retriever_heldout=summary(held["retriever"], split.heldout),
        reranker_heldout=summary(held["reranker"], split.heldout),
        reranker_heldout_whole_bank=summary(held["reranker_bank"], split.heldout),
        citer=_citer_label(trainer), split=split.description, config=asdict(cfg),
        cited_ratio=trainer.cited_ratio, prequential_curve=curve,
        learner=learners if cfg.per_user else learners.get(SHARED, {}),
        headline_questions=headline_questions(trainer.dataset), generation=_generation(trainer),
        staleness=_staleness(trainer), dropped_questions=len(split.dropped),
        split_summary=split_summary(split, cfg.per_user),
        split_users={"train": list(split.train_users), "heldout": list(split.heldout_users)},
        questions={"dataset": len(trainer.dataset.questions),
                   "scorable": len(trainer.with_gold),
                   "without_gold_trained": len({q.id for _, q in trainer.stream if not trainer.scorer.gold(q)}),
                   "train": len(train_qs), "heldout": len(split.heldout), "dropped": len(split.dropped)},
        same_questions=same_question_lift(trainer.rows, headline_stream, metric),
        rewards=reward_figures(trainer),
    )
    report.headroom = headroom(report)
    return report


def _citer_label(trainer: OnlineTrainer) -> str:
    cfg = trainer.cfg
    if trainer.kind == "simulated":
        return f"simulated (precision {cfg.precision}, recall {cfg.recall})"
    return cfg.citer + (" (structured)" if cfg.structured else "")


def _generation(trainer: OnlineTrainer) -> dict[str, Any]:
    """Citer kind and model, replies and parse failures; for a real generator its calls, tokens,
    speed and how many questions were in flight."""
    cfg, stats = trainer.cfg, trainer.stats
    figures = {"kind": trainer.kind, "model": _model(cfg.citer, trainer.kind), **asdict(stats), **stats.summary()}
    if trainer.kind == "simulated":  # nothing is generated; timings would only make the report unrepeatable
        return {k: v for k, v in figures.items() if k not in TIMINGS and "token" not in k and k != "llm_calls"}
    calls, per_call = trainer.in_flight_limit()
    return {**figures, "concurrency": calls * per_call, "calls_in_flight": calls, "questions_per_call": per_call,
            "structured": cfg.structured}


def _model(spec: str, kind: str) -> str:
    if kind == "simulated":
        return "simulated"
    rest = spec.partition(":")[2]
    return rest.rpartition("@")[2] if kind == "openai" and "@" in rest else rest


def _staleness(trainer: OnlineTrainer) -> dict[str, Any]:
    """Learner updates between a selection's sampling and the delivery of its rewards."""
    n = trainer.staleness["updates"]
    return {"delay": trainer.cfg.delay, "rewarded": n, "mean_steps": trainer.staleness["sum"] / n if n else 0.0,
            "max_steps": trainer.staleness["max"]}
