"""`rmm eval-qa`: benchmark questions answered through the agent, judged for accuracy and F1, with
citation precision and the recall of what was shown."""

from __future__ import annotations

import argparse
from typing import Any

from rmm.cli.arguments import positive_int
from rmm.cli.common import (
    DEFAULT_RETRIEVER,
    add_common_options,
    add_k_m_options,
    console,
    fmt,
    llm_options,
    load_benchmark,
    load_llm,
    write_json,
)
from rmm.cli.goal_options import GOAL_LLM_NOTE, add_goal_options, append_trace, goal_config
from rmm.cli.tables import Figures, print_figures
from rmm.errors import RmmError

__all__ = ["qa_figures", "register", "run"]

_KEYS = {"judge": "judge", "F1": "f1", "cited precision": "cited_precision", "shown recall": "shown_recall"}


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("eval-qa", help="answer benchmark questions through the agent; judge accuracy and F1")
    p.add_argument("--dataset", default="locomo")
    p.add_argument("--llm", required=True, help="generator spec (simulated: citations and recall only)")
    p.add_argument("--judge-llm", help="judge spec (default: the generator)")
    p.add_argument("--retriever", default=DEFAULT_RETRIEVER)
    p.add_argument("--granularity", default="turn", choices=("turn", "session", "topic"))
    p.add_argument("--limit", type=positive_int, help="answer at most N questions (in dataset order)")
    add_k_m_options(p)
    p.add_argument("--no-learn", action="store_true",
                   help="show the plain top-M and update nothing (default: learn online, Gumbel-sampled M)")
    p.add_argument("--frontend", default="direct", choices=("direct", "goal"),
                   help="direct = the question as one query; goal = GOAL-MEM goal decomposition (needs a real LLM)")
    add_goal_options(p)
    p.add_argument("--json", help="write the numbers as JSON")
    add_common_options(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rmm.eval.benchmark_bank import open_retriever
    from rmm.eval.qa import evaluate_qa

    dataset = load_benchmark(args)
    llm = load_llm(args.llm, **llm_options(args))
    if args.frontend == "goal" and llm.name.startswith("simulated"):
        raise RmmError(GOAL_LLM_NOTE)
    judge = load_llm(args.judge_llm) if args.judge_llm else llm
    opened = open_retriever(args.retriever, dataset, args.granularity, cache=args.cache_dir, device=args.device,
                            batch_size=args.batch_size, llm=llm if args.granularity == "topic" and
                            not llm.name.startswith("simulated") else None)
    if opened.encoder is None:
        raise RmmError(f"the agent's reranker needs a dense retriever; {args.retriever!r} has none")
    report = evaluate_qa(dataset, opened.retriever, llm, judge, granularity=args.granularity, limit=args.limit,
                         k=args.k, m=args.m, frontend=args.frontend, learn=not args.no_learn,
                         goal_config=goal_config(args) if args.frontend == "goal" else None)
    for row in report.rows:
        if "trace" in row:
            append_trace(args.trace_json, row["trace"])
    print_figures(qa_figures(report), console)
    write_json(args.json, report.to_json())
    return 0


def qa_figures(report: Any) -> Figures:
    """Per category: judge accuracy and F1 (real generators), cited precision and shown recall."""
    simulated = report.simulated
    columns = ["cited precision", "shown recall"] if simulated else ["judge", "F1", "cited precision", "shown recall"]
    figures = Figures(title=f"{report.dataset} QA through the agent · {report.llm} · {report.granularity} memories"
                            + (" · goal front end (GOAL-MEM)" if report.frontend == "goal" else ""),
                      caption="simulated generator: no answers, so no judge or F1 — citation and recall figures only"
                              if simulated else "judge = LLM-judge accuracy (%)",
                      columns=["category", "n", *columns])
    for cat, row in {**report.by_category, "overall": report.overall}.items():
        figures.add_row(str(cat) + (f" {row['name']}" if row.get("name") else ""), str(row["n"]),
                        *(fmt(row.get(_KEYS[c])) for c in columns))
    return figures
