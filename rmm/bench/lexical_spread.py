"""How the hybrid first stage's lexical feature compares with the cosines it is added to, on the
training stream only (held-out questions are never searched).

An untrained reranker (zero residual) orders candidates by `q·m + w0·f` (Eq. 1 plus our lexical
feature), so whether it starts from the first stage's order or from the encoder's depends on how
the spread of `w0·f` over the K candidates compares with the spread of `q·m`. Per memory
granularity and first stage this prints, over the training questions' top-K lists: the mean
per-list spread (max − min) and standard deviation of `q·m` and of `f`, and recall@M of the
first stage's order, of the cosine order and of the untrained reranker's order at several w0.
`cos_top1_minus_top5` and `f_top1_minus_top5` are each list's largest value minus its fifth
largest, both sorted (rows written before this was fixed, e.g. `docs/results/s4/h6/spread_final.jsonl`,
hold f's first minus fifth in the first stage's order instead).

    python -m rmm.bench.lexical_spread --dataset locomo --retriever hybrid --granularity session

`--feature` names lexical-feature definitions to compare (`FeatureVariant`; default `bm25`, the
library's `LEXICAL_DEFINITION`); `python -m rmm.bench.ablations --run NAME:feature='"fused"'`
trains on one of them.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from rmm.training.online import OnlineConfig, OnlineTrainer

from rmm.data import load_dataset
from rmm.encoders.passage_cache import attach_cache
from rmm.eval.benchmark_bank import open_retriever
from rmm.eval.retrieval import SEPARATE_CATEGORIES
from rmm.memory.hybrid import HybridRetriever
from rmm.policy.learner import recipe_for
from rmm.types import Candidates

log = logging.getLogger("rmm.bench.lexical_spread")


VARIANTS = ("bm25", "bm25-cos", "fused", "fused-depth", "fused-list", "fused-list-cos")


class FeatureVariant(HybridRetriever):
    """The hybrid first stage with another lexical feature than the library's (ablations only).

    `bm25`: the library's (BM25's score min-max scaled over its depth list); `fused`: the fused score
    over its largest possible value (the definition before `LEXICAL_DEFINITION`, rmm checkpoint
    format ≤ 3); `fused-depth` / `fused-list`: the fused score min-max scaled over the union of
    both depth lists / over the K candidates; `-cos`: times the spread of q·m over the K candidates
    (w in cosine units)."""

    def __init__(self, base: HybridRetriever, variant: str) -> None:
        if variant not in VARIANTS:
            raise ValueError(f"feature must be one of {VARIANTS}, got {variant!r}")
        super().__init__(base.bank, fusion=base.fusion, rrf_k=base.rrf_k, alpha=base.alpha, depth=base.depth,
                         lexical=base.lexical, candidate_features=base.candidate_features)
        self.variant = variant

    def _fuse(self, dense: Candidates, lexical: Candidates, k: int, user: str,
              featured: Candidates | None = None) -> Candidates:
        c = super()._fuse(dense, lexical, k, user, featured)
        if self.variant.startswith("fused"):
            fused = self.fused_scores(dense, lexical)
            scores = torch.tensor([fused[m] for m in c.memory_ids], dtype=torch.float32)
            if self.variant == "fused":
                top = 2.0 / (self.rrf_k + 1.0) if self.fusion == "rrf" else 1.0
                f = (scores / top).clamp(0.0, 1.0)
            else:
                pool = list(fused.values()) if self.variant == "fused-depth" else scores.tolist()
                lo, hi = (min(pool), max(pool)) if pool else (0.0, 0.0)
                f = (scores - lo) / (hi - lo) if hi > lo else torch.ones_like(scores)
            c = replace(c, lexical=f)
        if self.variant.endswith("-cos") and len(c):
            assert c.embeddings is not None and c.query_embedding is not None and c.lexical is not None
            cos = c.embeddings @ c.query_embedding
            c = replace(c, lexical=c.lexical * float(cos.max() - cos.min()))
        return c


def top_minus(values: torch.Tensor, rank: int) -> torch.Tensor:
    """The largest value minus the one at `rank` (0-based) in descending order: the same for q·m and f."""
    ordered = values.sort(descending=True).values
    return ordered[0] - ordered[rank]


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def spread(trainer: OnlineTrainer, inits: list[float]) -> dict[str, Any]:
    """Per-list spreads of q·m and f, and recall@M of the first stage, cosine and untrained orders."""
    cfg, separate = trainer.cfg, set(SEPARATE_CATEGORIES.get(trainer.dataset.name, ()))
    qs = [q for _, q in trainer.stream if q.category not in separate]
    qs = list({q.id: q for q in qs}.values())
    metric = f"recall@{cfg.eval_k}"
    stats: dict[str, list[float]] = {}

    def add(key: str, value: float) -> None:
        stats.setdefault(key, []).append(value)

    for q in qs:
        c = trainer.cands[q.id]
        if len(c) < 2 or c.lexical is None:
            continue
        assert c.embeddings is not None and c.query_embedding is not None
        cos = c.embeddings @ c.query_embedding
        f = c.lexical
        add("cos_spread", float(cos.max() - cos.min()))
        add("cos_std", float(cos.std()))
        fifth = min(4, len(c) - 1)
        add("cos_top1_minus_top5", float(top_minus(cos, fifth)))
        add("f_spread", float(f.max() - f.min()))
        add("f_std", float(f.std()))
        add("f_top1_minus_top5", float(top_minus(f, fifth)))
        add("f_max", float(f.max()))
        add("first_stage", trainer.score(c, list(range(len(c))), q)[metric])
        add("cosine", trainer.score(c, torch.argsort(cos, descending=True).tolist(), q)[metric])
        for w in inits:
            add(f"untrained_w{w:g}", trainer.score(c, torch.argsort(cos + w * f, descending=True).tolist(), q)[metric])
    return {"questions": len(stats.get("first_stage", [])), **{k: mean(v) for k, v in stats.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="locomo")
    parser.add_argument("--retriever", default="hybrid")
    parser.add_argument("--granularity", default="turn", choices=("turn", "session", "topic"))
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--feature", action="append", default=[])
    parser.add_argument("--w0", type=float, action="append", default=[])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    log.setLevel(logging.INFO)
    dataset = load_dataset(args.dataset, download=False)
    opened = open_retriever(args.retriever, dataset, args.granularity, progress=False)
    retriever = opened.retriever
    if not isinstance(retriever, HybridRetriever):
        raise SystemExit(f"error: {args.retriever} is not a hybrid first stage (no lexical feature)")
    attach_cache(retriever.encoder)
    recipe = recipe_for("auto", opened.encoder.config.normalize)
    cfg = OnlineConfig(**{**recipe, "limit": args.limit})
    inits = args.w0 or [0.3, 1.0, 3.0, 10.0]
    for feature in args.feature or ["bm25"]:
        trainer = OnlineTrainer(dataset, FeatureVariant(retriever, feature), cfg, progress=False)
        streamed = list({q.id: q for _, q in trainer.stream}.values())
        trainer.cands = trainer.candidates(streamed, trainer.split.visible_sessions)
        row = {"dataset": args.dataset, "retriever": args.retriever, "granularity": args.granularity,
               "feature": feature, **spread(trainer, inits), "load": os.getloadavg()[0]}
        log.info("%s · %s · %s · feature %s: %s", args.dataset, args.retriever, args.granularity, feature,
                 "  ".join(f"{k} {v:.3f}" for k, v in row.items() if isinstance(v, float) and k != "load"))
        if args.out:
            with args.out.open("a") as out:
                out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
