"""`rmm train`: the reranker trained online from citations, reported as the lift over the retriever
alone; `rmm quickstart`: the same on embedded defaults (LoCoMo, MiniLM, simulated citations)."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

from rich.markup import escape

from rmm.cli.arguments import (
    CheckedParser,
    non_negative_int,
    open_fraction,
    positive_float,
    positive_int,
    positive_probability,
    probability,
    rerankable_retriever_name,
    store_url,
    trainable_citer,
    unrerankable,
)
from rmm.cli.common import (
    DEFAULT_RETRIEVER,
    add_common_options,
    add_dedup_option,
    add_k_m_options,
    console,
    fmt,
    load_benchmark,
    write_json,
)
from rmm.cli.settings import PRECEDENCE, add_config_options
from rmm.cli.tables import Figures, headroom_cell, print_figures, question_set
from rmm.errors import RmmError

CREDIT_FORMS = ("per-pick", "reward-to-go", "sequence")  # rmm.policy.credit.CREDITS (not imported: --help stays light)

__all__ = ["add_train_command_options", "quickstart_settings", "register", "run", "run_quickstart", "train_figures"]


def _baseline(value: str) -> float | str:
    if value == "mean":
        return value
    try:
        return float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'mean', got {value!r}") from None


def add_train_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset", default="locomo")
    add_dedup_option(p)
    p.add_argument("--retriever", type=rerankable_retriever_name, default=DEFAULT_RETRIEVER,
                   help="encoder preset or folder, hybrid[:DENSE] (BM25 + dense, fused) or bm25:DENSE (BM25's ranking over the dense bank; plain bm25 has no embeddings to rerank)")
    p.add_argument("--granularity", choices=("turn", "session", "topic", "event"), default="turn",
                   help="memories the reranker learns over: turns (default), whole sessions, topic memories "
                        "built by prospective reflection's non-LLM fallback, or the events of CompassMem's fallback "
                        "event graph; recall counts gold turns they hold")
    p.add_argument("--citer", type=trainable_citer, default="simulated",
                   help="who cites: simulated (default; labelled in every output) or a real generator, "
                        "openai:URL@MODEL (e.g. a vllm serve server), vllm:PATH or hf:PATH")
    p.add_argument("--precision", type=positive_probability, default=0.876,
                   help="simulated citer precision (paper Table 3)")
    p.add_argument("--recall", type=probability, default=0.858, help="simulated citer recall (paper Table 3)")
    p.add_argument("--per-user", action="store_true", help="one reranker per user instead of one per bank")
    p.add_argument("--epochs", type=positive_int, default=1)
    add_k_m_options(p)
    p.add_argument("--recipe", default="auto", choices=("auto", "paper", "normalized"),
                   help="hyper-parameter recipe: paper = RMM App. A.1; normalized = for L2-normalised "
                        "encoders; auto (default) picks by the encoder. Flags below override it.")
    p.add_argument("--tau", type=positive_float, help="Gumbel temperature (paper: 0.5)")
    p.add_argument("--baseline", type=_baseline,
                   help="REINFORCE baseline b: a number (paper: 0.5) or 'mean' (running mean reward)")
    p.add_argument("--lr", type=positive_float, help="learning rate (paper: 1e-3)")
    p.add_argument("--update-every", type=positive_int, help="records per REINFORCE update (paper: 4)")
    p.add_argument("--estimator", choices=("plackett-luce", "paper"),
                   help="log-prob of the selection: plackett-luce (default) or paper-literal")
    p.add_argument("--optimizer", choices=("adam", "sgd"), help="adam (default) or sgd")
    p.add_argument("--credit", choices=CREDIT_FORMS,
                   help="credit of each pick: per-pick (the paper's), reward-to-go or sequence")
    p.add_argument("--no-is", action="store_true",
                   help="no importance correction of stale rewards (default: weight by min(clip, π/μ))")
    p.add_argument("--is-clip", type=positive_float, help="truncation of the importance ratio π/μ (default 1)")
    p.add_argument("--no-lexical-feature", dest="lexical_feature", action="store_false",
                   help="plain Eq. 1: no learned weight for the first stage's scaled BM25 score (our extension; "
                        "it acts only on --retriever hybrid[:DENSE] and bm25:DENSE candidates)")
    p.add_argument("--no-candidate-features", dest="candidate_features", action="store_false",
                   help="no learned weights for the first stage's per-candidate features (ranks, BM25 score, "
                        "cosine, length, query overlap; our extension, on hybrid[:DENSE] and bm25:DENSE candidates)")
    p.add_argument("--delay", type=non_negative_int, default=0,
                   help="deliver each reward only after this many further learner updates (staleness study)")
    p.add_argument("--heldout", type=open_fraction, default=0.3,
                   help="fraction held out (conversations; per user, questions of the later sessions)")
    p.add_argument("--limit", type=positive_int, help="train on the first N training questions only")
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--output", help="run directory: checkpoints and resumable state")
    p.add_argument("--json", help="write the report as JSON")
    p.add_argument("--plot", help="write the learning curves as PNG")
    p.add_argument("--wandb", metavar="PROJECT", help="log to Weights & Biases (or set $WANDB_PROJECT)")
    p.add_argument("--store", type=store_url,
                   help="keep the benchmark bank in PostgreSQL + pgvector (postgresql://…) instead of the cache folder")
    g = p.add_argument_group("real generator (--citer openai:/vllm:/hf:)")
    g.add_argument("--structured", action="store_true",
                   help="ask for JSON answers {answer, citations} (constrained decoding where the backend has it)")
    g.add_argument("--concurrency", type=positive_int, default=16, help="requests in flight on an openai: server")
    g.add_argument("--llm-batch", type=positive_int, default=16,
                   help="questions per generate call of an in-process vllm: or hf: generator")
    g.add_argument("--max-tokens", type=positive_int, default=256, help="longest reply, in tokens")
    g.add_argument("--llm-threads", type=positive_int, help="CPU threads of an hf: generator")


def add_train_command_options(p: argparse.ArgumentParser) -> None:
    """Everything `rmm train` takes: its flags, the common options, then `--config FILE [key=value …]`."""
    add_train_options(p)
    add_common_options(p)
    add_config_options(p, label="training config", example="configs/train/online-minilm-cpu.yaml")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("train", help="train the reranker online from citations and report the lift",
                              description="Train the reranker online from citations (REINFORCE) and report the "
                                          "lift over the retriever alone on held-out questions. " + PRECEDENCE,
                              epilog="e.g. rmm train --config configs/train/online-contriever-a100.yaml epochs=1 "
                                     "--device cuda:1")
    add_train_command_options(p)
    p.set_defaults(func=run)

    p = subparsers.add_parser("quickstart",
                              help="the main job on embedded defaults: LoCoMo, MiniLM, simulated citations")
    p.add_argument("--output", default="rmm-quickstart", help="folder for the JSON report and the plot")
    p.add_argument("--epochs", type=positive_int, default=1)
    add_common_options(p)
    p.set_defaults(func=run_quickstart)


def run(args: argparse.Namespace) -> int:
    from rmm.eval.benchmark_bank import open_retriever
    from rmm.training.online import OnlineTrainer, plot
    from rmm.training.online_report import split_summary

    dataset = load_benchmark(args)
    opened = open_retriever(args.retriever, dataset, args.granularity, cache=args.cache_dir, device=args.device,
                            batch_size=args.batch_size, store=args.store, candidate_features=args.candidate_features)
    if opened.encoder is None:  # a name that skipped the parser (command line and config go through its type)
        raise RmmError(unrerankable(args.retriever) or f"{args.retriever!r} gives no embeddings to rerank")
    cfg = _online_config(args, normalized_encoder=opened.encoder.config.normalize)
    wandb_run = _wandb(args, cfg)
    t0 = time.perf_counter()
    trainer = OnlineTrainer(dataset, opened.retriever, cfg, output_dir=args.output, wandb_run=wandb_run)
    console.print(f"[bold]split[/bold]: {escape(split_summary(trainer.split, cfg.per_user))} "
                  "[dim](every user: --json)[/dim]")
    report = trainer.run()
    elapsed = time.perf_counter() - t0
    if wandb_run is not None:
        wandb_run.summary.update({"reranker_prequential": report.reranker_prequential,
                                  "reranker_heldout": report.reranker_heldout, "generation": report.generation})
        wandb_run.finish()
    label = args.retriever if args.granularity == "turn" else f"{args.retriever} ({args.granularity} memories)"
    if report.questions.get("scorable", 1):
        print_figures(train_figures(report, label, question_set(dataset, args.no_dedup)), console)
    else:  # a table of nan: nothing in it can be measured
        console.print(f"no recall table: none of the {len(dataset.questions):,} questions has gold turn ids "
                      f"({report.questions.get('without_gold_trained', 0):,} trained from the citations alone)",
                      highlight=False)
    _print_same_questions(report.same_questions, len(report.cited_ratio), elapsed)
    _print_generation(report)
    _print_rewards(report)
    console.print(f"[dim]{escape(report.split_summary)}[/dim]")
    write_json(args.json, {**report.to_json(), "granularity": args.granularity})
    if args.plot:
        console.print(f"plot: {plot(report, args.plot)}")
    return 0


def run_quickstart(args: argparse.Namespace) -> int:
    console.print("[bold]rmm quickstart[/bold]: LoCoMo · MiniLM · SQLite bank · simulated citations "
                  "(precision 0.876, recall 0.858 from the paper's Table 3)")
    return run(quickstart_settings(args))


def quickstart_settings(args: argparse.Namespace) -> argparse.Namespace:
    """What `rmm quickstart` runs: `rmm train` on its built-in defaults, reports in `--output`, no
    checkpoints. `configs/train/online-minilm-cpu.yaml` holds the same settings (a test keeps them equal)."""
    out = Path(args.output)
    defaults = CheckedParser(prog="rmm train")
    add_train_command_options(defaults)
    ns = vars(defaults.parse_args([]))
    ns.update(data_dir=args.data_dir, cache_dir=args.cache_dir, device=args.device, batch_size=args.batch_size,
              verbose=args.verbose, json=str(out / "quickstart.json"), plot=str(out / "quickstart.png"),
              output=None, no_download=args.no_download, epochs=args.epochs)
    return argparse.Namespace(**ns)


def _online_config(args: argparse.Namespace, normalized_encoder: bool) -> Any:
    """The recipe's values, overridden by any hyper-parameter given on the command line."""
    from rmm.policy.learner import recipe_for
    from rmm.training.online import OnlineConfig

    values = recipe_for(args.recipe, normalized_encoder)
    given = {"tau": args.tau, "baseline": args.baseline, "lr": args.lr, "batch_size": args.update_every,
             "estimator": args.estimator, "optimizer": args.optimizer, "credit": args.credit,
             "is_clip": args.is_clip, "llm_threads": args.llm_threads, "limit": args.limit}
    values.update({k: v for k, v in given.items() if v is not None})
    return OnlineConfig(k=args.k, m=args.m, epochs=args.epochs, per_user=args.per_user, heldout_fraction=args.heldout,
                        seed=args.seed, citer=args.citer, precision=args.precision, recall=args.recall,
                        importance=not args.no_is, delay=args.delay, structured=args.structured,
                        lexical_feature=args.lexical_feature, candidate_features=args.candidate_features,
                        concurrency=args.concurrency, llm_batch=args.llm_batch, max_tokens=args.max_tokens, **values)


def _wandb(args: argparse.Namespace, cfg: Any) -> Any | None:
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


def train_figures(report: Any, retriever: str, questions: str = "") -> Figures:
    """Each headline metric for the retriever alone, with the reranker, and the lift in points; after
    each stream's rows its ceiling (recall@K of the K candidates, which reordering cannot change)
    and the share of the headroom up to it that the reranker captured. The caption says at which
    cut-offs (M: what the generator is shown; K: the retriever's list) and on which questions
    (`questions`: the dataset's question set, `rmm.cli.tables.question_set`)."""
    from rmm.training.online import headline
    from rmm.training.online_report import headroom

    room = report.headroom or headroom(report)
    k, m = room["k"], room["m"]
    figures = Figures(title=f"Online reranker on {escape(retriever)} — citations: {escape(report.citer)} — "
                            f"{escape(report.headline_questions)} (%)",
                      caption=_train_caption(report, k, m, questions),
                      columns=["metric", "retriever alone", "+ reranker", "lift (points)"])
    for name, before, after in headline(report):
        figures.add_row(name, fmt(before), fmt(after), f"{100 * (after - before):+.1f}")
        stream = {f"prequential ndcg@{m}": "prequential", f"held-out ndcg@{m}": "heldout"}.get(name)
        if stream and k is not None and room[stream][f"retriever_recall@{k}"] is not None:
            label = stream.replace("heldout", "held-out")
            ceiling = room[stream][f"retriever_recall@{k}"]
            figures.add_row(f"{label} recall@{k} = ceiling", fmt(ceiling), fmt(ceiling), "")
            figures.add_row(f"{label} headroom captured", "", headroom_cell(room[stream]["captured"]), "")
    return figures


def _train_caption(report: Any, k: int | None, m: int, questions: str) -> str:
    """Which cut-offs the rows are read at, and how many questions they cover."""
    from rmm.training.online_report import turn_budget_metrics

    shown = report.config.get("m", m)
    memories = "memory" if shown == 1 else "memories"
    at = (f"figures @{m}: among the M = {m} {memories} the generator is shown" if m == shown
          else f"figures @{m}: among the first {m} of the M = {shown} {memories} the generator is shown")
    parts = [at + (f"; recall@{k}: among the retriever's K = {k} candidates the reranker reorders (the ceiling)"
                   if k is not None else "")]
    if turn_budget_metrics(report.retriever):
        parts.append(f"R@Tt: recall within T dialogue turns of the {m} shown (whole memories in order while their "
                     "turns add up to at most T), comparing memories of different sizes at equal text")
    counts = report.questions or {}
    if counts:
        used = (f"{counts['train']:,} training questions (prequential: each scored before its own update) and "
                f"{counts['heldout']:,} held out")
        unscorable = counts["dataset"] - counts["scorable"]
        trained = counts.get("without_gold_trained", 0)
        if trained:
            used += f"; {trained:,} without gold evidence trained from the citations alone (no recall on them)"
        if unscorable - trained:
            used += f"; {unscorable - trained:,} without gold evidence left out"
        if counts.get("dropped"):
            used += f"; {counts['dropped']:,} dropped by the split"
        parts.append(f"{questions}: {used}" if questions else used)
    elif questions:
        parts.append(questions)
    return ". ".join(parts)


def _print_same_questions(lift: dict[str, Any], steps: int, elapsed: float) -> None:
    """The retriever alone and the reranker on the same questions, at the start and the end of the
    training stream (`rmm.training.online_report.same_question_lift`): whether the lift grew."""
    if not lift:
        return

    def window(name: str) -> str:
        before, after = lift[name]["retriever"], lift[name]["reranker"]
        return f"retriever {100 * before:.1f}, + reranker {100 * after:.1f} ({100 * (after - before):+.1f})"

    console.print(f"prequential {lift['metric']} on the same questions — first {lift['questions']} of the stream: "
                  f"{window('first')}; last {lift['questions']}: {window('last')}   ({steps} steps, {elapsed:.0f}s)",
                  highlight=False)


def _print_rewards(report: Any) -> None:
    """What a real generator's citations say without gold (`rmm.training.online_report.reward_figures`):
    the cited ratio, the reward per shown slot, the reward curve's first and last stretch; and that
    recall needs gold. The simulated citer cites from the gold, so its run prints none of this."""
    r = report.rewards
    if report.generation.get("kind", "simulated") == "simulated" or not r or not r["rewarded"]:
        return

    def pct(value: float | None) -> str:
        return "n/a" if value is None else f"{100 * value:.1f}%"

    def num(value: float | None) -> str:
        return "n/a" if value is None else f"{value:+.3f}"

    split = (f" (with gold {pct(r['cited_ratio_with_gold'])}, without {pct(r['cited_ratio_without_gold'])})"
             if r["rewarded_without_gold"] else "")
    console.print(f"rewards, measured without gold over {r['rewarded']} rewarded questions "
                  f"({r['rewarded_without_gold']} without gold): cited ratio {pct(r['cited_ratio'])}{split}; "
                  f"reward per shown slot {' '.join(num(v) for v in r['reward_per_slot'])}; mean reward, first "
                  f"{r['window']} {num(r['mean_reward_first'])} → last {r['window']} {num(r['mean_reward_last'])}",
                  highlight=False, markup=False)
    console.print(escape(r["recall"]), style="dim")


def _print_generation(report: Any) -> None:
    """What a real generator did (replies, parse failures, calls, tokens, speed) and how stale rewards were."""
    g, stale = report.generation, report.staleness
    if g.get("kind", "simulated") != "simulated":
        console.print(
            f"generator {escape(g['kind'])} {escape(g['model'])}: {g['replies']} replies, "
            f"{g['unusable']} unusable ({100 * g['parse_failure_rate']:.1f}%; {g['example_copies']} copied the "
            f"example), {g['llm_calls']} LLM calls, {g['prompt_tokens']} prompt + {g['completion_tokens']} "
            f"completion tokens ({g['completion_tokens_per_question']:.0f} per question); "
            f"{g['seconds_per_question']:.2f} s/question, {g['questions_per_second']:.2f} questions/s "
            f"with {g['concurrency']} in flight", highlight=False)
    if stale.get("rewarded") and (stale["delay"] or stale["mean_steps"]):
        console.print(f"reward staleness: {stale['mean_steps']:.1f} learner updates on average "
                      f"(max {stale['max_steps']}; --delay {stale['delay']})", highlight=False)
