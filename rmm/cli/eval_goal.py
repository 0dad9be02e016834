"""`rmm eval-goal`: gold-evidence recall of the goal front end's memories (GOAL-MEM) against one
direct query with the same number of memories, with the LLM cost per question."""

from __future__ import annotations

import argparse
from typing import Any

from rich.markup import escape

from rmm.cli import common
from rmm.cli.arguments import positive_int
from rmm.cli.goal_options import GOAL_LLM_NOTE, add_goal_options, append_trace, goal_config
from rmm.cli.tables import Figures, print_figures
from rmm.errors import RmmError

__all__ = ["goal_figures", "register", "run"]


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("eval-goal", help="GOAL-MEM retrieval: gold-evidence recall of the goal front end's "
                                                "memories vs one direct query with the same number of memories")
    p.add_argument("--dataset", default="locomo")
    p.add_argument("--category", type=positive_int, default=1, help="question category (LoCoMo 1 = multi-hop)")
    p.add_argument("--llm", required=True, help="hf:PATH | openai:URL@MODEL | vllm:PATH (" + GOAL_LLM_NOTE + ")")
    p.add_argument("--retriever", default=common.DEFAULT_RETRIEVER,
                   help="dense encoder preset or folder (turn memories)")
    p.add_argument("--limit", type=positive_int, help="at most N questions (in dataset order)")
    common.add_k_m_options(p, "candidates per subgoal query", "memories selected per subgoal query (at most K)")
    add_goal_options(p)
    p.add_argument("--answer", action="store_true", help="also write the final answer (one more call per question)")
    p.add_argument("--show-trace", action="store_true", help="print each question's trace")
    p.add_argument("--json", help="write the numbers, per-question rows and traces as JSON")
    common.add_common_options(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rmm.eval.benchmark_bank import open_retriever
    from rmm.eval.goal_recall import evaluate_goal_recall
    from rmm.frontends.trace import print_trace

    dataset = common.load_benchmark(args)
    if dataset.categories and args.category not in dataset.categories:
        known = ", ".join(f"{c} {name}" for c, name in sorted(dataset.categories.items()))
        raise RmmError(f"{dataset.name} has no category {args.category}; its categories: {known}")
    llm = common.load_llm(args.llm, **common.llm_options(args))
    if llm.name.startswith("simulated"):
        raise RmmError(GOAL_LLM_NOTE)
    opened = open_retriever(args.retriever, dataset, "turn", cache=args.cache_dir, device=args.device,
                            batch_size=args.batch_size)
    if opened.encoder is None:
        raise RmmError(f"the reranker needs a dense retriever; {args.retriever!r} has none")

    def show(question: Any, trace: Any) -> None:
        if args.show_trace:
            print_trace(trace, common.console)
        append_trace(args.trace_json, trace.to_json())

    report = evaluate_goal_recall(dataset, opened.retriever, llm, category=args.category, limit=args.limit, k=args.k,
                                  m=args.m, config=goal_config(args), answer=args.answer, on_trace=show)
    print_figures(goal_figures(report), common.console)
    common.write_json(args.json, report.to_json())
    return 0


def goal_figures(report: Any) -> Figures:
    """One row: recall of both ways of retrieving, then what the goal front end cost per question."""
    figures = Figures(title=f"{report.dataset} category {report.category} · gold-evidence recall at equal memory "
                            f"budget · {escape(report.llm)}",
                      caption="goal = union of the memories the goal front end's subgoal queries retrieved; direct = "
                              "one query with the question, same number of memories. Cost per question.",
                      columns=["n", "recall goal", "recall direct", "memories", "grounded", "LLM calls",
                               "prompt tok", "completion tok", "LLM s"], label=False)
    figures.add_row(str(report.n), common.fmt(report.recall_goal), common.fmt(report.recall_direct),
                    f"{report.memories_per_question:.1f}", common.fmt(report.grounded), f"{report.llm_calls:.1f}",
                    f"{report.prompt_tokens:.0f}", f"{report.completion_tokens:.0f}", f"{report.seconds:.1f}")
    return figures
