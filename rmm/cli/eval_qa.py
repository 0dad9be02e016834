"""`rmm eval-qa`: benchmark questions answered through the agent (directly, or through the GOAL-MEM or
MemR³ front end), judged for accuracy and F1, with citation precision and the recall of what was shown.

LoCoMo is read without the 12 repeated questions MemR³ (App. C.3) found unless `--no-dedup`, as every
command reads it (`rmm.cli.common.load_benchmark`)."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from rmm.cli.arguments import positive_int, rerankable_retriever_name, unrerankable
from rmm.cli.common import (
    DEFAULT_RETRIEVER,
    add_common_options,
    add_dedup_option,
    add_k_m_options,
    console,
    fmt,
    llm_options,
    load_benchmark,
    load_llm,
    write_json,
)
from rmm.cli.frontend_options import (
    add_frontend_options,
    append_trace,
    frontend_config,
    refuse_simulated,
)
from rmm.cli.tables import Figures, print_figures, question_set
from rmm.errors import RmmError

__all__ = ["add_dedup_option", "load_questions", "qa_figures", "register", "run"]

log = logging.getLogger(__name__)

_KEYS = {"judge": "judge", "F1": "f1", "cited precision": "cited_precision", "shown recall": "shown_recall"}


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("eval-qa", help="answer benchmark questions through the agent; judge accuracy and F1")
    p.add_argument("--dataset", default="locomo")
    p.add_argument("--llm", required=True, help="generator spec (simulated: citations and recall only)")
    p.add_argument("--judge-llm", help="judge spec (default: the generator)")
    p.add_argument("--retriever", type=rerankable_retriever_name, default=DEFAULT_RETRIEVER,
                   help="the agent's first stage: a dense encoder preset or folder, hybrid[:DENSE] (BM25 + "
                        "that dense retriever, reciprocal-rank fused) or bm25:DENSE (BM25's ranking over DENSE's "
                        "bank); hybrid and bm25:DENSE candidates carry the lexical feature. Not plain bm25: the "
                        "reranker needs embeddings")
    p.add_argument("--granularity", default="turn", choices=("turn", "session", "topic", "event"),
                   help="memories the agent retrieves (event: CompassMem's fallback event graph, what --frontend "
                        "compass walks; default: turn)")
    p.add_argument("--limit", type=positive_int, help="answer at most N questions (in dataset order)")
    add_k_m_options(p)
    p.add_argument("--no-learn", action="store_true",
                   help="show the plain top-M and update nothing (default: learn online, Gumbel-sampled M)")
    add_frontend_options(p)
    p.add_argument("--show-trace", action="store_true", help="goal / memr3 front end: print each question's trace")
    add_dedup_option(p)
    p.add_argument("--json", help="write the numbers as JSON")
    add_common_options(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rmm.eval.benchmark_bank import open_retriever
    from rmm.eval.qa import evaluate_qa
    from rmm.policy.recipes import LearnerConfig

    dataset = load_questions(args)
    llm = load_llm(args.llm, **llm_options(args))
    refuse_simulated(args, llm)
    if args.frontend == "compass" and args.granularity != "event":
        log.warning("--frontend compass over %s memories: they have no event graph to walk (use --granularity event)",
                    args.granularity)
    judge = load_llm(args.judge_llm) if args.judge_llm else llm
    opened = open_retriever(args.retriever, dataset, args.granularity, cache=args.cache_dir, device=args.device,
                            batch_size=args.batch_size, llm=llm if args.granularity == "topic" and
                            not llm.name.startswith("simulated") else None,
                            candidate_features=LearnerConfig.candidate_features)  # what the frontends' rerankers weigh
    if opened.encoder is None:  # a name that skipped the parser (command line and config go through its type)
        raise RmmError(unrerankable(args.retriever) or f"{args.retriever!r} gives no embeddings to rerank")
    report = evaluate_qa(dataset, opened.retriever, llm, judge, granularity=args.granularity, limit=args.limit,
                         k=args.k, m=args.m, frontend=args.frontend, learn=not args.no_learn,
                         frontend_config=frontend_config(args), on_trace=lambda trace: _trace(args, trace))
    print_figures(qa_figures(report, question_set(dataset, args.no_dedup)), console)
    write_json(args.json, report.to_json())
    return 0


def _trace(args: argparse.Namespace, trace: Any) -> None:
    if args.show_trace:
        from rmm.frontends.trace import print_trace

        print_trace(trace, console)
    append_trace(args.trace_json, trace.to_json())


def load_questions(args: argparse.Namespace) -> Any:
    """The benchmark `--dataset` names; LoCoMo without its repeated questions unless --no-dedup
    (`load_benchmark`, as every command reads it)."""
    return load_benchmark(args)


def qa_figures(report: Any, questions: str = "") -> Figures:
    """Per category: judge accuracy and F1 (real generators), cited precision and shown recall;
    `questions` (`rmm.cli.tables.question_set`) ends the caption."""
    from rmm.frontends.controllers import CONTROLLERS

    simulated = report.simulated
    columns = ["cited precision", "shown recall"] if simulated else ["judge", "F1", "cited precision", "shown recall"]
    figures = Figures(title=f"{report.dataset} QA through the agent · {report.llm} · {report.granularity} memories"
                            + ("" if report.frontend == "direct" else f" · {CONTROLLERS[report.frontend].label} front end"),
                      caption=("simulated generator: no answers, so no judge or F1 — citation and recall "
                               "figures only" if simulated else "judge = LLM-judge accuracy (%)")
                              + (f". Questions: {questions}" if questions else ""),
                      columns=["category", "n", *columns])
    for cat, row in {**report.by_category, "overall": report.overall}.items():
        figures.add_row(str(cat) + (f" {row['name']}" if row.get("name") else ""), str(row["n"]),
                        *(fmt(row.get(_KEYS[c])) for c in columns))
    return figures
