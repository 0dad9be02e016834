"""Does an online learner reach what the supervised feature fit reaches? A prototype, training stream only.

`research/reranker_ceiling.py --features` fits per-candidate features with gold labels; this runs
the same score (`q′·m′ + w·f + Σ w_i f_i`, raw features, no standardisation an online system could
not know) through the online recipe `rmm train` uses — Gumbel top-M at τ, the simulated citer
(precision 0.876, recall 0.858: cited +1, shown and not cited −1), per-pick Plackett–Luce REINFORCE
with the running-mean baseline, batches of 4, Adam — on the first `--limit` questions of
`rmm train`'s training stream (split seed 0; held-out users are never searched). Figures are
prequential, as in `rmm/bench/ablations.py`: each question is scored greedily by the weights
before its own update. A prototype of the learner's arithmetic, not the library's learner: run
`--specs fused` first and compare with the library's own figure for the same setting.

    python research/reranker_online_features.py --dataset msc --limit 3000 --specs fused all all:nores
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import time

import torch
from rmm.training.online import OnlineConfig
from rmm.training.splits import split_questions

from rmm.data import load_dataset
from rmm.encoders.passage_cache import attach_cache
from rmm.eval.benchmark_bank import open_retriever
from rmm.eval.retrieval import GoldScorer, headroom_captured, scorable
from rmm.bench.reranker_features import feature_names
from rmm.policy.sampling import gumbel_top_m, plackett_luce_logp
from reranker_ceiling import ALL_FEATURES, FeatureReranker, collect, stack

log = logging.getLogger("reranker_online_features")


def simulated_cites(hits: torch.Tensor, precision: float, recall: float, gen: torch.Generator) -> torch.Tensor:
    """`rmm.llm.simulated`: gold cited with prob `recall`, others at the rate giving micro precision `precision`."""
    n_gold = hits.sum(1, keepdim=True).float()
    n_other = hits.shape[1] - n_gold
    rate = torch.where((n_gold > 0) & (n_other > 0),
                       (recall * n_gold * (1 - precision) / precision / n_other.clamp(min=1)).clamp(max=1), 0.0)
    p = torch.where(hits, torch.full_like(rate, recall).expand_as(hits), rate.expand_as(hits))
    p = torch.where(n_gold > 0, p, torch.zeros_like(p))
    return torch.rand(hits.shape, generator=gen) < p


def run(spec: str, args: argparse.Namespace, rows, order: list[int], headline: torch.Tensor, check=None) -> dict:
    """One online run over the stream; prequential recall@M of the first stage and the reranker."""
    parts = spec.split(":")
    options = {o for o in parts[1:] if "=" not in o}
    values = dict(o.split("=", 1) for o in parts[1:] if "=" in o)  # lr=, flr=, w0=, tau= override the flags
    lr, feature_lr = float(values.get("lr", args.lr)), float(values.get("flr", args.feature_lr))
    w0, tau = float(values.get("w0", args.lexical_init)), float(values.get("tau", args.tau))
    names = [n for n in feature_names(parts[0].split("+")) if n != args.base_feature]
    cols = [ALL_FEATURES.index(n) for n in names]
    fused_col = ALL_FEATURES.index(args.base_feature)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(args.seed)
    model = FeatureReranker(rows.q.shape[1], len(cols), w0, "nores" not in options,
                            args.mlp_hidden if "mlp" in options else 0)
    groups = [{"params": [model.w_fused, model.w] + ([] if model.mlp is None else list(model.mlp.parameters())),
               "lr": feature_lr}]
    if "nores" not in options:
        groups.append({"params": [model.w_q, model.w_m], "lr": lr})
    opt = torch.optim.Adam(groups)
    reward_sum, reward_count = 0.0, 0
    base_hits, rer_hits = [], []
    start = time.process_time()
    for b0 in range(0, len(order), args.batch_size):
        idx = torch.tensor(order[b0:b0 + args.batch_size])
        q, m, label, n_gold = rows.q[idx], rows.m[idx], rows.label[idx], rows.n_gold[idx]
        fused, f = rows.feats[idx][..., fused_col], rows.feats[idx][..., cols]
        with torch.no_grad():
            s = model(q, m, fused, f)
            greedy = s.topk(args.m, dim=1).indices
            scored = headline[idx]
            rer_hits += (label.gather(1, greedy).sum(1) / n_gold).clamp(max=1)[scored].tolist()
            base_hits += (label[:, : args.m].sum(1) / n_gold).clamp(max=1)[scored].tolist()
            chosen, _ = gumbel_top_m(s, args.m, tau, gen)
        cited = simulated_cites(label.gather(1, chosen), args.precision, args.recall, gen)
        rewards = cited.float() * 2 - 1
        baseline = reward_sum / reward_count if reward_count else 0.0
        logp = plackett_luce_logp(model(q, m, fused, f), chosen, tau)
        loss = -((rewards - baseline) * logp).sum(1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        reward_sum, reward_count = reward_sum + float(rewards.sum()), reward_count + rewards.numel()
    unseen = {}
    if check is not None:
        with torch.no_grad():
            s = model(check.q, check.m, check.feats[..., fused_col], check.feats[..., cols])
        u_base = 100 * float((check.label[:, : args.m].sum(1) / check.n_gold).clamp(max=1).mean())
        u_rer = 100 * float((check.label.gather(1, s.topk(args.m, dim=1).indices).sum(1) / check.n_gold)
                            .clamp(max=1).mean())
        u_ceiling = 100 * float((check.label.sum(1) / check.n_gold).clamp(max=1).mean())
        u_share = headroom_captured(u_rer, u_base, u_ceiling)
        unseen = {"unseen_questions": len(check.q), "unseen_base": u_base, "unseen_reranked": u_rer,
                  "unseen_lift": u_rer - u_base, "unseen_ceiling": u_ceiling,
                  "unseen_headroom": None if u_share is None else 100 * u_share}
    half = len(base_hits) // 2
    mean = lambda xs: 100 * sum(xs) / len(xs)
    ceiling = mean((rows.label.sum(1) / rows.n_gold).clamp(max=1)[headline].tolist())
    base, rer = mean(base_hits), mean(rer_hits)
    share = headroom_captured(rer, base, ceiling)
    return {**unseen, "spec": spec, "lr": lr, "feature_lr": feature_lr, "w0": w0, "tau": tau, "questions": len(order), "scored": len(base_hits), "base": base, "reranked": rer, "lift": rer - base,
            "lift_second_half": mean(rer_hits[half:]) - mean(base_hits[half:]), "ceiling": ceiling,
            "headroom": None if share is None else 100 * share, "cpu_s": time.process_time() - start,
            "w_fused": round(float(model.w_fused.detach()), 3),
            "weights": dict(zip(names, [round(float(w), 3) for w in model.w.detach()]))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="msc")
    parser.add_argument("--retriever", default="hybrid")
    parser.add_argument("--limit", type=int, default=3000, help="the first N questions of the training stream")
    parser.add_argument("--specs", nargs="+", default=["fused", "all"], metavar="SPEC",
                        help="GROUP[+GROUP...][:nores][:mlp][:lr=X][:flr=X][:w0=X][:tau=X] as in "
                             "reranker_ceiling.py --features; lr/flr/w0/tau override the flags for that spec")
    parser.add_argument("--k", type=int, default=20)
    parser.add_argument("--m", type=int, default=5)
    parser.add_argument("--tau", type=float, default=0.05)
    parser.add_argument("--lr", type=float, default=3e-4, help="Adam lr of W_q, W_m (recipe normalized)")
    parser.add_argument("--feature-lr", type=float, default=3e-4, help="Adam lr of the scalar feature weights")
    parser.add_argument("--lexical-init", type=float, default=1.0, help="w of the fused score at start")
    parser.add_argument("--base-feature", default="fused", choices=ALL_FEATURES,
                        help="the feature in w·f: fused (RRF) or bm25_minmax (the library's lexical feature now)")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--mlp-hidden", type=int, default=32)
    parser.add_argument("--precision", type=float, default=0.876)
    parser.add_argument("--recall", type=float, default=0.858)
    parser.add_argument("--seed", type=int, default=0, help="sampling and citer noise (not the split)")
    parser.add_argument("--depth", type=int, default=50)
    parser.add_argument("--prefix-strip", action="store_true")
    parser.add_argument("--unseen-fraction", type=float, default=0.0,
                        help="keep this share of the training users out of the stream and score them after it "
                             "with the final weights (0.3 = reranker_ceiling.py's unseen users)")
    parser.add_argument("--out", default=None, help="append one JSON line per spec")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    log.setLevel(logging.INFO)

    dataset = load_dataset(args.dataset, download=False)
    opened = open_retriever(args.retriever, dataset, "turn", progress=False)
    attach_cache(opened.retriever.encoder)
    scorer = GoldScorer.for_dataset(dataset, "turn")
    split = split_questions(dataset, scorable(dataset.questions, scorer), OnlineConfig())
    unseen: list[str] = []
    if args.unseen_fraction:  # the same unseen training users as reranker_ceiling.py's 70/30 split
        shuffled = sorted({q.user_id for q in split.train})
        random.Random(0).shuffle(shuffled)
        unseen = shuffled[round(len(shuffled) * (1 - args.unseen_fraction)):]
    stream = [q for q in split.train if q.user_id not in set(unseen)][: args.limit]  # rmm train's order
    users = list(dict.fromkeys(q.user_id for q in stream))
    held_back = [q for q in split.train if q.user_id in set(unseen)]
    limited = argparse.Namespace(**vars(args))
    split.train = stream + held_back
    # the whole stream is learned from (as rmm train does); figures are read on the headline questions
    by_user = collect(limited, dataset, opened.retriever, scorer, split, users + unseen, with_features=True,
                      keep_separate=True)
    flat = [r for u in users for r in by_user.get(u, [])]
    rows = stack(flat)
    headline = torch.tensor([r[5] for r in flat])
    order = list(range(len(rows.q)))
    check = None
    if unseen:  # scored greedily after the stream, by the final weights: users the learner never saw
        check_flat = [r for u in unseen for r in by_user.get(u, []) if r[5]]
        check = stack(check_flat)
    log.info("# %s · %s · online prototype on the first %d training questions (%d users, %d with %d candidates) · "
             "w0·%s, w0 %g, τ %g lr %g feature lr %g · held-out users never read · load %.1f", args.dataset, args.retriever,
             len(stream), len(users), len(order), args.k, args.base_feature, args.lexical_init, args.tau, args.lr,
             args.feature_lr,
             os.getloadavg()[0])
    for spec in args.specs:
        r = run(spec, args, rows, order, headline, check)
        r.update(dataset=args.dataset, retriever=args.retriever, base_feature=args.base_feature, limit=args.limit,
                 load=os.getloadavg()[0])
        log.info("%-22s prequential R@%d %.1f → %.1f (%+.1f; 2nd half %+.1f)  R@%d %.1f  headroom %s  "
                 "w_fused %.2f  %.0f s CPU  load %.1f", spec, args.m, r["base"], r["reranked"], r["lift"],
                 r["lift_second_half"], args.k, r["ceiling"],
                 "n/a" if r["headroom"] is None else f"{r['headroom']:.0f}%", r["w_fused"], r["cpu_s"], r["load"])
        if "unseen_lift" in r:
            log.info("%-22s unseen training users (%d questions, final weights) R@%d %.1f → %.1f (%+.1f)  "
                     "R@%d %.1f  headroom %s", "", r["unseen_questions"], args.m, r["unseen_base"],
                     r["unseen_reranked"], r["unseen_lift"], args.k, r["unseen_ceiling"],
                     "n/a" if r["unseen_headroom"] is None else f"{r['unseen_headroom']:.0f}%")
        if args.out:
            with open(args.out, "a") as out:
                out.write(json.dumps(r) + "\n")
    getattr(opened.retriever, "close", lambda: None)()


if __name__ == "__main__":
    main()
