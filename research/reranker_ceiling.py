"""What the reranker's function class can reach at all: Eq. 1 fitted with gold labels, on training users only.

The online learner only hears citations of what it sampled. To tell "the learner cannot find the
gain" from "there is no gain a residual-linear reranker can generalise to new users", this fits the
same parametrisation (`s = (q + W_q q)·(m + W_m m)`, zero-initialised) *with the gold labels*
(listwise softmax cross-entropy over the top-K) on part of `rmm train`'s training users and scores
the other part — held-out users of the real split are never read. Recall@M of the retriever and of
the fitted reranker on the unseen training users, at several numbers of full-batch Adam steps.

    python research/reranker_ceiling.py --dataset msc
    python research/reranker_ceiling.py --dataset locomo

`--prefix-strip` removes MSC's "What do you know about:" before encoding (the question form).

`--features SPEC ...` asks which extra per-candidate features (`rmm/bench/reranker_features.py`:
first-stage ranks of each half, BM25 score, cosine, length, recency, speaker, query overlap) let a
shared reranker generalise: each SPEC is `GROUP[+GROUP...][:mlp][:nores]`, fitted as
`score = q′·m′ + w·f + Σ w_i f_i` (`:mlp` adds an MLP over the features, `:nores` freezes W_q, W_m
at 0), early-stopped on a validation slice of the *fitted* users (`--val-fraction`), and reported on
the unseen training users against the first stage's own order: R@M, lift, headroom captured.

    python research/reranker_ceiling.py --dataset msc --retriever hybrid --features fused fused+ranks all all:mlp
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import re
import time
from collections import Counter
from dataclasses import dataclass

import torch
from rmm.training.online import OnlineConfig
from rmm.training.splits import split_questions

from rmm.data import load_dataset
from rmm.encoders.passage_cache import attach_cache
from rmm.eval.benchmark_bank import open_retriever
from rmm.eval.retrieval import (
    SEPARATE_CATEGORIES,
    GoldScorer,
    headroom_captured,
    scorable,
)
from rmm.memory.bm25 import BM25Retriever
from rmm.bench.reranker_features import TurnPlace, candidate_features, feature_names, rrf_feature
from rmm.memory.hybrid import HybridRetriever

log = logging.getLogger("reranker_ceiling")
PREFIX = re.compile(r"^what do you know about:\s*", re.IGNORECASE)
ALL_FEATURES = feature_names(["all"])


@dataclass
class Rows:
    """One slice of questions as tensors: query [N, d], candidates [N, K, d], gold [N, K], |gold| [N], features [N, K, F]."""

    q: torch.Tensor
    m: torch.Tensor
    label: torch.Tensor
    n_gold: torch.Tensor
    feats: torch.Tensor

    def take(self, keep: torch.Tensor) -> Rows:
        return Rows(self.q[keep], self.m[keep], self.label[keep], self.n_gold[keep], self.feats[keep])


def recall_at(order_scores: torch.Tensor, rows: Rows, m: int) -> float:
    """Mean over questions of (gold found in the top m by `order_scores`) / |gold|, capped at 1."""
    top = order_scores.topk(m, dim=1).indices
    found = rows.label.gather(1, top).sum(1).float()
    return float((found / rows.n_gold).clamp(max=1).mean())


def first_stage_recall(rows: Rows, m: int) -> float:
    """Recall@m of the first stage's own order (candidates come ranked)."""
    k = rows.label.shape[1]
    return recall_at(-torch.arange(k, dtype=torch.float32).expand(len(rows.label), k), rows, m)


def places_of(dataset, user: str) -> tuple[dict[str, TurnPlace], str]:
    """Each turn id's place in the user's history, and the speaker with the most turns."""
    sessions = dataset.sessions[user]
    places = {t.id: TurnPlace(i, len(sessions), j, len(s.turns), t.speaker)
              for i, s in enumerate(sessions) for j, t in enumerate(s.turns)}
    majority = Counter(p.speaker for p in places.values()).most_common(1)[0][0]
    return places, majority


def collect(args: argparse.Namespace, dataset, bank, scorer, split, users: list[str], with_features: bool,
            keep_separate: bool = False) -> dict[str, list[tuple]]:
    """Every training user's scorable questions with their top-K candidates (and features), by user;
    the dataset's separately reported categories too with `keep_separate` (last tuple entry: headline?)."""
    separate = set(SEPARATE_CATEGORIES.get(dataset.name, ()))
    hybrid = isinstance(bank, HybridRetriever)
    dense_bank = bank.bank if hybrid else bank
    bm25 = bank.lexical if hybrid else (BM25Retriever(bank.store) if with_features else None)
    by_user: dict[str, list[tuple]] = {}
    for user in users:
        qs = [q for q in split.train if q.user_id == user and (keep_separate or q.category not in separate)]
        if not qs:
            continue
        memories = {m.id: m for m in bank.memories(user)}
        places, majority = places_of(dataset, user) if with_features else ({}, "")
        texts = [PREFIX.sub("", q.text) if args.prefix_strip else q.text for q in qs]
        found = bank.search(texts, user, args.k)
        if with_features:
            dense = dense_bank.search(texts, user, max(args.k, args.depth))
            lexical = bm25.search(texts, user, max(args.k, args.depth))
        rows = by_user.setdefault(user, [])
        for i, (q, c) in enumerate(zip(qs, found)):
            if len(c) < args.k:
                continue
            gold = scorer.gold(q)
            label = torch.tensor([bool(set(memories[mid].refs) & gold) for mid in c.memory_ids])
            qe, me = c.query_embedding.reshape(-1), c.embeddings
            fused = torch.zeros(args.k) if getattr(c, "lexical", None) is None else c.lexical.reshape(-1).float()
            if with_features:  # the RRF fused score computed here: the library's `lexical` definition may move
                fused = torch.tensor(rrf_feature(c.memory_ids, [dense[i].memory_ids, lexical[i].memory_ids],
                                                 getattr(bank, "rrf_k", 10.0)))
                mems = [memories[mid] for mid in c.memory_ids]
                feats = candidate_features(
                    texts[i], c.memory_ids, [mm.source_text or mm.text for mm in mems],
                    [places[mm.refs[0]] for mm in mems], fused.tolist(), (me @ qe).tolist(),
                    (dense[i].memory_ids, dense[i].retriever_scores.tolist()),
                    (lexical[i].memory_ids, lexical[i].retriever_scores.tolist()), args.depth, majority)
                f = torch.tensor([feats[n] for n in ALL_FEATURES], dtype=torch.float32).T  # [K, F]
            else:
                f = fused.reshape(-1, 1)
            rows.append((qe, me, label, float(len(gold)), f, q.category not in separate))
    return by_user


def stack(rows: list[tuple]) -> Rows:
    return Rows(torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows]), torch.stack([r[2] for r in rows]),
                torch.tensor([r[3] for r in rows]), torch.stack([r[4] for r in rows]))


class FeatureReranker(torch.nn.Module):
    """Eq. 1 (zero-initialised residuals) + w·fused + Σ w_i f_i over standardised features (+ an MLP)."""

    def __init__(self, dim: int, n_feats: int, fused_init: float, residual: bool, mlp: int) -> None:
        super().__init__()
        self.w_q = torch.nn.Parameter(torch.zeros(dim, dim), requires_grad=residual)
        self.w_m = torch.nn.Parameter(torch.zeros(dim, dim), requires_grad=residual)
        self.w_fused = torch.nn.Parameter(torch.tensor(fused_init))
        self.w = torch.nn.Parameter(torch.zeros(n_feats))
        self.mlp = None
        if mlp:
            self.mlp = torch.nn.Sequential(torch.nn.Linear(n_feats + 1, mlp), torch.nn.Tanh(), torch.nn.Linear(mlp, 1))
            torch.nn.init.zeros_(self.mlp[2].weight)
            torch.nn.init.zeros_(self.mlp[2].bias)

    def forward(self, q: torch.Tensor, m: torch.Tensor, fused: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
        folded = q + q @ self.w_q.T  # (q + W_q q)·(m + W_m m), folded onto the query side
        s = torch.einsum("nd,nkd->nk", folded + folded @ self.w_m, m) + self.w_fused * fused
        if f.shape[-1]:
            s = s + f @ self.w
        if self.mlp is not None:
            s = s + self.mlp(torch.cat([fused.unsqueeze(-1), f], -1)).squeeze(-1)
        return s


def fit_spec(spec: str, args: argparse.Namespace, data: dict[str, Rows]) -> dict:
    """Fit one feature spec on `fit`, early-stop on `val`, score `check`; the figures as a dict."""
    parts = spec.split(":")
    options = set(parts[1:])
    unknown = options - {"mlp", "nores"}
    if unknown:
        raise SystemExit(f"unknown option(s) {sorted(unknown)} in --features {spec!r} (known: mlp, nores)")
    names = [n for n in feature_names(parts[0].split("+")) if n != args.base_feature]
    cols = [ALL_FEATURES.index(n) for n in names]
    fused_col = ALL_FEATURES.index(args.base_feature)
    fit = data["fit"]
    raw = fit.feats[..., cols].flatten(0, 1)
    mean, std = (raw.mean(0), raw.std(0).clamp(min=1e-6)) if cols else (torch.zeros(0), torch.ones(0))

    def inputs(rows: Rows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return rows.q, rows.m, rows.feats[..., fused_col], (rows.feats[..., cols] - mean) / std

    torch.manual_seed(0)
    model = FeatureReranker(fit.q.shape[1], len(cols), args.lexical_init if args.lexical_init is not None else 1.0,
                            "nores" not in options, args.mlp_hidden if "mlp" in options else 0)
    groups = [{"params": [model.w_fused, model.w] + ([] if model.mlp is None else list(model.mlp.parameters())),
               "lr": args.feature_lr}]
    if "nores" not in options:
        groups.append({"params": [model.w_q, model.w_m], "lr": args.lr})
    opt = torch.optim.Adam(groups)
    trainable = fit.take(fit.label.any(1))
    x_fit = inputs(trainable)

    def score(name: str) -> float:
        with torch.no_grad():
            return recall_at(model(*inputs(data[name])), data[name], args.m)

    start = time.process_time()
    def snapshot() -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    history = [(0, score("val"), score("check"))]
    best_state = snapshot()
    for step in range(1, args.max_steps + 1):
        s = model(*x_fit) / args.tau
        loss = -(torch.logsumexp(s.masked_fill(~trainable.label, -1e9), 1) - torch.logsumexp(s, 1)).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % args.eval_every == 0:
            history.append((step, score("val"), score("check")))
            if history[-1][1] > max(h[1] for h in history[:-1]):
                best_state = snapshot()
    best = max(history, key=lambda h: (h[1], -h[0]))  # best validation recall, earliest on ties
    model.load_state_dict(best_state)  # the weights reported are the early-stopped ones
    check = data["check"]
    base_m, base_k = first_stage_recall(check, args.m), first_stage_recall(check, args.k)
    share = headroom_captured(best[2], base_m, base_k)
    return {"spec": spec, "features": names, "steps": best[0], "val_recall": 100 * best[1],
            "check_questions": len(check.q), "check_base": 100 * base_m, "check_ceiling": 100 * base_k, "check_init": 100 * history[0][2],
            "check_reranked": 100 * best[2], "lift": 100 * (best[2] - base_m),
            "headroom": None if share is None else 100 * share, "cpu_s": time.process_time() - start,
            "weights": dict(zip(names, [round(float(w), 3) for w in model.w.detach()])) if "mlp" not in options else {},
            "w_fused": round(float(model.w_fused.detach()), 3)}


def run_features(args: argparse.Namespace, by_user: dict[str, list[tuple]], fit_users: list[str],
                 check_users: list[str], fold: int | None = None) -> list[dict]:
    """The feature comparison: fitted users split into fit and validation (by user), check = unseen."""
    n_val = max(1, round(len(fit_users) * args.val_fraction))
    val_users, train_users = fit_users[:n_val], fit_users[n_val:]
    data = {name: stack([r for u in us for r in by_user.get(u, [])])
            for name, us in (("fit", train_users), ("val", val_users), ("check", check_users))}
    log.info("# %s%s · %s · fit on %d training users (%d questions), early-stopped on %d of the fitted users (%d), "
             "scored on %d other training users (%d) · held-out users never read · load %.1f",
             args.dataset, "" if fold is None else f" fold {fold}", args.retriever, len(train_users), len(data["fit"].q), len(val_users), len(data["val"].q),
             len(check_users), len(data["check"].q), os.getloadavg()[0])
    log.info("| features | steps | unseen R@%d first stage → init → fitted | lift | R@%d ceiling | headroom | CPU s |",
             args.m, args.k)
    results = []
    for spec in args.features:
        r = fit_spec(spec, args, data)
        r.update(dataset=args.dataset, retriever=args.retriever, fold=fold, base_feature=args.base_feature,
                 load=os.getloadavg()[0])
        log.info("| %s | %d | %.1f → %.1f → %.1f | %+.1f | %.1f | %s | %.0f |", spec, r["steps"], r["check_base"],
                 r["check_init"], r["check_reranked"], r["lift"], r["check_ceiling"],
                 "—" if r["headroom"] is None else f"{r['headroom']:.0f}%", r["cpu_s"])
        log.info("    weights: w_fused %.2f %s", r["w_fused"], r["weights"])
        if args.out:
            with open(args.out, "a") as out:
                out.write(json.dumps(r) + "\n")
        results.append(r)
    return results


def pooled_table(args: argparse.Namespace, results: list[dict]) -> None:
    """Per spec, every fold's unseen users pooled (question-weighted): each training user scored once."""
    log.info("# pooled over %d folds: every training user unseen once", args.folds)
    log.info("| features | unseen R@%d first stage → fitted | lift | R@%d ceiling | headroom | folds with a lift |",
             args.m, args.k)
    for spec in args.features:
        rs = [r for r in results if r["spec"] == spec]
        n = sum(r["check_questions"] for r in rs)
        base, fitted, ceiling = (sum(r[key] * r["check_questions"] for r in rs) / n
                                 for key in ("check_base", "check_reranked", "check_ceiling"))
        share = headroom_captured(fitted, base, ceiling)
        log.info("| %s | %.1f → %.1f | %+.1f | %.1f | %s | %d/%d |", spec, base, fitted, fitted - base, ceiling,
                 "—" if share is None else f"{100 * share:.0f}%", sum(r["lift"] > 0 for r in rs), len(rs))


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
                        help="hybrid candidates: add w·f (f = the fused score in [0, 1]) with w learned from this start"
                             " (--features: default 1)")
    parser.add_argument("--features", nargs="+", default=None, metavar="SPEC",
                        help="compare feature sets: GROUP[+GROUP...][:mlp][:nores], groups of "
                             "rmm/bench/reranker_features.py or 'all'")
    parser.add_argument("--base-feature", default="fused", choices=ALL_FEATURES,
                        help="--features: the feature in w·f (start --lexical-init): fused = RRF score (the "
                             "library's lexical feature before eb20cc6), bm25_minmax = the one since")
    parser.add_argument("--val-fraction", type=float, default=0.2,
                        help="--features: share of the fitted users held back for early stopping")
    parser.add_argument("--max-steps", type=int, default=300, help="--features: most full-batch Adam steps")
    parser.add_argument("--eval-every", type=int, default=10, help="--features: steps between validation checks")
    parser.add_argument("--feature-lr", type=float, default=1e-2, help="--features: Adam lr of the feature weights")
    parser.add_argument("--mlp-hidden", type=int, default=32, help="--features: hidden width of the :mlp variant")
    parser.add_argument("--depth", type=int, default=50, help="--features: depth of each half's list for its ranks")
    parser.add_argument("--out", default=None, help="--features: append one JSON line per spec here")
    parser.add_argument("--folds", type=int, default=0,
                        help="--features: rotate the unseen users over this many folds of the training users "
                             "(0: the single 70/30 split of --fit-fraction)")
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
    users = sorted({q.user_id for q in split.train})
    random.Random(0).shuffle(users)
    n_fit = round(len(users) * args.fit_fraction)
    fit_users = set(users[:n_fit])
    by_user = collect(args, dataset, bank, scorer, split, users, with_features=args.features is not None)
    if args.features is not None:
        if args.folds:  # every training user is unseen once: check = one fold, fitted = the others
            results = []
            for fold in range(args.folds):
                check = users[fold::args.folds]
                results += run_features(args, by_user, [u for u in users if u not in set(check)], check, fold)
            pooled_table(args, results)
        else:
            run_features(args, by_user, users[:n_fit], users[n_fit:])
        getattr(opened.retriever, "close", lambda: None)()
        return
    rows = {"fit": [r for u in users if u in fit_users for r in by_user.get(u, [])],
            "check": [r for u in users if u not in fit_users for r in by_user.get(u, [])]}
    tensors = {name: (torch.stack([r[0] for r in rs]), torch.stack([r[1] for r in rs]),
                      torch.stack([r[2] for r in rs]), torch.tensor([r[3] for r in rs]),
                      torch.stack([r[4][:, 0] for r in rs])) for name, rs in rows.items()}
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
