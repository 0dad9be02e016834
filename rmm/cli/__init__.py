"""The `rmm` command: evaluate retrievers, train the reranker online, chat, fetch data.

Applications wire objects and report; the work happens in the library. Errors rmm raises on bad
input are printed as one clear line (exit 2), never as a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from rmm.errors import RmmError

console = Console()
log = logging.getLogger("rmm")

DEFAULT_RETRIEVER = "minilm"


# -- shared options -------------------------------------------------------------------------------
def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data-dir", help="benchmark data folder (default: $RMM_DATA_DIR, else the user data dir)")
    p.add_argument("--cache-dir", help="where built banks are cached (default: $RMM_CACHE_DIR, else the user cache dir)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:N] (default: auto)")
    p.add_argument("--batch-size", type=int, default=64, help="encoder batch size")
    p.add_argument("--no-download", action="store_true", help="fail instead of downloading a missing dataset")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def _baseline(value: str) -> float | str:
    if value == "mean":
        return value
    try:
        return float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'mean', got {value!r}") from None


def _write_json(path: str | None, obj: Any) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(obj, indent=2))
        console.print(f"wrote {path}")


def _load(args: argparse.Namespace):
    from rmm.data import load_dataset

    return load_dataset(args.dataset, data_dir=args.data_dir, download=not args.no_download)


def _fmt(v: Any) -> str:
    return f"{100 * v:.1f}" if isinstance(v, float) else str(v)


# -- rmm eval -------------------------------------------------------------------------------------
def cmd_eval(args: argparse.Namespace) -> int:
    from rmm.eval.benchmark_bank import open_retriever
    from rmm.eval.retrieval import evaluate

    dataset = _load(args)
    llm = _load_llm(args.llm) if args.llm and "topic" in args.granularity else None
    reflector = {"merge_threshold": args.merge_threshold} if "topic" in args.granularity else None
    reports = {}
    for granularity in args.granularity:
        for name in args.retriever:
            opened = open_retriever(name, dataset, granularity, cache=args.cache_dir, device=args.device,
                                    batch_size=args.batch_size, index_backend=args.index,
                                    llm=llm if granularity == "topic" else None,
                                    reflector_options=reflector if granularity == "topic" else None)
            t0 = time.perf_counter()
            label = name if granularity != "topic" else f"{name} ({'PR: ' + llm.name if llm else 'PR: fallback topics'})"
            report = evaluate(dataset, opened.retriever, granularity, args.k, retriever_name=label)
            log.info("evaluated %s/%s in %.1fs", name, granularity, time.perf_counter() - t0)
            reports[f"{name}/{granularity}"] = report
            if len(args.granularity) == 1:
                _print_eval(report)
    if len(args.granularity) > 1:
        for name in args.retriever:
            _print_granularities([reports[f"{name}/{g}"] for g in args.granularity], name)
    if len(reports) == 1:
        _write_json(args.json, next(iter(reports.values())).to_json())
    else:
        _write_json(args.json, {key: r.to_json() for key, r in reports.items()})
    return 0


SHORT = {"recall": "R", "recall_any": "any", "recall_all": "all", "ndcg": "nDCG"}


def _print_eval(report) -> None:
    metrics = [(f"{m}@{k}", f"{SHORT[m]}@{k}") for k in report.ks for m in SHORT]
    table = Table(title=f"{report.dataset} · {report.retriever} · {report.granularity} granularity (%)",
                  caption="R = fractional recall, any / all = recall_any / recall_all")
    table.add_column("category", no_wrap=True)
    table.add_column("n", justify="right")
    for _, short in metrics:
        table.add_column(short, justify="right", no_wrap=True)
    separate = set(report.separate)
    for cat, row in report.by_category.items():
        table.add_row(f"{cat} {row['name']}" + (" (separate)" if cat in separate else ""), str(row["n"]),
                      *(_fmt(row.get(m)) for m, _ in metrics))
    label = "overall (" + ", ".join(c for c in report.by_category if c not in separate) + ")"
    table.add_row(f"[bold]{label}", f"[bold]{report.overall['n']}",
                  *(f"[bold]{_fmt(report.overall.get(m))}" for m, _ in metrics))
    console.print(table)
    if report.skipped:
        console.print(f"[dim]{report.skipped} questions without gold evidence were skipped[/dim]")


def _print_granularities(reports: list, retriever: str) -> None:
    """One table, granularities side by side (the paper's Fig. 4 comparison)."""
    first = reports[0]
    metrics = [(f"recall@{k}", f"R@{k}") for k in first.ks]
    table = Table(title=f"{first.dataset} · {retriever} · memory granularity (%)",
                  caption="R = fractional recall. turn and topic are scored on gold turns (topic through its "
                          "refs), session on gold sessions. topic = prospective reflection"
                          + next((f" · topic memories by {escape(r.retriever)}" for r in reports
                                  if r.granularity == "topic"), ""))
    table.add_column("category", no_wrap=True)
    table.add_column("n", justify="right")
    for r in reports:
        for _, short in metrics:
            table.add_column(f"{r.granularity} {short}", justify="right", no_wrap=True)
    separate = set(first.separate)
    for cat, row in first.by_category.items():
        cells = [_fmt(r.by_category.get(cat, {}).get(m)) for r in reports for m, _ in metrics]
        table.add_row(f"{cat} {row['name']}" + (" (separate)" if cat in separate else ""), str(row["n"]), *cells)
    label = "overall (" + ", ".join(c for c in first.by_category if c not in separate) + ")"
    table.add_row(f"[bold]{label}", f"[bold]{first.overall['n']}",
                  *(f"[bold]{_fmt(r.overall.get(m))}" for r in reports for m, _ in metrics))
    console.print(table)


def _load_llm(spec: str, **options: Any):
    from rmm.llm import load_llm

    return load_llm(spec, **options)


# -- rmm chat -------------------------------------------------------------------------------------
def cmd_chat(args: argparse.Namespace) -> int:
    from rmm.encoders import load_encoder
    from rmm.frontends.agent import Agent
    from rmm.memory.bank import MemoryBank

    llm = _load_llm(args.llm, **_llm_options(args))
    if llm.name == "simulated":
        raise RmmError("the simulated LLM writes no answers (it only cites, for benchmarks with gold evidence); "
                       "chat with hf:PATH, openai:URL@MODEL or vllm:PATH")
    bank = MemoryBank(args.bank, load_encoder(args.encoder, device=args.device), device=args.device)
    log_path = Path(args.bank) / CHAT_LOG
    restore_logging = _log_to_file(log_path, verbose=args.verbose)
    agent = Agent(bank, llm, k=args.k, m=args.m, tau=args.tau, recipe=args.recipe, learn=not args.no_learn,
                  structured=args.structured, per_user=args.per_user, store_turns=args.store_turns)
    goal = _goal_frontend(agent, args) if args.frontend == "goal" else None
    console.print(f"[bold]rmm chat[/bold] · user {args.user} · {llm.name} · bank {args.bank}\n"
                  "[dim]/end ends the session (prospective reflection) · /memories lists memories · "
                  f"/quit saves and exits · log: {escape(str(log_path))}[/dim]")
    try:
        while True:
            try:
                line = input(f"{args.user}> ").strip()
            except EOFError:
                break
            if not line:
                continue
            if line == "/quit":
                break
            if line == "/end":
                touched = agent.end_session(args.user)
                console.print(f"[green]session ended[/green]: {len(touched)} topic memories added or merged")
                continue
            if line == "/memories":
                _print_memories(bank, args.user)
                continue
            if goal is not None:
                _goal_turn(goal, args, line)
                continue
            response = agent.respond(args.user, line)
            _print_reply(response.answer, response.cited)
            if response.selection is not None and response.feedback.rewards is None:
                console.print("  [dim](no parseable citation: the reranker skipped this answer)[/dim]")
    finally:
        agent.close()
        bank.close()
        llm.close()
        restore_logging()
    console.print("saved")
    return 0


CHAT_LOG = "chat.log"


def _log_to_file(path: Path, verbose: bool = False) -> Callable[[], None]:
    """Keep the chat screen for the conversation: library warnings (e.g. a reply's citation
    problems) go to a log file beside the bank instead of between the turns. Returns the undo."""
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root, ours = logging.getLogger(), logging.getLogger("rmm")
    saved = (list(root.handlers), root.level, ours.level)
    for old in saved[0]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if verbose else logging.WARNING)
    ours.setLevel(logging.DEBUG if verbose else logging.INFO)

    def restore() -> None:
        root.removeHandler(handler)
        handler.close()
        for old in saved[0]:
            root.addHandler(old)
        root.setLevel(saved[1])
        ours.setLevel(saved[2])

    return restore


def _print_reply(answer: str, cited: list) -> None:
    console.print(f"[bold]assistant>[/bold] {escape(answer)}", highlight=False)
    for memory in cited:
        console.print(f"  [dim]cited:[/dim] {escape(_short(memory.text))}", highlight=False)


def _short(text: str, width: int = 100) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def _print_memories(bank, user: str) -> None:
    if not bank.store.has_user(user):
        console.print("[dim]no memories yet[/dim]")
        return
    for memory in bank.memories(user):
        console.print(f"  {escape(f'[{memory.kind}]')} {escape(_short(memory.text))}  [dim]({len(memory.refs)} turns)[/dim]",
                      highlight=False)


# -- the goal front end (GOAL-MEM) ---------------------------------------------------------------
GOAL_LLM_NOTE = ("the goal front end needs an LLM that writes text (hf:PATH, openai:URL@MODEL, vllm:PATH); "
                 "the simulated LLM only cites and cannot decompose")


def _goal_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--b-max", type=int, default=3, help="goal front end: decompositions tried (paper: 3)")
    p.add_argument("--d-max", type=int, default=5, help="goal front end: refinement depth (paper: 5)")
    p.add_argument("--budget", type=int, default=60, help="goal front end: distinct memories per question (paper: 60)")
    p.add_argument("--trace-json", help="goal front end: append each question's trace to this JSON-lines file")
    p.add_argument("--llm-threads", type=int, help="CPU threads for an hf: model (1 is fastest on a busy machine)")


def _llm_options(args: argparse.Namespace) -> dict[str, Any]:
    threads = getattr(args, "llm_threads", None)
    return {"threads": threads} if threads and args.llm.startswith("hf:") else {}


def _goal_config(args: argparse.Namespace, **overrides: Any):
    from rmm.frontends.goal import GoalConfig

    try:
        return GoalConfig(b_max=args.b_max, d_max=args.d_max, budget=args.budget, **overrides)
    except ValueError as error:
        raise RmmError(f"goal front end: {error}") from error


def _goal_frontend(agent, args: argparse.Namespace):
    from rmm.frontends.goal import GoalFrontend

    try:
        return GoalFrontend(agent, _goal_config(args))
    except ValueError as error:
        raise RmmError(str(error)) from error


def _append_trace(path: str | None, trace: dict[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as out:
            out.write(json.dumps(trace) + "\n")


def _goal_turn(goal, args: argparse.Namespace, line: str) -> None:
    """One chat message through the goal front end: the answer, what it cites, and the trace."""
    from rmm.frontends.trace import print_trace

    response = goal.respond(args.user, line)
    _print_reply(response.answer, response.cited)
    print_trace(response.trace, console, show_memories=args.verbose)
    _append_trace(args.trace_json, response.trace.to_json())


def cmd_eval_goal(args: argparse.Namespace) -> int:
    from rmm.eval.benchmark_bank import open_retriever
    from rmm.eval.goal_recall import evaluate_goal_recall
    from rmm.frontends.trace import print_trace

    dataset = _load(args)
    llm = _load_llm(args.llm, **_llm_options(args))
    if llm.name.startswith("simulated"):
        raise RmmError(GOAL_LLM_NOTE)
    opened = open_retriever(args.retriever, dataset, "turn", cache=args.cache_dir, device=args.device,
                            batch_size=args.batch_size)
    if opened.encoder is None:
        raise RmmError(f"the reranker needs a dense retriever; {args.retriever!r} has none")

    def show(question, trace) -> None:
        if args.show_trace:
            print_trace(trace, console)
        _append_trace(args.trace_json, trace.to_json())

    report = evaluate_goal_recall(dataset, opened.retriever, llm, category=args.category, limit=args.limit, k=args.k,
                                  m=args.m, config=_goal_config(args), answer=args.answer, on_trace=show)
    table = Table(title=f"{report.dataset} category {report.category} · gold-evidence recall at equal memory budget "
                        f"· {escape(report.llm)}",
                  caption="goal = union of the memories the goal front end's subgoal queries retrieved; direct = one "
                          "query with the question, same number of memories. Cost per question.")
    for column in ("n", "recall goal", "recall direct", "memories", "grounded", "LLM calls", "prompt tok",
                   "completion tok", "LLM s"):
        table.add_column(column, justify="right")
    table.add_row(str(report.n), _fmt(report.recall_goal), _fmt(report.recall_direct),
                  f"{report.memories_per_question:.1f}", _fmt(report.grounded), f"{report.llm_calls:.1f}",
                  f"{report.prompt_tokens:.0f}", f"{report.completion_tokens:.0f}", f"{report.seconds:.1f}")
    console.print(table)
    _write_json(args.json, report.to_json())
    return 0


# -- rmm eval-qa ----------------------------------------------------------------------------------
def cmd_eval_qa(args: argparse.Namespace) -> int:
    from rmm.eval.benchmark_bank import open_retriever
    from rmm.eval.qa import evaluate_qa

    dataset = _load(args)
    llm = _load_llm(args.llm, **_llm_options(args))
    if args.frontend == "goal" and llm.name.startswith("simulated"):
        raise RmmError(GOAL_LLM_NOTE)
    judge = _load_llm(args.judge_llm) if args.judge_llm else llm
    opened = open_retriever(args.retriever, dataset, args.granularity, cache=args.cache_dir, device=args.device,
                            batch_size=args.batch_size, llm=llm if args.granularity == "topic" and
                            not llm.name.startswith("simulated") else None)
    if opened.encoder is None:
        raise RmmError(f"the agent's reranker needs a dense retriever; {args.retriever!r} has none")
    report = evaluate_qa(dataset, opened.retriever, llm, judge, granularity=args.granularity, limit=args.limit,
                         k=args.k, m=args.m, frontend=args.frontend, learn=not args.no_learn,
                         goal_config=_goal_config(args) if args.frontend == "goal" else None)
    for row in report.rows:
        if "trace" in row:
            _append_trace(args.trace_json, row["trace"])
    _print_qa(report)
    _write_json(args.json, report.to_json())
    return 0


def _print_qa(report) -> None:
    simulated = report.simulated
    title = (f"{report.dataset} QA through the agent · {report.llm} · {report.granularity} memories"
             + (" · goal front end (GOAL-MEM)" if report.frontend == "goal" else ""))
    table = Table(title=title, caption="simulated generator: no answers, so no judge or F1 — citation and "
                                       "recall figures only" if simulated else "judge = LLM-judge accuracy (%)")
    columns = ["cited precision", "shown recall"] if simulated else ["judge", "F1", "cited precision", "shown recall"]
    table.add_column("category")
    table.add_column("n", justify="right")
    for c in columns:
        table.add_column(c, justify="right")
    keys = {"judge": "judge", "F1": "f1", "cited precision": "cited_precision", "shown recall": "shown_recall"}
    for cat, row in {**report.by_category, "overall": report.overall}.items():
        table.add_row(str(cat) + (f" {row['name']}" if row.get("name") else ""), str(row["n"]),
                      *(_fmt(row.get(keys[c])) for c in columns))
    console.print(table)


# -- rmm train / quickstart ----------------------------------------------------------------------
def cmd_train(args: argparse.Namespace) -> int:
    from rmm.eval.benchmark_bank import open_retriever
    from rmm.training.online import OnlineTrainer, plot

    dataset = _load(args)
    opened = open_retriever(args.retriever, dataset, "turn", cache=args.cache_dir, device=args.device,
                            batch_size=args.batch_size)
    if opened.encoder is None:
        raise RmmError(f"the reranker needs a dense retriever (embeddings); {args.retriever!r} has none")
    cfg = _online_config(args, normalized_encoder=opened.encoder.config.normalize)
    wandb_run = _wandb(args, cfg)
    t0 = time.perf_counter()
    trainer = OnlineTrainer(dataset, opened.retriever, cfg, output_dir=args.output, wandb_run=wandb_run)
    console.print(f"[bold]split[/bold]: {trainer.split.description}")
    report = trainer.run()
    elapsed = time.perf_counter() - t0
    if wandb_run is not None:
        wandb_run.summary.update({"reranker_prequential": report.reranker_prequential,
                                  "reranker_heldout": report.reranker_heldout})
        wandb_run.finish()
    _print_train(report, args.retriever, elapsed)
    _write_json(args.json, report.to_json())
    if args.plot:
        console.print(f"plot: {plot(report, args.plot)}")
    return 0


def _online_config(args: argparse.Namespace, normalized_encoder: bool):
    """The recipe's values, overridden by any hyper-parameter given on the command line."""
    from rmm.policy.learner import recipe_for
    from rmm.training.online import OnlineConfig

    values = recipe_for(args.recipe, normalized_encoder)
    given = {"tau": args.tau, "baseline": args.baseline, "lr": args.lr, "batch_size": args.update_every,
             "estimator": args.estimator, "optimizer": args.optimizer}
    values.update({k: v for k, v in given.items() if v is not None})
    return OnlineConfig(k=args.k, m=args.m, epochs=args.epochs, per_user=args.per_user, heldout_fraction=args.heldout,
                        seed=args.seed, citer=args.citer, precision=args.precision, recall=args.recall, **values)


def _wandb(args: argparse.Namespace, cfg) -> Any | None:
    """A W&B run when asked for (--wandb or $WANDB_PROJECT) and not disabled; else nothing."""
    wanted = args.wandb or os.environ.get("WANDB_PROJECT")
    if not wanted or os.environ.get("WANDB_MODE") == "disabled":
        return None
    try:
        import wandb
    except ImportError:
        raise RmmError("W&B logging was requested but wandb is not installed: pip install 'rmm[train]'") from None
    from dataclasses import asdict

    return wandb.init(project=args.wandb or os.environ.get("WANDB_PROJECT"), config=asdict(cfg),
                      job_type="online-reranker")


def _print_train(report, retriever: str, elapsed: float) -> None:
    from rmm.training.online import headline

    table = Table(title=f"Online reranker on {retriever} — citations: {report.citer} — categories 1–4 (%)")
    table.add_column("metric")
    table.add_column(f"{retriever} alone", justify="right")
    table.add_column("+ reranker", justify="right")
    table.add_column("lift (points)", justify="right")
    for name, before, after in headline(report):
        table.add_row(name, _fmt(before), _fmt(after), f"{100 * (after - before):+.1f}")
    console.print(table)
    ratio = report.cited_ratio
    if ratio:
        q = max(1, len(ratio) // 10)
        console.print(f"cited ratio: first {q} steps {sum(ratio[:q]) / q:.3f} → last {q} steps "
                      f"{sum(ratio[-q:]) / q:.3f}   ({len(ratio)} steps, {elapsed:.0f}s)")
    console.print(f"[dim]{report.split}[/dim]")


def cmd_quickstart(args: argparse.Namespace) -> int:
    out = Path(args.output)
    console.print("[bold]rmm quickstart[/bold]: LoCoMo · MiniLM · SQLite bank · simulated citations "
                  "(precision 0.876, recall 0.858 from the paper's Table 3)")
    ns = _train_parser_defaults()
    ns.update(data_dir=args.data_dir, cache_dir=args.cache_dir, device=args.device, verbose=args.verbose,
              json=str(out / "quickstart.json"), plot=str(out / "quickstart.png"), output=None,
              no_download=args.no_download, epochs=args.epochs)
    return cmd_train(argparse.Namespace(**ns))


def _train_parser_defaults() -> dict[str, Any]:
    p = argparse.ArgumentParser()
    _train_options(p)
    _common(p)
    return vars(p.parse_args([]))


def _train_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset", default="locomo")
    p.add_argument("--retriever", default=DEFAULT_RETRIEVER, help="encoder preset or folder (dense only)")
    p.add_argument("--citer", default="simulated", help="who cites: simulated (labelled in every output)")
    p.add_argument("--precision", type=float, default=0.876, help="simulated citer precision (paper Table 3)")
    p.add_argument("--recall", type=float, default=0.858, help="simulated citer recall (paper Table 3)")
    p.add_argument("--per-user", action="store_true", help="one reranker per user instead of one per bank")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--k", type=int, default=20, help="retrieved candidates K")
    p.add_argument("--m", type=int, default=5, help="memories shown M")
    p.add_argument("--recipe", default="auto", choices=("auto", "paper", "normalized"),
                   help="hyper-parameter recipe: paper = RMM App. A.1; normalized = for L2-normalised "
                        "encoders; auto (default) picks by the encoder. Flags below override it.")
    p.add_argument("--tau", type=float, help="Gumbel temperature (paper: 0.5)")
    p.add_argument("--baseline", type=_baseline,
                   help="REINFORCE baseline b: a number (paper: 0.5) or 'mean' (running mean reward)")
    p.add_argument("--lr", type=float, help="learning rate (paper: 1e-3)")
    p.add_argument("--update-every", type=int, help="records per REINFORCE update (paper: 4)")
    p.add_argument("--estimator", choices=("plackett-luce", "paper"),
                   help="log-prob of the selection: plackett-luce (default) or paper-literal")
    p.add_argument("--optimizer", choices=("adam", "sgd"), help="adam (default) or sgd")
    p.add_argument("--heldout", type=float, default=0.3, help="fraction held out (conversations, or per user the last questions)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", help="run directory: checkpoints and resumable state")
    p.add_argument("--json", help="write the report as JSON")
    p.add_argument("--plot", help="write the learning curves as PNG")
    p.add_argument("--wandb", metavar="PROJECT", help="log to Weights & Biases (or set $WANDB_PROJECT)")


# -- rmm data -------------------------------------------------------------------------------------
def cmd_data_download(args: argparse.Namespace) -> int:
    from rmm.data.download import download
    from rmm.paths import data_dir

    path = download(args.name, data_dir(args.data_dir))
    console.print(f"{args.name}: {path}")
    return 0


# -- rmm llm serve --------------------------------------------------------------------------------
def cmd_llm_serve(args: argparse.Namespace) -> int:
    """Start `vllm serve` on loopback, wait until it answers, keep it up until Ctrl-C."""
    from rmm.llm.vllm_server import start_vllm_server, stop_server

    log_path = Path(args.log) if args.log else None
    console.print(f"starting vLLM for {args.model} on http://{args.host}:{args.port}/v1 …")
    proc = start_vllm_server(args.model, host=args.host, port=args.port, extra_args=args.vllm_args,
                             python=args.python, timeout_s=args.timeout, log_path=log_path)
    console.print(f"ready — use --llm openai:http://{args.host}:{args.port}/v1@{args.model}  (Ctrl-C stops it)")
    try:
        proc.wait()
    except KeyboardInterrupt:
        pass
    finally:
        stop_server(proc)
    return 0


# -- entry point ----------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rmm", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("eval", help="Recall@K of retrievers on a benchmark, per category")
    p.add_argument("--dataset", default="locomo", help="locomo | longmemeval[:s|m|oracle] | msc | a file")
    p.add_argument("--retriever", nargs="+", default=[DEFAULT_RETRIEVER],
                   help="minilm | bm25 | contriever | stella | gte | an encoder folder (several allowed)")
    p.add_argument("--granularity", nargs="+", choices=("turn", "session", "topic"), default=["turn"],
                   help="memory units; topic = built by prospective reflection (several: one comparison table)")
    p.add_argument("--k", type=int, nargs="+", default=[5, 10])
    p.add_argument("--index", default="torch", help="torch | faiss-flat | faiss-ivf | faiss-hnsw")
    p.add_argument("--llm", help="LLM spec for topic extraction (default: the labelled non-LLM fallback)")
    p.add_argument("--merge-threshold", type=float, default=0.8,
                   help="fallback topics: cosine above which a topic merges into an existing one")
    p.add_argument("--json", help="write the numbers as JSON")
    _common(p)
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("chat", help="terminal chat with the RMM agent (memories, citations, online reranker)")
    p.add_argument("--bank", required=True, help="bank folder (created if absent)")
    p.add_argument("--user", required=True)
    p.add_argument("--llm", required=True, help="openai:URL@MODEL | hf:PATH | vllm:PATH | simulated")
    p.add_argument("--encoder", default=DEFAULT_RETRIEVER, help="encoder preset or folder (must match the bank)")
    p.add_argument("--frontend", default="direct", choices=("direct", "goal"),
                   help="direct = one query per message; goal = GOAL-MEM goal decomposition, one query per "
                        "subgoal, with a trace of every message (" + GOAL_LLM_NOTE + ")")
    _goal_options(p)
    p.add_argument("--k", type=int, default=20)
    p.add_argument("--m", type=int, default=5)
    p.add_argument("--tau", type=float, help="Gumbel temperature (default: the recipe's)")
    p.add_argument("--recipe", default="auto", choices=("auto", "paper", "normalized"),
                   help="learner hyper-parameters; auto = normalized (τ 0.05) for L2-normalised encoders "
                        "such as MiniLM, paper (τ 0.5) otherwise")
    p.add_argument("--no-learn", action="store_true", help="greedy top-M, no reranker updates")
    p.add_argument("--structured", action="store_true", help="JSON answers under the schema")
    p.add_argument("--per-user", action="store_true", help="one reranker per user")
    p.add_argument("--store-turns", action="store_true", help="also store raw turns as memories at /end")
    p.add_argument("--device", default="auto")
    p.add_argument("-v", "--verbose", action="store_true")
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("eval-qa", help="answer benchmark questions through the agent; judge accuracy and F1")
    p.add_argument("--dataset", default="locomo")
    p.add_argument("--llm", required=True, help="generator spec (simulated: citations and recall only)")
    p.add_argument("--judge-llm", help="judge spec (default: the generator)")
    p.add_argument("--retriever", default=DEFAULT_RETRIEVER)
    p.add_argument("--granularity", default="turn", choices=("turn", "session", "topic"))
    p.add_argument("--limit", type=int, help="answer at most N questions (in dataset order)")
    p.add_argument("--k", type=int, default=20)
    p.add_argument("--m", type=int, default=5)
    p.add_argument("--no-learn", action="store_true",
                   help="show the plain top-M and update nothing (default: learn online, Gumbel-sampled M)")
    p.add_argument("--frontend", default="direct", choices=("direct", "goal"),
                   help="direct = the question as one query; goal = GOAL-MEM goal decomposition (needs a real LLM)")
    _goal_options(p)
    p.add_argument("--json", help="write the numbers as JSON")
    _common(p)
    p.set_defaults(func=cmd_eval_qa)

    p = sub.add_parser("eval-goal", help="GOAL-MEM retrieval: gold-evidence recall of the goal front end's memories "
                                         "vs one direct query with the same number of memories")
    p.add_argument("--dataset", default="locomo")
    p.add_argument("--category", type=int, default=1, help="question category (LoCoMo 1 = multi-hop)")
    p.add_argument("--llm", required=True, help="hf:PATH | openai:URL@MODEL | vllm:PATH (" + GOAL_LLM_NOTE + ")")
    p.add_argument("--retriever", default=DEFAULT_RETRIEVER, help="dense encoder preset or folder (turn memories)")
    p.add_argument("--limit", type=int, help="at most N questions (in dataset order)")
    p.add_argument("--k", type=int, default=20, help="candidates per subgoal query")
    p.add_argument("--m", type=int, default=5, help="memories selected per subgoal query")
    _goal_options(p)
    p.add_argument("--answer", action="store_true", help="also write the final answer (one more call per question)")
    p.add_argument("--show-trace", action="store_true", help="print each question's trace")
    p.add_argument("--json", help="write the numbers, per-question rows and traces as JSON")
    _common(p)
    p.set_defaults(func=cmd_eval_goal)

    p = sub.add_parser("train", help="train the reranker online from citations and report the lift")
    _train_options(p)
    _common(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("quickstart", help="the main job on embedded defaults: LoCoMo, MiniLM, simulated citations")
    p.add_argument("--output", default="rmm-quickstart", help="folder for the JSON report and the plot")
    p.add_argument("--epochs", type=int, default=1)
    _common(p)
    p.set_defaults(func=cmd_quickstart)

    from rmm.training.pretrain_cli import add_pretrain_command

    add_pretrain_command(sub)

    from rmm.serve.cli import register as add_serve_command

    add_serve_command(sub)

    p = sub.add_parser("llm", help="LLM helpers")
    llm_sub = p.add_subparsers(dest="llm_command", required=True)
    d = llm_sub.add_parser("serve", help="start `vllm serve` for a model and wait until it is ready")
    d.add_argument("model", help="model folder or Hugging Face id known to the local cache")
    d.add_argument("--host", default="127.0.0.1")
    d.add_argument("--port", type=int, default=8000)
    d.add_argument("--python", help="python of the virtualenv that has vLLM (default: this one)")
    d.add_argument("--timeout", type=float, default=600, help="seconds to wait for readiness")
    d.add_argument("--log", help="write the server's output here")
    d.add_argument("vllm_args", nargs=argparse.REMAINDER, help="after `--`: arguments passed to vLLM")
    d.add_argument("-v", "--verbose", action="store_true")
    d.set_defaults(func=cmd_llm_serve)

    p = sub.add_parser("data", help="benchmark data")
    data_sub = p.add_subparsers(dest="data_command", required=True)
    d = data_sub.add_parser("download", help="download a benchmark from its public source")
    d.add_argument("name", choices=("locomo", "longmemeval"))
    d.add_argument("--data-dir")
    d.add_argument("-v", "--verbose", action="store_true")
    d.set_defaults(func=cmd_data_download)
    return parser


def _quiet_transformers() -> None:
    """Our own progress bars say what is happening; transformers' per-load weight bar is noise."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.disable_progress_bar()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if getattr(args, "verbose", False) else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    _quiet_transformers()
    try:
        return args.func(args)
    except RmmError as e:
        console.print(f"[red]error:[/red] {e}", highlight=False)
        return 2
    except KeyboardInterrupt:
        console.print("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
