"""Choose the hybrid first stage's fusion rule on training data only.

Scores dense alone, BM25 alone, reciprocal-rank fusion and convex mixes of min-max scores on the
questions `rmm train` would train on (its own split: `rmm.training.splits`, same defaults, so the
held-out conversations are never read). Prints recall@5, recall@20 and nDCG@5 per rule.

    python research/choose_fusion.py --dataset locomo --dense minilm
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import shlex
import sys
import time
from pathlib import Path

from rmm.training.online import OnlineConfig
from rmm.training.splits import split_questions

from rmm.bench.ablations import commit
from rmm.data import load_dataset
from rmm.eval.benchmark_bank import open_retriever
from rmm.eval.retrieval import GoldScorer, evaluate, scorable
from rmm.memory.hybrid import HybridRetriever

log = logging.getLogger("choose_fusion")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="locomo")
    parser.add_argument("--dense", default="minilm")
    parser.add_argument("--rrf-k", type=float, nargs="+", default=[60.0, 10.0])
    parser.add_argument("--alpha", type=float, nargs="+", default=[0.3, 0.5, 0.7])
    parser.add_argument("--depth", type=int, default=50)
    parser.add_argument("--per-user", action="store_true", help="split as rmm train --per-user does")
    parser.add_argument("--out", type=Path, help="append one JSON line per rule (with the command and commit)")
    args = parser.parse_args()
    measured_at = commit()
    argv = [a for a in sys.argv[1:]]
    if "--out" in argv:  # the command that measures the rows, wherever they are written
        del argv[argv.index("--out"):argv.index("--out") + 2]
    command = shlex.join(["python", "research/choose_fusion.py", *argv])
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    dataset = load_dataset(args.dataset)
    cfg = OnlineConfig(per_user=args.per_user)
    split = split_questions(dataset, scorable(dataset.questions, GoldScorer.for_dataset(dataset, "turn")), cfg)
    train = dataclasses.replace(dataset, questions=list(split.train))
    log.info("training questions only: %d of %d (%s)", len(train.questions), len(dataset.questions),
             split.description.splitlines()[0][:200])
    dense = open_retriever(args.dense, dataset, "turn", progress=False).retriever
    lexical = open_retriever("bm25", dataset, "turn", progress=False).retriever
    rules = [("dense", dense), ("bm25", lexical)]
    rules += [(f"rrf k={k:g}", HybridRetriever(dense, fusion="rrf", rrf_k=k, depth=args.depth)) for k in args.rrf_k]
    rules += [(f"convex a={a:g}", HybridRetriever(dense, fusion="convex", alpha=a, depth=args.depth))
              for a in args.alpha]
    log.info("%-14s %6s %6s %7s %5s", "rule", "R@5", "R@20", "nDCG@5", "s")
    for name, retriever in rules:
        t0 = time.perf_counter()
        report = evaluate(train, retriever, "turn", (5, 20), retriever_name=name, progress=False)
        o = report.overall
        log.info("%-14s %6.1f %6.1f %7.1f %5.0f", name, 100 * o["recall@5"], 100 * o["recall@20"],
                 100 * o["ndcg@5"], time.perf_counter() - t0)
        if args.out:
            row = {"rule": name, "dataset": args.dataset, "questions": o["n"], "command": command,
                   "commit": measured_at, **{key: o[key] for key in ("recall@5", "recall@20", "ndcg@5")}}
            with args.out.open("a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
