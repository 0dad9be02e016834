"""Issue 13's online-training figures: reward delay × importance correction, and credit forms.

Runs `rmm.training.online.OnlineTrainer` (the program behind `rmm train`) on one benchmark and
one retriever for every combination asked, on the recipe `rmm train` would pick (`auto`), and
prints one line per run: the held-out recall@5 of the retriever alone and with the reranker
(lift in points), the prequential figures on the training stream, and the measured staleness.
The bank is built once (cached like `rmm train`'s).

    python research/online_measurements.py --dataset locomo --delay 0 16 64 256 --importance on off
    python research/online_measurements.py --dataset msc --credit per-pick reward-to-go sequence

Each run's report goes to `--out` as one JSON line (config, figures, staleness, learner stats).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import time
from pathlib import Path
from typing import Any


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="locomo")
    parser.add_argument("--retriever", default="minilm")
    parser.add_argument("--delay", type=int, nargs="+", default=[0])
    parser.add_argument("--importance", choices=("on", "off"), nargs="+", default=["on"])
    parser.add_argument("--credit", nargs="+", default=[None], help="credit forms (default: the learner's)")
    parser.add_argument("--seed", type=int, nargs="+", default=[0])
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--per-user", action="store_true")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="other OnlineConfig fields (JSON values), e.g. is_clip=2")
    parser.add_argument("--out", type=Path, help="append each run's report as a JSON line")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    from rmm.training.online import OnlineConfig, OnlineTrainer

    from rmm.data import load_dataset
    from rmm.eval.benchmark_bank import open_retriever
    from rmm.policy.learner import recipe_for

    dataset = load_dataset(args.dataset, download=False)
    opened = open_retriever(args.retriever, dataset, "turn", progress=True)
    _cache_query_embeddings(opened.retriever.encoder)  # every run searches the same questions
    recipe = recipe_for("auto", opened.encoder.config.normalize)
    extra = {k: json.loads(v) for k, v in (item.split("=", 1) for item in args.set)}
    print(f"# {args.dataset} · {args.retriever} · recipe {recipe} · load {os.getloadavg()[0]:.1f}", flush=True)
    for delay, importance, credit, seed in itertools.product(args.delay, args.importance, args.credit, args.seed):
        settings: dict[str, Any] = {**recipe, "epochs": args.epochs, "per_user": args.per_user, "seed": seed,
                                    "delay": delay, "importance": importance == "on", **extra}
        if credit is not None:
            settings["credit"] = credit
        cfg = OnlineConfig(**settings)
        started = time.perf_counter()
        report = OnlineTrainer(dataset, opened.retriever, cfg, progress=False).run()
        seconds = time.perf_counter() - started
        k = cfg.eval_k
        row = {
            "dataset": args.dataset, "delay": delay, "importance": importance, "credit": cfg.credit, "seed": seed,
            "heldout_retriever": report.retriever_heldout[f"recall@{k}"],
            "heldout_reranker": report.reranker_heldout[f"recall@{k}"],
            "prequential_retriever": report.retriever[f"recall@{k}"],
            "prequential_reranker": report.reranker_prequential[f"recall@{k}"],
            "staleness_mean": report.staleness["mean_steps"], "seconds": seconds,
            "load": os.getloadavg()[0],
        }
        lift = 100 * (row["heldout_reranker"] - row["heldout_retriever"])
        pre = 100 * (row["prequential_reranker"] - row["prequential_retriever"])
        print(f"delay {delay:>4}  IS {importance:>3}  credit {cfg.credit:<12} seed {seed}  "
              f"held-out recall@{k} {100 * row['heldout_retriever']:.1f} → {100 * row['heldout_reranker']:.1f} "
              f"({lift:+.1f})  prequential {pre:+.1f}  staleness {row['staleness_mean']:.1f}  "
              f"{seconds:.0f}s  load {row['load']:.1f}", flush=True)
        if args.out:
            with args.out.open("a") as f:
                kept = {key: v for key, v in report.to_json().items() if key not in ("cited_ratio", "prequential_curve")}
                f.write(json.dumps({**row, "report": kept}) + "\n")
    opened.retriever.close()


def _cache_query_embeddings(encoder: Any) -> None:
    """Encode each query text once across runs (the encoder is deterministic): a third of a run's time."""
    import torch

    encode, seen = encoder.encode_queries, {}

    def cached(texts: list[str], *args: Any, **kwargs: Any) -> torch.Tensor:
        missing = list(dict.fromkeys(t for t in texts if t not in seen))
        if missing:
            seen.update(zip(missing, encode(missing, *args, **kwargs)))
        return torch.stack([seen[t] for t in texts])

    encoder.encode_queries = cached


if __name__ == "__main__":
    main()
