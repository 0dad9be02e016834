"""CompassMem on LoCoMo's held-out conversations: flat events vs flat topics, graph search vs direct
retrieval at the same turn budget, the oracle ceiling, the reranker's lift inside the search, the
graph step's CPU time, the build time and the graph's structure beside the paper's.

    python -m rmm.bench.compass --threads 1 [--retriever hybrid] [--threshold 0.3] [--json FILE]
    python -m rmm.bench.compass --threads 1 --users train --no-learn --no-build   # tuning

Users: `rmm train`'s shared-mode split (`rmm.training.splits.hold_out_users`, `--heldout 0.3
--seed 0`): conv-30, conv-48 and conv-49 are held out and only read; the other seven are the
training conversations (every setting of the heuristic walk was chosen on them, with `--users
train`, which reads them instead of the held-out ones; the reranker of the "learned" rows is
trained on their questions, so `--users train` runs without those rows). Memories: the LLM-free fallback event graph
(`rmm eval --granularity event`) and the fallback topic bank (`--granularity topic`), the
`--retriever` first stage (default `hybrid`: BM25 + MiniLM, fused). Every recall is R@T
(`rmm.eval.metrics.recall_at_turns`, T = 15 and 25 dialogue turns), per LoCoMo category 1-4 and
over them ("all"; category 5, adversarial, is left out as LoCoMo reports it apart).

Rows:

* flat event / flat topic: one query, the first stage's ranking (as `rmm eval --granularity
  event topic` scores it);
* direct / heuristic / oracle: `rmm eval-controller --frontend compass --policy P` — the search's
  kept nodes in the order it hands them to the responder vs one direct reranked query with as many
  events (its rank order), both cut at T turns; the reranker untrained (identity start), no
  learning; `--first-walk` adds the heuristic walk as first written (the reranker's score alone,
  the paper's slate of 5 over 5 topics, keep order: `FIRST_WALK`);
* learned: the reranker first trained online over the training conversations' questions (the
  heuristic search answering through the simulated citer, which cites shown nodes that hold gold
  turns with the paper's precision/recall; +1 / -1 per shown node of every sampled slate, as the
  search records them), then frozen and the held-out questions read with it: heuristic and direct
  again. Train-then-read, not prequential: no held-out question is learned from.

Beside the tables: each search's gain over its direct query per category with the paired standard
error of that mean (`paired_gain`: the same questions under both arms), and how the graph links the
read questions' gold evidence (`gold_linkage`: events holding gold per question, questions whose
gold lies in two or more events, and the share of gold events with an edge to another gold event —
what one hop from evidence can reach).

Timing (`time.process_time`, one torch thread): the graph walk alone (`CompassFrontend._explore`:
queue, neighbour reads, neighbour slates, scores — no first-stage retrieval) and the per-question
topic-layer read (`_topics`), per question; the build of each conversation's fallback event graph
vs its fallback topic bank, in fresh banks, wall seconds. Structure: events per session, turns and
words per event, out-edges per event, over all ten conversations, beside what the paper states
(6-10 events asked per session; events of about 100 tokens; it reports no edge count).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rmm.eval.metrics import TURN_BUDGETS
from rmm.frontends.compass import CompassConfig, CompassFrontend
from rmm.training.splits import split_users_in_order
from rmm.types import Dataset, Question

log = logging.getLogger(__name__)

CATEGORIES: tuple[int, ...] = (1, 2, 3, 4)
COLUMNS: tuple[str, ...] = (*map(str, CATEGORIES), "all")  # the tables' columns
USERS: tuple[str, ...] = ("heldout", "train")
# The heuristic walk as first written: the reranker's score alone, the paper's slate, the order kept.
FIRST_WALK: dict[str, Any] = {"start_k": 5, "topics": 5, "seeds": 5, "lookahead": 0.0, "opener": 0.0,
                              "diversity": None}
PAPER = {"events_per_session": "6-10 (asked of the LLM)", "tokens_per_event": "~100 (App.: the chunk ablation's size)",
         "edges_per_event": "not reported"}


class TimedCompass(CompassFrontend):
    """The CompassMem search with the CPU time of its graph walk and of its topic-layer read recorded
    per question (process time: one torch thread makes it this search's alone)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.walk_seconds: list[float] = []
        self.topic_seconds: list[float] = []

    def _explore(self, q: Any) -> None:
        started = time.process_time()
        try:
            super()._explore(q)
        finally:
            self.walk_seconds.append(time.process_time() - started)

    def _topics(self, user: str) -> dict[str, str]:
        started = time.process_time()
        try:
            return super()._topics(user)
        finally:
            self.topic_seconds.append(time.process_time() - started)


@dataclass
class SearchRun:
    """One policy over the held-out questions: per-question R@T of the search and of the direct query."""

    name: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    walk_ms: list[float] = field(default_factory=list)  # per question (summed over refinement rounds)
    topic_ms: list[float] = field(default_factory=list)
    table4: dict[str, float] = field(default_factory=dict)  # the paper's Table 4 over the questions' traces


def subset(dataset: Dataset, users: Sequence[str]) -> Dataset:
    """The dataset restricted to `users` (their sessions and questions)."""
    keep = set(users)
    return Dataset(dataset.name, {u: s for u, s in dataset.sessions.items() if u in keep},
                   [q for q in dataset.questions if q.user_id in keep], dict(dataset.categories))


def scorable(dataset: Dataset, limit: int | None = None) -> list[Question]:
    """The questions eval-controller scores: gold turns, not abstentions (and categories 1-4 here);
    the first `limit` of them when given."""
    found = [q for q in dataset.questions if q.evidence_turns and not q.abstention and q.category in CATEGORIES]
    return found[: limit or None]


def _direct(agent: Any, question: Question, n: int) -> list[str]:
    """One reranked query with the question, its top-n distinct events (as `rmm eval-controller`'s direct arm)."""
    if n == 0 or not agent.bank.store.has_user(question.user_id):
        return []
    retriever = agent.retriever(question.user_id, k=max(agent.k, n), m=min(agent.m, n))
    (found,) = retriever.search([question.text], question.user_id, n)
    return list(dict.fromkeys(found.memory_ids))[:n]


def _refs(bank: Any, user: str, ids: list[str]) -> list[list[str]]:
    found = {m.id: m.refs for m in bank.get(user, ids)} if ids else {}
    return [found[i] for i in ids if i in found]


def run_search(name: str, dataset: Dataset, retriever: Any, config: CompassConfig, *, learner: Any = None,
               k: int = 20, m: int = 5, budgets: Sequence[int] = TURN_BUDGETS, limit: int | None = None) -> SearchRun:
    """The search (kept nodes, in the order kept) vs one direct query with as many events, each cut at
    T turns, per held-out question; learning off, with `learner`'s reranker (default: a fresh one)."""
    from rmm.eval.retrieval import GoldScorer
    from rmm.frontends.agent import Agent
    from rmm.frontends.compass_trace import table4
    from rmm.llm.simulated import SimulatedLLM
    from rmm.memory.sessions import SessionLog

    scorer = GoldScorer.for_dataset(dataset, "turn")
    sessions = SessionLog(":memory:")
    options = {"learner": learner} if learner is not None else {}
    agent = Agent.over(retriever, SimulatedLLM(), k=k, m=m, learn=False, sessions=sessions, checkpoint_every=0,
                       **options)
    frontend = TimedCompass(agent, config)
    run = SearchRun(name)
    traces = []
    try:
        for q in scorable(dataset, limit):
            frontend.walk_seconds.clear()
            frontend.topic_seconds.clear()
            response = frontend.respond(q.user_id, q.text, remember=False, gold=set(q.evidence_turns))
            union = response.trace.retrieved
            direct = _direct(agent, q, len(union))
            row: dict[str, Any] = {"id": q.id, "category": q.category, "n_memories": len(union),
                                   "kept": len(response.trace.kept), "steps": len(response.trace.steps)}
            for arm, ids in (("search", union), ("direct", direct)):
                turns = scorer.turn_budgets(_refs(agent.bank, q.user_id, ids), q, budgets)
                row.update({f"{key}_{arm}": value for key, value in turns.items()})
            run.rows.append(row)
            traces.append(response.trace)
            run.walk_ms.append(1000 * sum(frontend.walk_seconds))
            run.topic_ms.append(1000 * sum(frontend.topic_seconds))
    finally:
        sessions.close()
    run.table4 = table4(traces)
    return run


def train_reranker(dataset: Dataset, retriever: Any, config: CompassConfig, *, k: int = 20,
                   m: int = 5, limit: int | None = None) -> tuple[Any, dict[str, Any]]:
    """A reranker trained online by the search over `dataset`'s questions (the training conversations):
    the simulated citer answers from the kept nodes, each sampled slate learns from what it cites."""
    from dataclasses import replace

    from rmm.frontends.agent import Agent
    from rmm.llm.simulated import SimulatedLLM, gold_evidence_oracle
    from rmm.memory.sessions import SessionLog

    llm = SimulatedLLM()
    sessions = SessionLog(":memory:")
    agent = Agent.over(retriever, llm, k=k, m=m, learn=True, sessions=sessions, checkpoint_every=0)
    frontend = CompassFrontend(agent, replace(config, answer=True))
    questions = scorable(dataset, limit)
    t0 = time.perf_counter()
    try:
        for q in questions:
            llm.oracle = gold_evidence_oracle(q.evidence_turns)
            frontend.respond(q.user_id, q.text, remember=False, gold=set(q.evidence_turns))
    finally:
        sessions.close()
    learner = agent.learner(questions[0].user_id)
    learner.flush()
    return learner, {"questions": len(questions), "seconds": time.perf_counter() - t0, **asdict(learner.stats)}


def _per_category(rows: list[dict[str, Any]], value: Any) -> dict[str, list[float]]:
    """`value(row)` of every row, grouped by its category and all together ("all")."""
    groups: dict[str, list[float]] = defaultdict(list)
    for row in rows:
        groups[str(row["category"])].append(value(row))
        groups["all"].append(value(row))
    return groups


def by_category(rows: list[dict[str, Any]], key: str) -> dict[str, float]:
    """Mean of `key` (in %) per category and over categories 1-4 ("all")."""
    return {c: 100 * statistics.mean(v) for c, v in _per_category(rows, lambda row: float(row[key])).items()}


def paired_gain(rows: list[dict[str, Any]], key: str) -> dict[str, dict[str, float]]:
    """The search's gain over the direct query on `key` (e.g. ``recall_turns@15``), in points, per
    category and over categories 1-4: its mean, the standard error of that mean (paired: both arms read
    the same questions) and the number of questions. A gain within about two standard errors of zero
    is one the questions cannot tell from none."""
    groups = _per_category(rows, lambda row: 100 * (float(row[f"{key}_search"]) - float(row[f"{key}_direct"])))
    return {c: {"mean": statistics.mean(v), "se": statistics.stdev(v) / len(v) ** 0.5 if len(v) > 1 else float("nan"),
                "n": float(len(v))} for c, v in groups.items()}


def gold_linkage(dataset: Dataset, store: Any, limit: int | None = None) -> dict[str, dict[str, float]]:
    """How the graph links each question's gold evidence, per category and over 1-4: the events holding
    a gold turn per question (`gold_events`), the share of questions whose gold lies in two or more
    events (`spread`), and the share of gold events with an edge, either direction, to another gold
    event of the same question (`linked`): the evidence a walk can reach in one hop from evidence.
    Over `scorable(dataset, limit)`, the questions the searches read."""
    by_user: dict[str, list[Any]] = {}
    groups: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for question in scorable(dataset, limit):
        user = question.user_id
        if user not in by_user:
            by_user[user] = store.memories(user) if store.has_user(user) else []
        gold = set(question.evidence_turns)
        events = {m.id for m in by_user[user] if gold & set(m.refs)}
        linked = 0
        for event in events:
            others = {e.other(event) for e in store.neighbours(user, event, "both")}
            linked += bool(others & (events - {event}))
        for group in (str(question.category), "all"):
            cells = groups[group]
            cells["gold_events"].append(len(events))
            cells["spread"].append(float(len(events) >= 2))
            cells["linked_events"].append(linked)
    return {c: {"gold_events": statistics.mean(v["gold_events"]), "spread": 100 * statistics.mean(v["spread"]),
                "linked": 100 * sum(v["linked_events"]) / max(sum(v["gold_events"]), 1)} for c, v in groups.items()}


def flat_recall(dataset: Dataset, retriever: Any, granularity: str, name: str) -> dict[str, dict[str, float]]:
    """The first stage's own ranking, R@T per category (as `rmm eval --granularity G` scores it)."""
    from rmm.eval.retrieval import evaluate_orders

    (report,) = evaluate_orders(dataset, retriever, granularity, (5, 10), {name: None}, progress=False).values()
    out: dict[str, dict[str, float]] = {}
    for t in TURN_BUDGETS:
        key = f"recall_turns@{t}"
        cats = {c: 100 * float(row[key]) for c, row in report.by_category.items() if int(c) in CATEGORIES}
        out[key] = {**cats, "all": 100 * float(report.overall[key])}
    return out


def build_times(dataset: Dataset, users: Sequence[str], encoder: Any, cache: str | None) -> dict[str, Any]:
    """Each conversation's fallback event graph and fallback topic bank built in fresh banks: wall
    seconds of both, and the graph's structure."""
    from rmm.bench.compass_build import build_both, totals
    from rmm.eval.benchmark_bank import passage_cache

    with tempfile.TemporaryDirectory() as tmp, passage_cache(encoder, cache):
        rows = [build_both(dataset, user, encoder, Path(tmp)) for user in users]
    words = [w for r in rows for w in r.pop("event_words")]
    summed = totals(rows)
    summed.pop("merged")
    return {**summed, "words_per_event": statistics.mean(words), "paper": PAPER}


def _ms(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    if not ordered:
        return {}
    return {"mean": statistics.mean(ordered), "p50": ordered[len(ordered) // 2],
            "p95": ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))], "max": ordered[-1]}


def _line(label: str, cells: dict[str, float]) -> str:
    return f"{label:<34}" + "".join(f"{cells.get(c, float('nan')):>8.1f}" for c in COLUMNS)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", default="locomo")
    parser.add_argument("--retriever", default="hybrid", help="first stage: hybrid (BM25 + MiniLM), minilm, …")
    parser.add_argument("--threshold", type=float, default=0.3,
                        help="the heuristic's walk-score threshold (0.3: chosen on the training conversations)")
    parser.add_argument("--users", choices=USERS, default="heldout",
                        help="whose questions are read: heldout (the figures) or train (tuning; needs --no-learn)")
    parser.add_argument("--first-walk", action="store_true",
                        help="add the heuristic walk as first written (reranker score alone, keep order)")
    parser.add_argument("--heldout", type=float, default=0.3, help="rmm train's --heldout (users held out)")
    parser.add_argument("--seed", type=int, default=0, help="rmm train's --seed")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (timings assume 1)")
    parser.add_argument("--cache-dir", help="rmm's cache folder (banks, passage vectors)")
    parser.add_argument("--no-learn", action="store_true", help="skip the trained-reranker rows (the slow part)")
    parser.add_argument("--no-build", action="store_true", help="skip the build timing and structure")
    parser.add_argument("--limit", type=int, help="the first N questions of each set only (a smoke run)")
    parser.add_argument("--json", help="write every figure (and per-question rows) as JSON")
    args = parser.parse_args(argv)
    if args.users == "train" and not args.no_learn:
        parser.error("--users train reads the conversations the learned rows train on: add --no-learn")

    import torch

    from rmm.data import load_dataset
    from rmm.eval.benchmark_bank import open_retriever
    from rmm.policy.recipes import LearnerConfig

    torch.set_num_threads(args.threads)
    dataset = load_dataset(args.dataset, download=False)
    train_users, held_users = split_users_in_order(dataset.users, args.heldout, args.seed)
    train = subset(dataset, train_users)
    read_users = held_users if args.users == "heldout" else train_users
    held = subset(dataset, read_users)  # the questions read (the held-out ones unless --users train)
    print(f"{dataset.name}: held out {', '.join(held_users)}; training {', '.join(train_users)}; reading the "
          f"{'held-out' if args.users == 'heldout' else 'training'} conversations ({len(scorable(held))} questions, "
          f"categories 1-4); first stage {args.retriever}; {args.threads} torch thread(s)")
    record: dict[str, Any] = {"dataset": dataset.name, "retriever": args.retriever, "heldout_users": held_users,
                              "training_users": train_users, "users": args.users, "threshold": args.threshold,
                              "threads": args.threads}

    def opened(ds: Dataset, granularity: str, features: bool) -> Any:
        return open_retriever(args.retriever, ds, granularity, cache=args.cache_dir, device="cpu", progress=False,
                              candidate_features=features and LearnerConfig.candidate_features)

    title = "R@Tt (%) on " + ("held-out" if args.users == "heldout" else "training")
    header = f"{title:<34}" + "".join(f"{c:>8}" for c in COLUMNS)
    flat = {g: flat_recall(held, opened(held, g, False).retriever, g, args.retriever) for g in ("event", "topic")}
    record["flat"] = flat
    events = opened(held, "event", True)
    runs: dict[str, SearchRun] = {}
    for policy in ("heuristic", "oracle"):
        runs[policy] = run_search(policy, held, events.retriever, CompassConfig(policy=policy, threshold=args.threshold,
                                                                                answer=False), limit=args.limit)
    if args.first_walk:
        runs["first walk"] = run_search("first walk", held, events.retriever,
                                        CompassConfig(policy="heuristic", threshold=args.threshold, answer=False,
                                                      **FIRST_WALK), limit=args.limit)
    record["configs"] = {"heuristic": asdict(CompassConfig(policy="heuristic", threshold=args.threshold)),
                         "oracle": asdict(CompassConfig(policy="oracle"))}
    if not args.no_learn:
        train_events = opened(train, "event", True)
        learner, training = train_reranker(train, train_events.retriever,
                                           CompassConfig(policy="heuristic", threshold=args.threshold),
                                           limit=args.limit)
        record["training"] = training
        runs["learned"] = run_search("learned", held, events.retriever,
                                     CompassConfig(policy="heuristic", threshold=args.threshold, answer=False),
                                     learner=learner, limit=args.limit)
    table: dict[str, dict[str, dict[str, float]]] = {}
    for t in TURN_BUDGETS:
        key = f"recall_turns@{t}"
        rows = {"flat topic (first stage)": flat["topic"][key], "flat event (first stage)": flat["event"][key],
                "direct, reranked (untrained)": by_category(runs["heuristic"].rows, f"{key}_direct"),
                f"heuristic search (t={args.threshold:g})": by_category(runs["heuristic"].rows, f"{key}_search")}
        if "first walk" in runs:
            rows["direct, as many as the first walk"] = by_category(runs["first walk"].rows, f"{key}_direct")
            rows["heuristic, first walk"] = by_category(runs["first walk"].rows, f"{key}_search")
        if "learned" in runs:
            rows["direct, reranker trained"] = by_category(runs["learned"].rows, f"{key}_direct")
            rows["heuristic search, reranker trained"] = by_category(runs["learned"].rows, f"{key}_search")
        rows["oracle search (ceiling)"] = by_category(runs["oracle"].rows, f"{key}_search")
        table[key] = rows
        print(f"\nR@{t}t " + "-" * 70)
        print(header)
        for label, cells in rows.items():
            print(_line(label, cells))
    record["table"] = table
    gains = {name: {f"recall_turns@{t}": paired_gain(run.rows, f"recall_turns@{t}") for t in TURN_BUDGETS}
             for name, run in runs.items() if name != "oracle"}
    record["gains"] = gains
    counts = gains["heuristic"][f"recall_turns@{TURN_BUDGETS[0]}"]
    print("\nsearch − direct with as many events, points (± paired standard error; questions per category: "
          + ", ".join(f"{c} {counts[c]['n']:.0f}" for c in COLUMNS if c in counts) + ")")
    print(f"{'':<34}" + "".join(f"{c:>12}" for c in COLUMNS))
    for name, by_budget in gains.items():
        for key, cells in by_budget.items():
            print(f"{name + ' R@' + key.split('@')[1] + 't':<34}" + "".join(
                f"{cells[c]['mean']:>+8.1f}±{cells[c]['se']:<3.1f}" if c in cells else f"{'—':>12}"
                for c in COLUMNS))
    linkage = gold_linkage(held, events.retriever.bank.store, args.limit)
    record["gold_linkage"] = linkage

    def linked(name: str, fmt: str) -> str:
        return " / ".join(format(linkage[c][name], fmt) for c in COLUMNS if c in linkage)

    print(f"\ngold evidence in the graph (per category 1-4 / all): events holding gold per question "
          f"{linked('gold_events', '.2f')}; questions with gold in >= 2 events {linked('spread', '.0f')} %; "
          f"gold events with an edge to another gold event {linked('linked', '.0f')} %")
    timing = {name: {"walk_ms": _ms(run.walk_ms), "topics_ms": _ms(run.topic_ms),
                     "memories": statistics.mean(r["n_memories"] for r in run.rows),
                     "steps": statistics.mean(r["steps"] for r in run.rows), "table4": run.table4}
              for name, run in runs.items()}
    record["search"] = timing
    record["rows"] = {name: run.rows for name, run in runs.items()}
    print()
    for name, t in timing.items():
        walk, topics = t["walk_ms"], t["topics_ms"]
        print(f"{name}: {t['memories']:.1f} events shown, {t['steps']:.1f} steps per question; graph walk CPU "
              f"{walk['mean']:.2f} ms mean, p50 {walk['p50']:.2f}, p95 {walk['p95']:.2f}, max {walk['max']:.2f} "
              f"(goal <= 20 ms); topic-layer read {topics['mean']:.2f} ms mean")
        t4 = t["table4"]
        print(f"  Table 4: initial nodes {t4['initial_nodes']:.1f}, paths {t4['paths']:.1f}, steps {t4['steps']:.1f}, "
              f"path length {t4['path_length']:.2f} (max {t4['max_path_length']:.0f}), kept nodes "
              f"{t4['kept_nodes']:.2f} (none kept: {t4['no_kept_nodes']:.0f}), max queue {t4['max_queue']:.1f}, "
              f"EXPAND {100 * t4['action_expand']:.1f}% SKIP {100 * t4['action_skip']:.1f}% "
              f"ANSWER {100 * t4['action_answer']:.1f}%")
    if "training" in record:
        tr = record["training"]
        print(f"reranker trained on {tr['questions']} training questions in {tr['seconds']:.0f} s: "
              f"{tr.get('updates', '?')} updates from {tr.get('records', '?')} sampled slates")
    if not args.no_build:
        from rmm.encoders import load_encoder

        build = build_times(dataset, dataset.users, load_encoder("minilm", device="cpu"), args.cache_dir)
        record["build"] = build
        print(f"\nbuild, {build['conversations']} conversations, fresh banks: event graph "
              f"{build['event_seconds']:.1f} s vs topic bank {build['topic_seconds']:.1f} s")
        print(f"structure: {build['events_per_session']:.1f} events per session "
              f"(paper: {PAPER['events_per_session']}); "
              f"{build['turns_per_event']:.1f} turns per event (median {build['turns_per_event_median']:g}), "
              f"{build['words_per_event']:.0f} words per event (paper: {PAPER['tokens_per_event']} tokens); "
              f"{build['edges_per_event']:.2f} out-edges per event {build['labels']} (paper: "
              f"{PAPER['edges_per_event']}); {build['topics']} topics")
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
