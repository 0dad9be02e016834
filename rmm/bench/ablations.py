"""Reranker ablations on the training stream only: many `rmm train` configurations in one process.

Each named run is `rmm.training.online.OnlineTrainer` (the program behind `rmm train`, simulated
citer) on the recipe `rmm train` picks (`auto`) plus the run's overrides. The bank is opened once,
query vectors come from an on-disk cache (`rmm.encoders.passage_cache`), and — unless `--read-heldout`
is given — only the training stream is run: held-out questions are neither searched nor scored,
so no choice made from this script's output can have seen them.

Per run it prints the prequential figures (each question scored by the reranker *before* its own
update): recall@M of the retriever and of the reranker, the lift over the whole stream and over
its second half (after the learner has had half the stream), recall@K of the candidate set (the
ceiling), the share of headroom captured, and how often the Gumbel-sampled selection showed a gold
memory the retriever ranked below M (what the learner can be rewarded for).

    python -m rmm.bench.ablations --dataset msc --limit 3000 \\
        --run base --run tau0.5:tau=0.5 --run seq:credit='"sequence"'

`--run NAME[:KEY=JSON,KEY=JSON...]` takes `OnlineConfig` fields (`lexical_init`: w's starting
value, among them) and `feature` (a hybrid first stage's lexical-feature definition, `FeatureVariant` of
`rmm/bench/lexical_spread.py`); one JSON line per run goes to `--out`.
`candidate_features=false|true` switches the per-candidate features (`rmm.memory.features`) on the
hybrid first stage and the reranker's weights for them together (default: the library's,
`LearnerConfig.candidate_features`):

    python -m rmm.bench.ablations --dataset msc --retriever hybrid --limit 3000 \\
        --run on --run off:candidate_features=false --threads 1
With `--read-heldout` the whole `rmm train` program runs (held-out scored too): use it once per
final candidate only. `--alone` scores the retriever alone on the held-out questions of each run's
own configuration (its split settings, K and M: `--run NAME:k=30,m=8,per_user=true --alone`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shlex
import subprocess
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from rmm.bench.lexical_spread import FeatureVariant
from rmm.training.online import Asked, OnlineConfig, OnlineTrainer
from rmm.training.splits import split_questions

from rmm.cli.logs import ByOrigin
from rmm.data import load_dataset
from rmm.encoders.passage_cache import attach_cache
from rmm.eval.benchmark_bank import open_retriever
from rmm.eval.metrics import TURN_BUDGETS
from rmm.eval.retrieval import (
    SEPARATE_CATEGORIES,
    GoldScorer,
    headroom_captured,
    scorable,
)
from rmm.memory.hybrid import HybridRetriever
from rmm.policy.learner import recipe_for

log = logging.getLogger("rmm.bench.ablations")
PREFIX = re.compile(r"^what do you know about:\s*", re.IGNORECASE)
EXTRAS = ("feature",)  # run settings that are not OnlineConfig fields
TURN_METRICS = tuple(f"recall_turns@{t}" for t in TURN_BUDGETS)  # R@T of the M memories shown


class CountingTrainer(OnlineTrainer):
    """`OnlineTrainer` that also counts, per sampled selection, whether it showed a gold memory
    that the retriever ranked below M (the only selections that can teach the reranker to promote)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.promoting = 0
        self.sampled = 0

    def ask(self, index: int) -> Asked:
        asked = super().ask(index)
        gold = self.scorer.gold(asked.question)
        cand = self.cands[asked.question.id]
        below = {i for i, mid in enumerate(cand.memory_ids) if i >= self.cfg.m and set(self.refs[mid]) & gold}
        if asked.epoch == 0:
            self.sampled += 1
            self.promoting += bool(below & set(asked.selection.chosen))
        return asked


def parse_run(spec: str) -> tuple[str, dict[str, Any]]:
    name, _, rest = spec.partition(":")
    overrides = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        overrides[key] = json.loads(value)
    return name, overrides


def run_config(spec: str, recipe: dict[str, Any], limit: int | None
               ) -> tuple[str, dict[str, Any], dict[str, Any], OnlineConfig]:
    """A `--run` spec as (name, its overrides, those that are not `OnlineConfig` fields, the run's
    config: the recipe, `--limit` and the overrides) — one config for the trained run and its baseline."""
    name, overrides = parse_run(spec)
    fields = {key: value for key, value in overrides.items() if key not in EXTRAS}
    extras = {key: value for key, value in overrides.items() if key in EXTRAS}
    return name, overrides, extras, OnlineConfig(**{**recipe, "limit": limit, **fields})


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def commit() -> str | None:
    """The checkout's commit (``-dirty`` when it has uncommitted changes), or None outside git: every
    row names the code that measured it, so a table can refuse rows of different commits."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "rmm", "training"],
                               cwd=root, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("-dirty" if dirty else "")


def row_command(args: argparse.Namespace, spec: str) -> str:
    """The one command that measures this row alone (its own `--run`), as a person would type it."""
    argv = ["python", "-m", "rmm.bench.ablations", "--dataset", args.dataset, "--retriever", args.retriever,
            "--granularity", args.granularity]
    argv += ["--limit", str(args.limit)] if args.limit is not None else []
    argv += ["--recipe", args.recipe] if args.recipe != "auto" else []
    argv += [flag for flag, on in (("--no-dedup", args.no_dedup), ("--strip-prefix", args.strip_prefix),
                                   ("--read-heldout", args.read_heldout), ("--alone", args.alone)) if on]
    argv += ["--run", spec]
    argv += ["--threads", str(args.threads)] if args.threads is not None else []
    return shlex.join(argv)


def prequential(trainer: CountingTrainer) -> dict[str, Any]:
    """The run's training-stream figures (headline questions: the dataset's separate categories excluded)."""
    cfg, separate = trainer.cfg, set(SEPARATE_CATEGORIES.get(trainer.dataset.name, ()))
    qs = [q for e, q in trainer.stream if e == 0 and q.id in trainer.rows["reranker"] and q.category not in separate]
    metric = f"recall@{cfg.eval_k}"
    ret = [trainer.rows["retriever"][q.id][metric] for q in qs]
    rer = [trainer.rows["reranker"][q.id][metric] for q in qs]
    ceiling = [trainer.scorer.score([trainer.refs[mid] for mid in trainer.cands[q.id].memory_ids], q,
                                    [cfg.k])[f"recall@{cfg.k}"] for q in qs]
    half = len(qs) // 2
    out = {"questions": len(qs), "retriever": mean(ret), "reranker": mean(rer), f"ceiling_recall@{cfg.k}": mean(ceiling),
           "lift": mean(rer) - mean(ret), "lift_second_half": mean(rer[half:]) - mean(ret[half:]),
           "ndcg_retriever": mean([trainer.rows["retriever"][q.id][f"ndcg@{cfg.eval_k}"] for q in qs]),
           "ndcg_reranker": mean([trainer.rows["reranker"][q.id][f"ndcg@{cfg.eval_k}"] for q in qs]),
           "promoting_selections": trainer.promoting / max(trainer.sampled, 1)}
    out["headroom_captured"] = headroom_captured(out["reranker"], out["retriever"], out[f"ceiling_recall@{cfg.k}"])
    out["headroom_captured_second_half"] = headroom_captured(
        mean(rer[half:]), mean(ret[half:]), mean(ceiling[half:]))
    return out


def heldout_table(trainer: CountingTrainer) -> dict[str, dict[str, Any]]:
    """Held-out figures per category and for the headline questions: the retriever's order and the
    trained reranker's (greedy), recall@M, recall@K, nDCG@M, headroom captured."""
    cfg, separate = trainer.cfg, set(SEPARATE_CATEGORIES.get(trainer.dataset.name, ()))
    ks = sorted({cfg.eval_k, cfg.k})
    groups: dict[str, list[tuple[dict[str, float], dict[str, float]]]] = {}
    for q in trainer.split.heldout:
        cand = trainer.cands[q.id]
        orders = {"base": list(range(len(cand))), "reranked": trainer.greedy(cand, q.user_id)}
        rows = {}
        for name, order in orders.items():
            refs = [trainer.refs[cand.memory_ids[i]] for i in order]
            rows[name] = trainer.scorer.score(refs, q, ks, budgets=())
            rows[name].update(trainer.scorer.turn_budgets(refs[: cfg.eval_k], q))  # R@T of the M shown
        pair = (rows["base"], rows["reranked"])
        groups.setdefault(f"category {q.category}", []).append(pair)
        if q.category not in separate:
            groups.setdefault("headline", []).append(pair)
    table = {}
    for group, pairs in sorted(groups.items()):
        fig: dict[str, Any] = {"questions": len(pairs)}
        for side, idx in (("base", 0), ("reranked", 1)):
            for metric in (f"recall@{cfg.eval_k}", f"recall@{cfg.k}", f"ndcg@{cfg.eval_k}"):
                fig[f"{side} {metric}"] = mean([pair[idx][metric] for pair in pairs])
            for metric in TURN_METRICS:  # questions with gold turns only (`score_turn_budgets`)
                fig[f"{side} {metric}"] = mean([pair[idx][metric] for pair in pairs if metric in pair[idx]])
        fig["headroom_captured"] = headroom_captured(fig[f"reranked recall@{cfg.eval_k}"],
                                                     fig[f"base recall@{cfg.eval_k}"], fig[f"base recall@{cfg.k}"])
        table[group] = fig
    return table


def alone_table(dataset: Any, retriever: Any, cfg: OnlineConfig) -> dict[str, dict[str, Any]]:
    """The retriever alone (any retriever, BM25 included) on the held-out questions of the split `cfg`
    makes (as `rmm train` with it would), scored at its K and at M (`cfg.eval_k`)."""
    assert cfg.eval_k is not None  # M, set by OnlineConfig
    k, m = cfg.k, cfg.eval_k
    scorer = GoldScorer.for_dataset(dataset, "turn")
    split = split_questions(dataset, scorable(dataset.questions, scorer), cfg)
    separate = set(SEPARATE_CATEGORIES.get(dataset.name, ()))
    groups: dict[str, list[dict[str, float]]] = {}
    for user in dict.fromkeys(q.user_id for q in split.heldout):
        qs = [q for q in split.heldout if q.user_id == user]
        refs = {mem.id: mem.refs for mem in _get_memories(retriever, user)}
        for q, cand in zip(qs, retriever.search([q.text for q in qs], user, k)):
            shown = [refs[mid] for mid in cand.memory_ids]
            row = scorer.score(shown, q, sorted({m, k}), budgets=())
            row.update(scorer.turn_budgets(shown[:m], q))  # R@T of the M shown
            groups.setdefault(f"category {q.category}", []).append(row)
            if q.category not in separate:
                groups.setdefault("headline", []).append(row)
    table = {}
    for group, rows in sorted(groups.items()):
        fig: dict[str, Any] = {"questions": len(rows)}
        for metric in (f"recall@{m}", f"recall@{k}", f"ndcg@{m}"):
            fig[f"base {metric}"] = mean([r[metric] for r in rows])
            fig[f"reranked {metric}"] = None
        for metric in TURN_METRICS:
            fig[f"base {metric}"] = mean([r[metric] for r in rows if metric in r])
            fig[f"reranked {metric}"] = None
        fig["headroom_captured"] = None
        table[group] = fig
    return table


def _get_memories(retriever: Any, user: str) -> list[Any]:
    """Every memory of `user` (dense banks, hybrids and BM25 all expose their store)."""
    return retriever.store.memories(user)


def train_only(trainer: CountingTrainer) -> None:
    """The simulated `run()` without the held-out half: candidates of the training stream, every item, drain."""
    streamed = list({q.id: q for _, q in trainer.stream}.values())
    trainer.cands = trainer.candidates(streamed, trainer.split.visible_sessions)
    for index in range(len(trainer.stream)):
        trainer.step(index)
    trainer.drain()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="msc")
    parser.add_argument("--no-dedup", action="store_true", help="LoCoMo: keep its 12 repeated questions, as "
                                                                  "rmm train --no-dedup does")
    parser.add_argument("--retriever", default="minilm")
    parser.add_argument("--granularity", default="turn", choices=("turn", "session", "topic"))
    parser.add_argument("--limit", type=int, default=None, help="train on the first N training questions")
    parser.add_argument("--run", action="append", default=[], metavar="NAME[:KEY=JSON,...]")
    parser.add_argument("--recipe", default="auto")
    parser.add_argument("--read-heldout", action="store_true",
                        help="run the whole rmm train program and report held-out figures (final candidates only)")
    parser.add_argument("--strip-prefix", action="store_true",
                        help="diagnostic only: drop MSC's 'What do you know about:' from every question")
    parser.add_argument("--alone", action="store_true",
                        help="no training: the retriever alone on the held-out questions (final table only)")
    parser.add_argument("--out", type=Path, help="append one JSON line per run")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (1 on a shared machine; default: torch's own)")
    args = parser.parse_args()
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    for handler in logging.getLogger().handlers:  # bm25s sets DEBUG on its own logger: rmm's INFO, others' warnings
        handler.addFilter(ByOrigin(logging.INFO, logging.WARNING))
    log.setLevel(logging.INFO)

    measured_at = commit()
    dataset = load_dataset(args.dataset, download=False, dedup=not args.no_dedup)
    if args.strip_prefix:
        dataset.questions = [replace(q, text=PREFIX.sub("", q.text)) for q in dataset.questions]
    opened = open_retriever(args.retriever, dataset, args.granularity, progress=False)
    recipe = recipe_for(args.recipe, opened.encoder is not None and opened.encoder.config.normalize)
    if args.alone:
        if opened.encoder is not None:
            attach_cache(opened.retriever.encoder)
        for spec in args.run or ["base"]:
            name, overrides, _, cfg = run_config(spec, recipe, args.limit)
            row = {"name": "alone", "run": name, "overrides": overrides, "dataset": args.dataset,
                   "command": row_command(args, spec), "commit": measured_at,
                   "retriever": args.retriever, "granularity": args.granularity,
                   "config": {key: getattr(cfg, key) for key in ("k", "m", "eval_k", "per_user", "heldout_fraction",
                                                                 "seed")},
                   "heldout": alone_table(dataset, opened.retriever, cfg), "load": os.getloadavg()[0]}
            h, m, k = row["heldout"]["headline"], cfg.eval_k, cfg.k
            log.info("%s · %s · %s alone (%s), HELD-OUT R@%d %.1f R@%d %.1f nDCG@%d %.1f", args.dataset,
                     args.retriever, args.granularity, name, m, 100 * h[f"base recall@{m}"], k,
                     100 * h[f"base recall@{k}"], m, 100 * h[f"base ndcg@{m}"])
            if args.out:
                with args.out.open("a") as f:
                    f.write(json.dumps(row, default=str) + "\n")
        return
    attach_cache(opened.retriever.encoder)
    log.info("# %s · %s · %s memories · recipe %s · limit %s · load %.1f", args.dataset, args.retriever,
             args.granularity, recipe, args.limit, os.getloadavg()[0])
    featured = [spec for spec in args.run or [] if "feature" in parse_run(spec)[1]]
    if featured and not isinstance(opened.retriever, HybridRetriever):  # before any run, not after the first ones
        raise SystemExit(f"error: {featured[0]!r} sets feature= but --retriever {args.retriever} is not a hybrid "
                         "or bm25:DENSE first stage (its candidates carry no lexical feature)")
    for spec in args.run or ["base"]:
        name, overrides, extras, cfg = run_config(spec, recipe, args.limit)
        retriever = opened.retriever
        if "feature" in extras:  # another lexical-feature definition (rmm/bench/lexical_spread.py)
            retriever = FeatureVariant(retriever, extras["feature"])
        if isinstance(opened.retriever, HybridRetriever):  # the first stage computes what the reranker weighs
            opened.retriever.candidate_features = cfg.candidate_features
        started, cpu = time.perf_counter(), time.process_time()
        trainer = CountingTrainer(dataset, retriever, cfg, progress=False)
        report = trainer.run() if args.read_heldout else None
        if report is None:
            train_only(trainer)
        row: dict[str, Any] = {"name": name, "dataset": args.dataset, "retriever": args.retriever,
                               "command": row_command(args, spec), "commit": measured_at,
                               "granularity": args.granularity, "strip_prefix": args.strip_prefix,
                               "limit": args.limit, "overrides": overrides, "prequential": prequential(trainer),
                               "seconds": time.perf_counter() - started, "cpu_seconds": time.process_time() - cpu,
                               "load": os.getloadavg()[0]}
        p = row["prequential"]
        hc = p["headroom_captured"]
        line = (f"{name:<14} prequential R@{cfg.eval_k} {100 * p['retriever']:.1f} → {100 * p['reranker']:.1f} "
                f"({100 * p['lift']:+.1f}; 2nd half {100 * p['lift_second_half']:+.1f})  "
                f"R@{cfg.k} {100 * p[f'ceiling_recall@{cfg.k}']:.1f}  headroom "
                f"{'n/a' if hc is None else f'{100 * hc:.0f}%'}  promoting draws {100 * p['promoting_selections']:.1f}%  "
                f"{row['cpu_seconds']:.0f} s CPU  load {row['load']:.1f}")
        if report is not None:
            k = cfg.eval_k
            row["heldout"] = heldout_table(trainer)
            h = row["heldout"]["headline"]
            line += (f"  HELD-OUT R@{k} {100 * report.retriever_heldout[f'recall@{k}']:.1f} → "
                     f"{100 * report.reranker_heldout[f'recall@{k}']:.1f}; R@{cfg.k} {100 * h[f'base recall@{cfg.k}']:.1f}")
        log.info("%s", line)
        if args.out:
            with args.out.open("a") as f:
                f.write(json.dumps(row, default=str) + "\n")
    getattr(opened.retriever, "close", lambda: None)()


if __name__ == "__main__":
    main()
