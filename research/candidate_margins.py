"""Why a reranker of the top-K can or cannot use the headroom: score margins and exploration odds.

On a sample of the questions `rmm train` trains on (its own split, held-out users never read):
the spread of the retriever's top-K scores, where the gold memory sits, how often Gumbel top-M
sampling at each τ shows a gold memory the retriever ranked below M (what the learner can be
rewarded for), and recall@M when the question's fixed prefix (MSC: "What do you know about:")
is stripped (is the question form what hides the gold?).

    python research/candidate_margins.py --dataset msc --sample 600
"""

from __future__ import annotations

import argparse
import logging
import random
import re
import statistics

import torch
from rmm.training.online import OnlineConfig
from rmm.training.splits import split_questions

from rmm.data import load_dataset
from rmm.eval.benchmark_bank import open_retriever
from rmm.eval.retrieval import GoldScorer, scorable

log = logging.getLogger("candidate_margins")
PREFIX = re.compile(r"^what do you know about:\s*", re.IGNORECASE)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="msc")
    parser.add_argument("--retriever", default="minilm")
    parser.add_argument("--sample", type=int, default=600)
    parser.add_argument("--k", type=int, default=20)
    parser.add_argument("--m", type=int, default=5)
    parser.add_argument("--tau", type=float, nargs="+", default=[0.02, 0.05, 0.1, 0.5])
    parser.add_argument("--draws", type=int, default=200)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("bm25s").setLevel(logging.WARNING)

    dataset = load_dataset(args.dataset)
    scorer = GoldScorer.for_dataset(dataset, "turn")
    split = split_questions(dataset, scorable(dataset.questions, scorer), OnlineConfig())
    questions = random.Random(0).sample(split.train, min(args.sample, len(split.train)))
    bank = open_retriever(args.retriever, dataset, "turn", progress=False).retriever
    spread, gap, rank_hist, stripped_hits, hits = [], [], [0, 0, 0], 0, 0
    shown = {tau: 0.0 for tau in args.tau}
    below = 0
    gen = torch.Generator().manual_seed(0)
    for q in questions:
        gold = scorer.gold(q)
        (c,) = bank.search([q.text], q.user_id, args.k)
        (s,) = bank.search([PREFIX.sub("", q.text)], q.user_id, args.m)
        stripped_hits += any(set(m.refs) & gold for m in bank.get(q.user_id, s.memory_ids))
        refs = [m.refs for m in bank.get(q.user_id, c.memory_ids)]
        ranks = [i for i, r in enumerate(refs) if set(r) & gold]
        scores = c.retriever_scores
        spread.append(float(scores[0] - scores[-1]))
        first = ranks[0] if ranks else None
        rank_hist[0 if first is not None and first < args.m else 1 if first is not None else 2] += 1
        hits += first is not None and first < args.m
        if first is None or first < args.m:
            continue
        below += 1
        gap.append(float(scores[args.m - 1] - scores[first]))
        for tau in args.tau:
            keys = scores / tau - torch.log(-torch.log(torch.rand((args.draws, len(scores)), generator=gen)))
            picks = keys.topk(args.m, dim=1).indices
            shown[tau] += float((picks[:, :, None] == torch.tensor(ranks)).any(-1).any(-1).float().mean())
    n = len(questions)
    log.info("%s · %s · %d training questions sampled (held-out users never read)", args.dataset, args.retriever, n)
    log.info("top-%d score spread (rank 1 − rank %d): median %.3f", args.k, args.k, statistics.median(spread))
    log.info("first gold at rank ≤ %d: %.1f%%, in %d..%d: %.1f%%, not in top-%d: %.1f%%", args.m,
             100 * rank_hist[0] / n, args.m + 1, args.k, 100 * rank_hist[1] / n, args.k, 100 * rank_hist[2] / n)
    if gap:
        log.info("gold below M: score gap to rank %d median %.3f", args.m, statistics.median(gap))
        for tau in args.tau:
            log.info("τ %-5g a gold-below-M question gets a gold memory shown in %.1f%% of Gumbel top-%d draws",
                     tau, 100 * shown[tau] / below, args.m)
    log.info("recall_any@%d with the question as asked %.1f%%, prefix stripped %.1f%%", args.m, 100 * hits / n,
             100 * stripped_hits / n)


if __name__ == "__main__":
    main()
