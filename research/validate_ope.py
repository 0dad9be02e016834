"""Issue 32 item 3: `rmm.ope`'s estimates against the truth, on a benchmark with the simulated citer.

A reranker is trained online on the training users' questions (MiniLM candidates, K = 20, M = 5,
the `auto` recipe, the simulated citer), its weights snapshotted `--policies` times (the first
untrained). For every pair of snapshots (μ earlier, π later) selections are logged under μ on the
held-out users' questions (`--logged` of them: whole passes over the questions, each pass with
other Gumbel draws and citer draws), π is estimated from them by every estimator, and the truth is
π's on-policy reward per shown memory on the same questions: `--truth-draws` slates per question
sampled from π, each scored by its *expected* reward under the citer (P(cite) = recall for a gold
memory, the citer's false-cite rate otherwise, nothing cited without gold), so the truth's own
error is small and stated.

The simulated citer breaks the item-level estimators' assumption on purpose of its design: its
false-cite rate depends on how many gold memories share the slate, so a memory's reward depends
on its slate-mates; the slate-level ratio does not need the assumption.

    python research/validate_ope.py --dataset locomo --policies 7 --logged 2000
    python research/validate_ope.py --dataset msc --policies 7 --logged 2000

Prints one line per pair and a table of bias, RMSE, interval coverage and mean half-width per
estimator; `--out` writes all of it as JSON.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import os
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np
import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="locomo")
    parser.add_argument("--retriever", default="minilm")
    parser.add_argument("--policies", type=int, default=7, help="snapshots of the trained reranker (pairs: n(n-1)/2)")
    parser.add_argument("--logged", type=int, default=2000, help="logged selections per pair (at least)")
    parser.add_argument("--truth-draws", type=int, default=20, help="π's slates per question for the truth")
    parser.add_argument("--train-limit", type=int, default=0, help="training questions (0: all)")
    parser.add_argument("--eval-limit", type=int, default=0, help="held-out questions (0: all)")
    parser.add_argument("--bootstrap", type=int, default=500)
    parser.add_argument("--k", type=int, default=20)
    parser.add_argument("--m", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    from rmm.data import load_dataset
    from rmm.eval.benchmark_bank import open_retriever
    from rmm.eval.retrieval import GoldScorer, scorable
    from rmm.llm.simulated import SimulatedCiter
    from rmm.ope import OverlapError, RerankerTarget, evaluate, logged_from_selection
    from rmm.policy.learner import Learner, rewards_from_citations
    from rmm.policy.recipes import LearnerConfig, is_normalized_encoder, recipe_for
    from rmm.policy.reranker import ResidualLinearReranker

    started = time.perf_counter()
    dataset = load_dataset(args.dataset, download=False)
    opened = open_retriever(args.retriever, dataset, "turn", progress=False)
    bank = opened.retriever
    scorer = GoldScorer.for_dataset(dataset, "turn")
    questions = scorable(dataset.questions, scorer)
    users = sorted({q.user_id for q in questions})
    held = set(users[int(round(0.7 * len(users))):])  # the last 30% of users (sorted ids) are held out
    train = [q for q in questions if q.user_id not in held][: args.train_limit or None]
    test = [q for q in questions if q.user_id in held][: args.eval_limit or None]
    refs: dict[str, set[str]] = {}

    def candidates(qs: list[Any]) -> list[Any]:
        out = []
        for user in sorted({q.user_id for q in qs}):
            mine = [q for q in qs if q.user_id == user]
            refs.update({m.id: set(m.refs) for m in bank.memories(user)})
            out += list(zip(mine, bank.search([q.text for q in mine], user, args.k)))
        return out

    train_c, test_c = candidates(train), candidates(test)
    train_c = [(q, c) for q, c in train_c if len(c) >= args.m]
    test_c = [(q, c) for q, c in test_c if len(c) >= args.m]
    citer = SimulatedCiter(seed=args.seed)

    def hits(q: Any, c: Any, chosen: list[int]) -> list[bool]:
        gold = scorer.gold(q)
        return [bool(refs[c.memory_ids[i]] & gold) for i in chosen]

    recipe = recipe_for("auto", is_normalized_encoder(opened.encoder))
    names = {f.name for f in fields(LearnerConfig)}
    config = LearnerConfig(**{k: v for k, v in recipe.items() if k in names})
    torch.manual_seed(args.seed)
    learner = Learner(ResidualLinearReranker(bank.dim, lexical_feature=False), config)
    every = max(1, len(train_c) // max(1, args.policies - 1))
    snapshots = [copy.deepcopy(learner.reranker)]
    g = torch.Generator().manual_seed(args.seed)
    for i, (q, c) in enumerate(train_c, 1):
        s = learner.select([c], args.m, explore=True, generator=g)[0]
        cited = citer.cite(hits(q, c, s.chosen))
        learner.record(s, rewards_from_citations(len(s.chosen), cited, not cited))
        if i % every == 0 and len(snapshots) < args.policies:
            snapshots.append(copy.deepcopy(learner.reranker))
    while len(snapshots) < args.policies:
        snapshots.append(copy.deepcopy(learner.reranker))
    tau = config.tau
    print(f"# {args.dataset} · {args.retriever} · {len(train_c)} training / {len(test_c)} held-out questions · "
          f"K={args.k} M={args.m} τ={tau} · {args.policies} policies (every {every} questions; learner step "
          f"{learner.stats.step}) · load {os.getloadavg()[0]:.1f}", flush=True)

    def expected_rewards(q: Any, c: Any, chosen: list[int]) -> np.ndarray:
        h = hits(q, c, chosen)
        n_gold = sum(h)
        if n_gold == 0:
            return -np.ones(len(chosen))
        rate = citer.false_cite_rate(n_gold, len(h) - n_gold)
        return np.array([2 * (citer.recall if x else rate) - 1 for x in h])

    def truth(reranker: ResidualLinearReranker) -> tuple[float, float]:
        gen = torch.Generator().manual_seed(args.seed + 17)
        per_question = []
        for q, c in test_c:
            sels = reranker.select([c] * args.truth_draws, args.m, tau=tau, explore=True, generator=gen)
            per_question.append(np.mean([expected_rewards(q, c, s.chosen).mean() for s in sels]))
        values = np.array(per_question)
        # the error of the slate draws alone (the question set is fixed: the estimand is on these questions)
        draws_se = float(values.std() / math.sqrt(len(values) * args.truth_draws))
        return float(values.mean()), draws_se

    truths = [truth(r) for r in snapshots]
    passes = math.ceil(args.logged / len(test_c))
    results: list[dict[str, Any]] = []
    for i in range(len(snapshots)):
        for j in range(i + 1, len(snapshots)):
            gen = torch.Generator().manual_seed(args.seed * 1000 + i * 31 + j)
            pair_citer = SimulatedCiter(seed=args.seed * 1000 + i * 31 + j)
            rows = []
            for _ in range(passes):
                sels = snapshots[i].select([c for _, c in test_c], args.m, tau=tau, explore=True, generator=gen)
                for (q, c), s in zip(test_c, sels):
                    cited = pair_citer.cite(hits(q, c, s.chosen))
                    rows.append(logged_from_selection(s, rewards_from_citations(len(s.chosen), cited, not cited)))
            target = RerankerTarget(snapshots[j], tau=tau, name=f"policy {j}")
            true_value, true_se = truths[j]
            entry: dict[str, Any] = {"mu": i, "pi": j, "truth": true_value, "truth_se": true_se,
                                     "mu_truth": truths[i][0], "logged": len(rows)}
            try:
                report = evaluate(rows, target, bootstrap=args.bootstrap, seed=args.seed + i * 31 + j)
            except OverlapError as exc:
                entry["refused"] = str(exc)
                print(f"μ={i} π={j}: refused ({exc})", flush=True)
                results.append(entry)
                continue
            entry["estimates"] = {e.name: {"value": e.value, "low": e.low, "high": e.high, "ess": e.ess,
                                           "mean_weight": e.mean_weight} for e in report.estimates}
            results.append(entry)
            line = " ".join(f"{name} {e['value']:+.3f}" for name, e in entry["estimates"].items())
            print(f"μ={i} π={j}: truth {true_value:+.3f} (μ {truths[i][0]:+.3f}) | {line}", flush=True)

    summary: dict[str, dict[str, float]] = {}
    scored = [r for r in results if "estimates" in r]
    for name in ("ips", "ips-clipped", "snips", "dr", "slate"):
        err = np.array([r["estimates"][name]["value"] - r["truth"] for r in scored])
        cover = np.array([r["estimates"][name]["low"] <= r["truth"] <= r["estimates"][name]["high"] for r in scored])
        half = np.array([(r["estimates"][name]["high"] - r["estimates"][name]["low"]) / 2 for r in scored])
        summary[name] = {"bias": float(err.mean()), "rmse": float(np.sqrt((err ** 2).mean())),
                         "coverage": float(cover.mean()), "half_width": float(half.mean())}
    print(f"\n{len(scored)} policy pairs scored, {len(results) - len(scored)} refused; ≥{args.logged} logged "
          f"selections each; truth's draw error ≤ {max(t[1] for t in truths):.4f}; "
          f"{time.perf_counter() - started:.0f} s, load {os.getloadavg()[0]:.1f}")
    print(f"{'estimator':<12} {'bias':>8} {'RMSE':>8} {'coverage':>9} {'half-width':>11}")
    for name, s in summary.items():
        print(f"{name:<12} {s['bias']:+8.4f} {s['rmse']:8.4f} {100 * s['coverage']:8.0f}% {s['half_width']:11.4f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "pairs": results,
                                        "summary": summary}, indent=2))


if __name__ == "__main__":
    main()
