"""`rmm eval`: Recall@K (and nDCG) of retrievers on a benchmark, per category, at one or several
memory granularities (turn, session, topic = prospective reflection)."""

from __future__ import annotations

import argparse
import logging
import time
from typing import TYPE_CHECKING, Any

from rich.markup import escape

from rmm.cli.arguments import (
    add_check,
    cosine,
    index_backend,
    positive_int,
    retriever_name,
    store_url,
    unrerankable,
)
from rmm.cli.common import (
    DEFAULT_RETRIEVER,
    add_common_options,
    add_dedup_option,
    console,
    fmt,
    load_benchmark,
    load_llm,
    write_json,
)
from rmm.cli.settings import PRECEDENCE, add_config_options
from rmm.cli.tables import Figures, headroom_cell, print_figures, question_set
from rmm.errors import RmmError

if TYPE_CHECKING:
    from rmm.eval.retrieval import Rank
    from rmm.types import Candidates

__all__ = ["granularity_figures", "headroom_figures", "register", "report_figures", "run", "turn_budget_figures",
           "turn_columns"]

log = logging.getLogger(__name__)

SHORT = {"recall": "R", "recall_any": "any", "recall_all": "all", "ndcg": "nDCG"}
TURNS_NOTE = ("R@Tt = recall within a budget of T dialogue turns shown: whole memories in rank order while "
              "their turns (refs) add up to at most T, scored on gold turns at every granularity")


def turn_columns(report: Any) -> list[tuple[str, str]]:
    """(JSON key, header) of each R@T a report holds (`rmm.eval.metrics.recall_at_turns`): "R@15t"."""
    return [(f"recall_turns@{t}", f"R@{t}t") for t in getattr(report, "turn_budgets", [])]


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("eval", help="Recall@K of retrievers on a benchmark, per category",
                              description="Recall@K (and nDCG) of retrievers on a benchmark, per question "
                                          "category, at one or several memory granularities. " + PRECEDENCE,
                              epilog="e.g. rmm eval --config configs/eval/locomo-cpu.yaml k=[1,5,10]")
    p.add_argument("--dataset", default="locomo", help="locomo | longmemeval[:s|m|oracle] | msc | a file")
    add_dedup_option(p)
    p.add_argument("--retriever", nargs="+", type=retriever_name, default=[DEFAULT_RETRIEVER],
                   help="minilm | bm25 | contriever | stella | gte | an encoder folder | hybrid[:DENSE] (BM25 + DENSE, default minilm, reciprocal-rank fused) | bm25:DENSE (BM25's ranking over DENSE's bank, rerankable) (several allowed)")
    p.add_argument("--granularity", nargs="+", choices=("turn", "session", "topic", "event"), default=["turn"],
                   help="memory units; topic = built by prospective reflection, event = CompassMem's event graph "
                        "(its LLM-free fallback) (several: one comparison table)")
    p.add_argument("--k", type=positive_int, nargs="+", default=[5, 10], help="cut-offs K of Recall@K")
    p.add_argument("--depth", type=positive_int, default=20,
                   help="candidates a reranker reorders (rmm train --k): their recall@DEPTH, the ceiling of any "
                        "reranker of them, is reported beside the cut-offs")
    p.add_argument("--index", type=index_backend, default="torch", help="torch | faiss-flat | faiss-ivf | faiss-hnsw")
    p.add_argument("--llm", help="LLM spec for topic extraction (default: the labelled non-LLM fallback)")
    p.add_argument("--merge-threshold", type=cosine, default=0.8,
                   help="fallback topics: cosine above which a topic merges into an existing one")
    p.add_argument("--reranker", metavar="DIR",
                   help="a reranker checkpoint folder (rmm train --output RUN: RUN/rerankers; the agent's "
                        "BANK/reranker): also report each dense, hybrid or bm25:DENSE retriever's top --depth reranked by it, "
                        "and the share of the headroom up to the ceiling it captured")
    p.add_argument("--json", help="write the numbers as JSON")
    p.add_argument("--store", type=store_url,
                   help="keep the benchmark banks in PostgreSQL + pgvector (postgresql://…) instead of the cache folder")
    add_common_options(p)
    add_config_options(p, label="evaluation config", example="configs/eval/locomo-cpu.yaml")
    add_check(p, _rerankable_with_reranker)  # after the config's settings are applied
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rmm.eval.benchmark_bank import open_retriever
    from rmm.eval.retrieval import evaluate_orders, headroom_by_cutoff

    dataset = load_benchmark(args)
    _refuse_pretrained_encoders(args.retriever, dataset)
    questions = question_set(dataset, args.no_dedup)
    topics = "topic" in args.granularity
    llm = load_llm(args.llm) if args.llm and topics else None
    reflector = {"merge_threshold": args.merge_threshold} if topics else None
    reports = {}
    for granularity in args.granularity:
        for name in args.retriever:
            opened = open_retriever(name, dataset, granularity, cache=args.cache_dir, device=args.device,
                                    batch_size=args.batch_size, index_backend=args.index,
                                    llm=llm if granularity == "topic" else None,
                                    reflector_options=reflector if granularity == "topic" else None,
                                    store=args.store)
            t0 = time.perf_counter()
            topic_source = f"PR: {llm.name}" if llm else "PR: fallback topics"
            label = name if granularity != "topic" else f"{name} ({topic_source})"
            label = label if granularity != "event" else f"{name} (fallback event graph)"
            orders: dict[str, Rank | None] = {label: None}
            if args.reranker:  # scored from the same search as the retriever's own order
                orders[f"{label} + reranker"] = _reranker_order(args, opened)
            scored = evaluate_orders(dataset, opened.retriever, granularity, args.k, orders, ceiling=args.depth)
            log.info("evaluated %s/%s in %.1fs", name, granularity, time.perf_counter() - t0)
            report = reports[f"{name}/{granularity}"] = scored[label]
            reranked = scored.get(f"{label} + reranker")
            if reranked is not None:
                reranked.headroom = headroom_by_cutoff(report, reranked)
                reports[f"{name}/{granularity}+reranker"] = reranked
            if len(args.granularity) == 1:
                print_figures(report_figures(report, questions), console)
                if turn_columns(report):
                    print_figures(turn_budget_figures(report, questions), console)
                if report.skipped:
                    console.print(f"[dim]{report.skipped} questions without gold evidence were skipped[/dim]")
            if reranked is not None:
                if len(args.granularity) == 1:
                    print_figures(report_figures(reranked, questions), console)
                    if turn_columns(reranked):
                        print_figures(turn_budget_figures(reranked, questions), console)
                print_figures(headroom_figures(report, reranked, questions), console)
    if len(args.granularity) > 1:
        for name in args.retriever:
            print_figures(granularity_figures([reports[f"{name}/{g}"] for g in args.granularity], name, questions),
                          console)
    if len(reports) == 1:
        write_json(args.json, next(iter(reports.values())).to_json())
    else:
        write_json(args.json, {key: r.to_json() for key, r in reports.items()})
    return 0


def _refuse_pretrained_encoders(retrievers: list[str], dataset: Any) -> None:
    """`rmm eval` scores every user: an encoder folder pretrained on some of them (its
    `rmm_pretraining.json`) would report recall on conversations it trained on, so it is refused
    before any bank is built, naming them."""
    from pathlib import Path

    from rmm.encoders.encoder import read_pretraining
    from rmm.eval.benchmark_bank import parse_retriever
    from rmm.training.splits import refuse_pretrained_users

    users = [u for u in dataset.users if dataset.questions_of(u)]
    for name in retrievers:
        dense = parse_retriever(name).dense
        record = read_pretraining(dense) if dense is not None and Path(dense).expanduser().is_dir() else None
        if record is None:
            continue
        remedy = "evaluate it on a dataset it was not pretrained on"
        if record.heldout_fraction is not None and record.seed is not None:
            remedy = (f"score the users it held out ({', '.join(record.heldout)}) with rmm train --retriever {name} "
                      f"--heldout {record.heldout_fraction:g} --seed {record.seed}")
        refuse_pretrained_users(name, record, dataset.name, users, remedy)


def _reranker_order(args: argparse.Namespace, opened: Any) -> Rank:
    """Each query's candidates (the retriever's top --depth or more) in the --reranker checkpoint's
    order: what `RerankedRetriever.search` would show for the same candidates, without searching again."""
    from rmm.memory.hybrid import HybridRetriever
    from rmm.policy.learner import Learner
    from rmm.policy.retrieve import reranked

    if opened.encoder is None:  # a name that skipped the parser (its check refuses plain bm25 with --reranker)
        raise RmmError(unrerankable(opened.name) or f"{opened.name!r} gives no embeddings to rerank")
    reranker = Learner.load(args.reranker, encoder_name=opened.encoder.fingerprint, dim=opened.encoder.dim).reranker
    if isinstance(opened.retriever, HybridRetriever):  # the features this reranker weighs, if any (not searched yet)
        opened.retriever.candidate_features = bool(reranker.feature_names)

    def rank(found: list[Candidates]) -> list[list[str]]:
        return [reranked(reranker, c).memory_ids for c in found]

    return rank


def _rerankable_with_reranker(args: argparse.Namespace) -> str | None:
    """--reranker rescores every --retriever's candidates: plain bm25 among them is refused before
    any retriever is evaluated, not after the ones before it."""
    if not getattr(args, "reranker", None):
        return None
    return next((message for message in map(unrerankable, args.retriever) if message), None)


def headroom_figures(base: Any, reranked: Any, questions: str = "") -> Figures:
    """Per cut-off below the ceiling: the retriever, the reranked list, the ceiling, the share captured."""
    k = base.ceiling
    figures = Figures(title=f"{base.dataset} · {escape(base.retriever)} · {base.granularity}: headroom up to "
                            f"R@{k} (%)",
                      caption=f"ceiling = the top {k} candidates' recall, the most a reranker of them can reach; "
                              "captured = (reranked − retriever) / (ceiling − retriever)" + _of(questions),
                      columns=["cut-off", "retriever alone", "+ reranker", f"ceiling R@{k}", "headroom captured"])
    for cut, row in reranked.headroom.items():
        figures.add_row(cut, fmt(row["retriever"]), fmt(row["reranked"]), fmt(row[f"ceiling_recall@{k}"]),
                        headroom_cell(row["captured"]))
    return figures


def _category_rows(figures: Figures, first: Any, cells: Any) -> None:
    """One row per category of `first` (separate ones marked), then the bold headline row;
    `cells(category)` gives a category's figures, `cells(None)` the headline's."""
    separate = set(first.separate)
    for cat, row in first.by_category.items():
        figures.add_row(f"{cat} {row['name']}" + (" (separate)" if cat in separate else ""), str(row["n"]),
                        *cells(cat))
    label = "overall (" + ", ".join(c for c in first.by_category if c not in separate) + ")"
    figures.add_row(f"[bold]{label}", f"[bold]{first.overall['n']}", *(f"[bold]{c}" for c in cells(None)))


def _of(questions: str) -> str:
    """The question set (`rmm.cli.tables.question_set`) as a caption's last sentence."""
    return f". Questions: {questions}" if questions else ""


def report_figures(report: Any, questions: str = "") -> Figures:
    """One retriever at one granularity: every metric at every K, per category."""
    metrics = [(f"{m}@{k}", f"{SHORT[m]}@{k}") for k in report.ks for m in SHORT]
    figures = Figures(title=f"{report.dataset} · {report.retriever} · {report.granularity} granularity (%)",
                      caption="R = fractional recall, any / all = recall_any / recall_all" + ceiling_note([report])
                              + _of(questions),
                      columns=["category", "n", *(short for _, short in metrics)])

    _category_rows(figures, report, _metric_cells(report, [m for m, _ in metrics]))
    return figures


def _metric_cells(report: Any, metrics: list[str]) -> Any:
    """The cells of a category's row (`None`: overall): each metric's figure, in order."""
    def cells(cat: str | None) -> list[str]:
        row = report.overall if cat is None else report.by_category[cat]
        return [fmt(row.get(m)) for m in metrics]

    return cells


def turn_budget_figures(report: Any, questions: str = "") -> Figures:
    """One retriever at one granularity: R@K beside R@T (T in dialogue turns), per category — its own
    table, since beside every metric at every K it would not fit 80 columns."""
    metrics = [(f"recall@{k}", f"R@{k}") for k in report.ks] + turn_columns(report)
    figures = Figures(title=f"{report.dataset} · {report.retriever} · {report.granularity}: recall at K memories "
                            "and at T turns (%)",
                      caption=f"R@K = fractional recall of the top K memories; {TURNS_NOTE}" + _of(questions),
                      columns=["category", "n", *(short for _, short in metrics)])

    _category_rows(figures, report, _metric_cells(report, [m for m, _ in metrics]))
    return figures


def ceiling_note(reports: list[Any]) -> str:
    """The headline recall@K of the top-K candidates — the ceiling of a reranker of them — for the
    caption (a column would push the usual table past 80 columns; `--json` has it per category)."""
    first = reports[0]
    if getattr(first, "ceiling", None) is None:
        return ""
    values = [r.ceiling_recall() for r in reports]
    shown = " / ".join(fmt(v) for v in values)
    which = "" if len(reports) == 1 else " (" + " / ".join(r.granularity for r in reports) + ")"
    return (f". Ceiling R@{first.ceiling}{which}: {shown} — the top {first.ceiling} candidates' recall, "
            "the most a reranker of them can reach")


def granularity_figures(reports: list[Any], retriever: str, questions: str = "") -> Figures:
    """One table, granularities side by side (the paper's Fig. 4 comparison)."""
    first = reports[0]
    metrics = [(f"recall@{k}", f"R@{k}") for k in first.ks] + turn_columns(first)
    turns = f". {TURNS_NOTE}, so turn, topic and session compare at equal text shown" if turn_columns(first) else ""
    topic_by = next((f" · topic memories by {escape(r.retriever)}" for r in reports if r.granularity == "topic"), "")
    figures = Figures(title=f"{first.dataset} · {retriever} · memory granularity (%)",
                      caption="R = fractional recall. turn and topic are scored on gold turns (topic through its "
                              "refs), session R@K on gold sessions. topic = prospective reflection" + topic_by + turns
                              + ceiling_note(reports) + _of(questions),
                      columns=["category", "n", *(f"{r.granularity} {short}" for r in reports for _, short in metrics)])

    def cells(cat: str | None) -> list[str]:
        rows = [r.overall if cat is None else r.by_category.get(cat, {}) for r in reports]
        return [fmt(row.get(m)) for row in rows for m, _ in metrics]

    _category_rows(figures, first, cells)
    return figures
