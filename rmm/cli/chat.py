"""`rmm chat`: a terminal conversation with the RMM agent (memories, citations, online reranker),
directly or through a query-side front end (GOAL-MEM or MemR³), whose trace is shown after each reply.
`--retriever hybrid` fuses BM25 into the first stage, `--retriever bm25` ranks by BM25 alone over the
bank (both rerankable); the reflector still writes into the dense bank."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.markup import escape

from rmm.cli import logs
from rmm.cli.arguments import device, positive_float, retriever_name
from rmm.cli.common import (
    DEFAULT_RETRIEVER,
    add_k_m_options,
    add_verbose,
    console,
    llm_options,
    load_llm,
)
from rmm.cli.frontend_options import add_frontend_options, append_trace, frontend_config
from rmm.errors import RmmError

__all__ = ["CHAT_LOG", "first_stage_choice", "print_reply", "register", "run"]

CHAT_LOG = "chat.log"


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("chat", help="terminal chat with the RMM agent (memories, citations, online reranker)")
    p.add_argument("--bank", required=True, help="bank folder (created if absent)")
    p.add_argument("--user", required=True)
    p.add_argument("--llm", required=True, help="openai:URL@MODEL | hf:PATH | vllm:PATH | simulated")
    p.add_argument("--encoder", help=f"encoder preset or folder (must match the bank; default {DEFAULT_RETRIEVER})")
    p.add_argument("--retriever", default="dense", type=retriever_name,
                   help="first stage: dense (the encoder's bank search), hybrid[:DENSE] (BM25 over the bank's "
                        "memories + the dense search, reciprocal-rank fused) or bm25[:DENSE] (BM25's ranking "
                        "alone over the bank's memories); DENSE = the encoder, as --encoder. Unlike rmm train / "
                        "eval, plain bm25 here is BM25 over the chat bank, whose memories carry embeddings: "
                        "rerankable, as bm25:DENSE. Hybrid and bm25 candidates give the reranker its lexical feature")
    add_frontend_options(p)
    add_k_m_options(p)
    p.add_argument("--tau", type=positive_float, help="Gumbel temperature (default: the recipe's)")
    p.add_argument("--recipe", default="auto", choices=("auto", "paper", "normalized"),
                   help="learner hyper-parameters; auto = normalized (τ 0.05) for L2-normalised encoders "
                        "such as MiniLM, paper (τ 0.5) otherwise")
    p.add_argument("--no-learn", action="store_true", help="greedy top-M, no reranker updates")
    p.add_argument("--structured", action="store_true", help="JSON answers under the schema")
    p.add_argument("--per-user", action="store_true", help="one reranker per user")
    p.add_argument("--store-turns", action="store_true", help="also store raw turns as memories at /end")
    p.add_argument("--device", type=device, default="auto", help="auto | cpu | cuda[:N] (default: auto)")
    add_verbose(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rmm.encoders import load_encoder
    from rmm.frontends.agent import Agent
    from rmm.memory.bank import MemoryBank
    from rmm.memory.hybrid import HybridRetriever
    from rmm.policy.recipes import LearnerConfig

    llm = load_llm(args.llm, **llm_options(args))
    if llm.name == "simulated":
        raise RmmError("the simulated LLM writes no answers (it only cites, for benchmarks with gold evidence); "
                       "chat with hf:PATH, openai:URL@MODEL or vllm:PATH")
    encoder_name, fusion = first_stage_choice(args.retriever, args.encoder)
    bank = MemoryBank(args.bank, load_encoder(encoder_name, device=args.device), device=args.device)
    log_path = Path(args.bank) / CHAT_LOG
    # The screen is for the conversation: library warnings (e.g. a reply's citation problems) go to
    # a log file beside the bank instead of between the turns.
    restore_logging = logs.to_file(log_path, args.verbose)
    try:
        # the agent's rerankers weigh the first stage's candidate features (LearnerConfig's default)
        first_stage = (HybridRetriever(bank, fusion=fusion, candidate_features=LearnerConfig.candidate_features)
                       if fusion is not None else None)
        agent = Agent(bank, llm, first_stage=first_stage, k=args.k, m=args.m, tau=args.tau, recipe=args.recipe, learn=not args.no_learn,
                      structured=args.structured, per_user=args.per_user, store_turns=args.store_turns)
        try:
            controller = _controller(agent, args)
            console.print(f"[bold]rmm chat[/bold] · user {args.user} · {llm.name} · bank {args.bank}\n"
                          "[dim]/end ends the session (prospective reflection) · /memories lists memories · "
                          f"/quit saves and exits · log: {escape(str(log_path))}[/dim]")
            _converse(agent, controller, bank, args)
        finally:
            agent.close()
    finally:
        bank.close()
        llm.close()
        restore_logging()
    console.print("saved")
    return 0


def first_stage_choice(retriever: str, encoder: str | None) -> tuple[str, str | None]:
    """(the bank's encoder, the `HybridRetriever` fusion over it — None: the bank's own dense search)
    from --retriever and --encoder. Bare `hybrid` and `bm25` search the chat bank, whose encoder
    --encoder names; `hybrid:DENSE` and `bm25:DENSE` name it themselves."""
    from rmm.eval.benchmark_bank import OVER_DENSE, parse_retriever

    if retriever == "dense":
        return encoder or DEFAULT_RETRIEVER, None
    if retriever in OVER_DENSE:
        return encoder or DEFAULT_RETRIEVER, OVER_DENSE[retriever]
    parsed = parse_retriever(retriever)
    if parsed.fusion is None or parsed.dense is None:
        raise RmmError(f"--retriever must be dense, hybrid[:DENSE] or bm25[:DENSE], got {retriever!r}")
    if encoder is not None and encoder != parsed.dense:
        raise RmmError(f"--retriever {retriever} names the encoder {parsed.dense!r} but --encoder says {encoder!r}: "
                       "give one")
    return parsed.dense, parsed.fusion


def _converse(agent: Any, controller: Any, bank: Any, args: argparse.Namespace) -> None:
    """Read lines until /quit or end of input; commands start with a slash."""
    while True:
        try:
            line = input(f"{args.user}> ").strip()
        except EOFError:
            return
        if not line:
            continue
        if line == "/quit":
            return
        if line == "/end":
            touched = agent.end_session(args.user)
            console.print(f"[green]session ended[/green]: {len(touched)} topic memories added or merged")
        elif line == "/memories":
            _print_memories(bank, args.user)
        elif controller is not None:
            _controller_turn(controller, args, line)
        else:
            response = agent.respond(args.user, line)
            print_reply(response.answer, response.cited)
            if response.selection is not None and response.feedback.rewards is None:
                console.print("  [dim](no parseable citation: the reranker skipped this answer)[/dim]")


def _controller(agent: Any, args: argparse.Namespace) -> Any:
    """The GOAL-MEM or MemR³ front end over the agent, or None for direct chat."""
    config = frontend_config(args)
    if config is None:
        return None
    from rmm.frontends.controllers import open_controller

    return open_controller(agent, config)


def _controller_turn(controller: Any, args: argparse.Namespace, line: str) -> None:
    """One chat message through a front end: the answer, what it cites, and the trace."""
    from rmm.frontends.trace import print_trace

    response = controller.respond(args.user, line)
    print_reply(response.answer, response.cited)
    print_trace(response.trace, console, show_memories=args.verbose > 0)
    append_trace(args.trace_json, response.trace.to_json())


def print_reply(answer: str, cited: list[Any]) -> None:
    console.print(f"[bold]assistant>[/bold] {escape(answer)}", highlight=False)
    for memory in cited:
        console.print(f"  [dim]cited:[/dim] {escape(_short(memory.text))}", highlight=False)


def _short(text: str, width: int = 100) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def _print_memories(bank: Any, user: str) -> None:
    if not bank.store.has_user(user):
        console.print("[dim]no memories yet[/dim]")
        return
    for memory in bank.memories(user):
        console.print(f"  {escape(f'[{memory.kind}]')} {escape(_short(memory.text))}  "
                      f"[dim]({len(memory.refs)} turns)[/dim]", highlight=False)
