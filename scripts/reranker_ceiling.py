"""What the reranker's function class can reach at all: Eq. 1 fitted with gold labels, on training users only.

The online learner only hears citations of what it sampled. To tell "the learner cannot find the
gain" from "there is no gain a residual-linear reranker can generalise to new users", this fits the
same parametrisation (`s = (q + W_q q)·(m + W_m m)`, zero-initialised) *with the gold labels*
(listwise softmax cross-entropy over the top-K) on part of `rmm train`'s training users and scores
the other part — held-out users of the real split are never read. Recall@M of the retriever and of
the fitted reranker on the unseen training users, at several numbers of full-batch Adam steps.

    python scripts/reranker_ceiling.py --dataset msc
    python scripts/reranker_ceiling.py --dataset locomo

`--prefix-strip` removes MSC's "What do you know about:" before encoding (the question form).
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import re

import torch
from rmm.training.online import OnlineConfig
from rmm.training.splits import split_questions

from rmm.data import load_dataset
from rmm.encoders.passage_cache import attach_cache
from rmm.eval.benchmark_bank import open_retriever
from rmm.eval.retrieval import SEPARATE_CATEGORIES, GoldScorer, scorable

log = logging.getLogger("reranker_ceiling")
PREFIX = re.compile(r"^what do you know about:\s*", re.IGNORECASE)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="msc")
    parser.add_argument("--retriever", default="minilm")
    parser.add_argument("--k", type=int, default=20)
    parser.add_argument("--m", type=int, default=5)
    parser.add_argument("--fit-fraction", type=float, default=0.7, help="share of training users fitted on")
    parser.add_argument("--steps", type=int, nargs="+", default=[0, 25, 50, 100, 200, 400])
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--tau", type=float, default=0.05, help="softmax temperature of the listwise loss")
    parser.add_argument("--prefix-strip", action="store_true")
    parser.add_argument("--lexical-init", type=float, default=None,
                        help="hybrid candidates: add w·f (f = the fused score in [0, 1]) with w learned from this start")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    log.setLevel(logging.INFO)
    torch.manual_seed(0)

    dataset = load_dataset(args.dataset, download=False)
    opened = open_retriever(args.retriever, dataset, "turn", progress=False)
    attach_cache(opened.retriever.encoder)
    bank = opened.retriever
    scorer = GoldScorer.for_dataset(dataset, "turn")
    split = split_questions(dataset, scorable(dataset.questions, scorer), OnlineConfig())
    separate = set(SEPARATE_CATEGORIES.get(dataset.name, ()))
    users = sorted({q.user_id for q in split.train})
    random.Random(0).shuffle(users)
    fit_users = set(users[: round(len(users) * args.fit_fraction)])
    rows: dict[str, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, torch.Tensor]]] = {"fit": [], "check": []}
    for user in users:
        qs = [q for q in split.train if q.user_id == user and q.category not in separate]
        if not qs:
            continue
        refs = {m.id: m.refs for m in bank.memories(user)}
        texts = [PREFIX.sub("", q.text) if args.prefix_strip else q.text for q in qs]
        for q, c in zip(qs, bank.search(texts, user, args.k)):
            gold = scorer.gold(q)
            label = torch.tensor([bool(set(refs[mid]) & gold) for mid in c.memory_ids])
            if len(c) < args.k:
                continue
            rows["fit" if user in fit_users else "check"].append(
                (c.query_embedding.reshape(-1), c.embeddings, label, float(len(gold)),
                 torch.zeros(args.k) if getattr(c, "lexical", None) is None else c.lexical.reshape(-1).float()))
    tensors = {name: (torch.stack([r[0] for r in rs]), torch.stack([r[1] for r in rs]),
                      torch.stack([r[2] for r in rs]), torch.tensor([r[3] for r in rs]),
                      torch.stack([r[4] for r in rs])) for name, rs in rows.items()}
    dim = tensors["fit"][0].shape[1]
    w_q = torch.zeros(dim, dim, requires_grad=True)
    w_m = torch.zeros(dim, dim, requires_grad=True)
    w_lex = torch.tensor(args.lexical_init or 0.0, requires_grad=args.lexical_init is not None)
    opt = torch.optim.Adam([w_q, w_m] + ([w_lex] if args.lexical_init is not None else []), lr=args.lr)

    def scores(q: torch.Tensor, m: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
        """(q + W_q q)·(m + W_m m) (+ w·f), folded onto the query side: B·d² instead of B·K·d²."""
        folded = q + q @ w_q.T
        return torch.einsum("nd,nkd->nk", folded + folded @ w_m, m) + w_lex * f

    def recall(name: str) -> float:
        q, m, label, n_gold, f = tensors[name]
        with torch.no_grad():
            top = scores(q, m, f).topk(args.m, dim=1).indices
        found = label.gather(1, top).sum(1).float()
        return float((found / n_gold).clamp(max=1).mean())

    log.info("# %s · %s · fit on %d training users (%d questions), scored on %d other training users (%d) · "
             "held-out users never read · load %.1f", args.dataset, args.retriever, len(fit_users),
             len(rows["fit"]), len(users) - len(fit_users), len(rows["check"]), os.getloadavg()[0])
    ceiling = float((tensors["check"][2].any(1)).float().mean())
    log.info("check users: any gold in top-%d %.1f%%", args.k, 100 * ceiling)
    q, m, label, _, f = tensors["fit"]
    has_gold = label.any(1)
    done = 0
    for target in sorted(args.steps):
        while done < target:
            s = scores(q[has_gold], m[has_gold], f[has_gold]) / args.tau
            loss = -(torch.logsumexp(s.masked_fill(~label[has_gold], -1e9), 1) - torch.logsumexp(s, 1)).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            done += 1
        log.info("steps %4d  recall@%d fit users %.1f  unseen training users %.1f  w %.2f", done, args.m,
                 100 * recall("fit"), 100 * recall("check"), float(w_lex.detach()))
    getattr(opened.retriever, "close", lambda: None)()


if __name__ == "__main__":
    main()
