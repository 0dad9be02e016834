"""`rmm eval-controller`: gold-evidence recall of a controller's memories (GOAL-MEM or MemR³) against
one direct query with the same number of memories, with the LLM cost per question.

`--users heldout|train` scores only the users `rmm train` holds out (or trains on) with the same
`--heldout` and `--seed` (`rmm.training.splits.hold_out_users`, the one seeded choice `rmm train`,
`rmm pretrain` and `rmm.bench.compass` share), so a controller's figures can come from conversations
no reranker or threshold was fitted on; `--user ID` (repeatable) names users outright. Only the
questions are narrowed: every user's memories stay in the bank (a question only ever searches its own
user's), so the cached bank and the figures of the users kept are those of a run over all users."""

from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING, Any

from rich.markup import escape

from rmm.cli import common
from rmm.cli.arguments import (
    non_negative_int,
    open_fraction,
    positive_int,
    rerankable_retriever_name,
    unrerankable,
)
from rmm.cli.eval_qa import add_dedup_option, load_questions
from rmm.cli.frontend_options import (
    add_frontend_options,
    append_trace,
    frontend_config,
    refuse_simulated,
)
from rmm.cli.tables import Figures, print_figures, question_set
from rmm.errors import RmmError

if TYPE_CHECKING:
    from rmm.types import Dataset

__all__ = ["USER_SETS", "controller_figures", "questions_of", "register", "run", "select_users",
           "turn_budget_figures"]

USER_SETS = ("all", "heldout", "train")

log = logging.getLogger(__name__)


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("eval-controller", help="controller retrieval (GOAL-MEM or MemR³): gold-evidence recall "
                                                      "of the memories the controller retrieved vs one direct query "
                                                      "with the same number of memories")
    p.add_argument("--dataset", default="locomo")
    p.add_argument("--category", type=positive_int, default=1, help="question category (LoCoMo 1 = multi-hop)")
    p.add_argument("--llm", required=True, help="hf:PATH | openai:URL@MODEL | vllm:PATH (the simulated LLM "
                                                "cannot drive a controller)")
    p.add_argument("--retriever", type=rerankable_retriever_name, default=common.DEFAULT_RETRIEVER,
                   help="first stage of both the controller and the direct query (turn memories): a dense "
                        "encoder preset or folder, hybrid[:DENSE] (BM25 + that dense retriever, fused) or "
                        "bm25:DENSE (BM25's ranking over DENSE's bank). Not plain bm25: the reranker needs embeddings")
    p.add_argument("--limit", type=positive_int, help="at most N questions (in dataset order)")
    p.add_argument("--users", choices=USER_SETS, default="all",
                   help="whose questions: all (default), or the users rmm train holds out / trains on with "
                        "--heldout and --seed (LoCoMo held out by the defaults: conv-30, conv-48, conv-49)")
    p.add_argument("--user", action="append", metavar="ID",
                   help="only this user's questions (repeatable); with --users heldout|train it must be one of them")
    p.add_argument("--heldout", type=open_fraction, default=0.3,
                   help="rmm train's --heldout for --users heldout|train (fraction of users held out; default 0.3)")
    p.add_argument("--seed", type=non_negative_int, default=0,
                   help="rmm train's --seed for --users heldout|train (default 0)")
    common.add_k_m_options(p, "candidates per query", "memories selected per GOAL-MEM subgoal query (at most K; "
                                                      "MemR³ shows --n-chk per retrieval)")
    add_frontend_options(p, direct=False)
    add_dedup_option(p)
    p.add_argument("--answer", action="store_true", help="also write the final answer (one more call per question)")
    p.add_argument("--show-trace", action="store_true", help="print each question's trace")
    p.add_argument("--json", help="write the numbers, per-question rows and traces as JSON")
    common.add_common_options(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rmm.eval.benchmark_bank import open_retriever
    from rmm.eval.controller_recall import evaluate_controller_recall
    from rmm.frontends.trace import print_trace
    from rmm.policy.recipes import LearnerConfig

    dataset = load_questions(args)
    users = select_users(dataset, args.users, args.user, args.heldout, args.seed)
    if users != dataset.users:
        log.info("scoring the questions of %s (--users %s)", ", ".join(users), args.users)
        dataset = questions_of(dataset, users)
    if dataset.categories and args.category not in dataset.categories:
        known = ", ".join(f"{c} {name}" for c, name in sorted(dataset.categories.items()))
        raise RmmError(f"{dataset.name} has no category {args.category}; its categories: {known}")
    llm = common.load_llm(args.llm, **common.llm_options(args))
    refuse_simulated(args, llm)
    granularity = "event" if args.frontend == "compass" else "turn"  # CompassMem walks the (fallback) event graph
    opened = open_retriever(args.retriever, dataset, granularity, cache=args.cache_dir, device=args.device,
                            batch_size=args.batch_size,
                            candidate_features=LearnerConfig.candidate_features)  # what the frontends' rerankers weigh
    if opened.encoder is None:  # a name that skipped the parser (command line and config go through its type)
        raise RmmError(unrerankable(args.retriever) or f"{args.retriever!r} gives no embeddings to rerank")

    def show(question: Any, trace: Any) -> None:
        if args.show_trace:
            print_trace(trace, common.console)
        append_trace(args.trace_json, trace.to_json())

    report = evaluate_controller_recall(dataset, opened.retriever, llm, category=args.category, limit=args.limit,
                                        k=args.k, m=args.m, config=frontend_config(args), answer=args.answer,
                                        on_trace=show)
    questions = question_set(dataset, args.no_dedup)
    if users != dataset.users:
        questions += "; users " + (", ".join(users) if len(users) <= 5 else f"{len(users)} ({args.users})")
    print_figures(controller_figures(report, questions), common.console)
    if report.recall_turns_controller:
        print_figures(turn_budget_figures(report), common.console)
    selection = {"users": users, "user_set": args.users}
    if args.users != "all":
        selection |= {"heldout": args.heldout, "seed": args.seed}
    common.write_json(args.json, {**report.to_json(), **selection})
    return 0


def select_users(dataset: Dataset, user_set: str, named: list[str] | None, heldout: float, seed: int) -> list[str]:
    """The users whose questions are scored, in dataset order: `user_set` ("all", or rmm train's
    held-out / training users for `heldout` and `seed`), narrowed to `named` when given. An id the
    dataset lacks, or one outside `user_set`, is refused in one line (nothing has run yet).

    The split is drawn over every user of the dataset, as `rmm.bench.compass` and `rmm pretrain` draw
    it; `rmm train` draws it over the users with scorable questions — the same users on LoCoMo."""
    from rmm.training.splits import split_users_in_order

    if user_set not in USER_SETS:
        raise RmmError(f"--users must be one of {', '.join(USER_SETS)}, got {user_set!r}")
    chosen = dataset.users
    if user_set != "all":
        if len(chosen) < 2:
            raise RmmError(f"--users {user_set} splits users as rmm train does: {dataset.name} has only "
                           f"{len(chosen)} user(s)")
        chosen = split_users_in_order(chosen, heldout, seed)[user_set == "heldout"]
    if not named:
        return chosen
    unknown = [u for u in dict.fromkeys(named) if u not in dataset.users]
    if unknown:
        sample = ", ".join(dataset.users[:5]) + (", …" if len(dataset.users) > 5 else "")
        raise RmmError(f"{dataset.name} has no user {', '.join(unknown)} (its {len(dataset.users)} users: {sample})")
    outside = [u for u in dict.fromkeys(named) if u not in chosen]
    if outside:
        raise RmmError(f"--user {', '.join(outside)}: not a {user_set} user (--heldout {heldout:g} --seed {seed}: "
                       f"{', '.join(chosen)})")
    return [u for u in chosen if u in named]


def questions_of(dataset: Dataset, users: list[str]) -> Dataset:
    """`dataset` with only `users`' questions; every user's sessions stay, so the bank (cached by its
    sessions' content) is the one a run over all users opens."""
    from rmm.types import Dataset

    keep = set(users)
    return Dataset(dataset.name, dataset.sessions, [q for q in dataset.questions if q.user_id in keep],
                   dict(dataset.categories))


def controller_figures(report: Any, questions: str = "") -> Figures:
    """One row: recall of both ways of retrieving, then what the controller cost per question;
    `questions` (`rmm.cli.tables.question_set`) ends the caption."""
    from rmm.frontends.controllers import CONTROLLERS

    controller = CONTROLLERS[report.frontend]
    figures = Figures(title=f"{report.dataset} category {report.category} · gold-evidence recall at equal memory "
                            f"budget · {controller.label} · {escape(report.llm)}",
                      caption=f"{report.frontend} = union of the memories the {controller.label} front end's queries "
                              "retrieved; direct = one query with the question, same number of memories."
                              " Cost per question." + (f" Questions: {questions}" if questions else ""),
                      columns=["n", f"recall {report.frontend}", "recall direct", "memories", controller.settled,
                               "LLM calls", "prompt tok", "completion tok", "LLM s"], label=False)
    figures.add_row(str(report.n), common.fmt(report.recall_controller), common.fmt(report.recall_direct),
                    f"{report.memories_per_question:.1f}", common.fmt(report.settled), f"{report.llm_calls:.1f}",
                    f"{report.prompt_tokens:.0f}", f"{report.completion_tokens:.0f}", f"{report.seconds:.1f}")
    return figures


def turn_budget_figures(report: Any) -> Figures:
    """Both ways of retrieving at equal text shown: recall of all their memories beside R@T (T in
    dialogue turns), so a controller whose memories show more turns does not win by that alone."""
    budgets = sorted(int(key.partition("@")[2]) for key in report.recall_turns_controller)
    figures = Figures(title=f"{report.dataset} category {report.category} · gold-evidence recall at equal turn budget "
                            f"(%)",
                      caption="recall = all the memories retrieved; R@Tt = recall within T dialogue turns: the "
                              "memories in the order they were shown (direct: rank order), each whole while their "
                              "turns (refs) add up to at most T",
                      columns=["retrieval", "recall", *(f"R@{t}t" for t in budgets)])
    for arm, recall, turns in ((report.frontend, report.recall_controller, report.recall_turns_controller),
                               ("direct", report.recall_direct, report.recall_turns_direct)):
        figures.add_row(arm, common.fmt(recall), *(common.fmt(turns[f"recall_turns@{t}"]) for t in budgets))
    return figures
