#!/usr/bin/env python
"""What int8 query encoding (`rmm serve`'s `query_precision: int8`) costs in retrieval quality.

Recall@K on LoCoMo (turn granularity, `rmm eval`'s runner and headline: categories 1-4, the
adversarial one beside) with the real MiniLM: once with float32 queries, once with the int8
query path (packed, the server's, and the padded one it replaced for BERT encoders) — all against
the same float32 passage vectors, as the server has them. Also prints the query encoding time per
query of each path (batches of 32, one thread) and the cosine of int8 to float32 query vectors. The server's setting is acceptable when no recall drops by more
than `--max-drop` points (default 0.5); exits 1 otherwise.

    python research/recall_query_encoder.py
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import torch

from rmm.data import load_dataset
from rmm.eval.benchmark_bank import open_retriever
from rmm.eval.retrieval import evaluate
from rmm.encoders.query.precision import Int8QueryEncoder


def locomo_turn_bank(encoder_name: str, data_dir: str | None, threads: int):
    """LoCoMo, its cached turn bank and encoder on the CPU, quietly: what every recall check here starts from."""
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(threads)
    dataset = load_dataset("locomo", data_dir=data_dir)
    opened = open_retriever(encoder_name, dataset, "turn", device="cpu", progress=False)
    return dataset, opened.retriever, opened.encoder


def drop_verdict(worst: float, max_drop: float) -> int:
    """Print the largest recall drop against its budget; the exit status (0 within, 1 over)."""
    verdict = "within" if worst <= max_drop else "OVER"
    print(f"largest recall drop {worst:+.2f} points: {verdict} the {max_drop} point budget")
    return 0 if worst <= max_drop else 1


def seconds_per_query(encode, texts: list[str], batch: int = 32, repeats: int = 3) -> float:
    """Best of `repeats` passes over `texts` in batches of `batch`, per query."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for i in range(0, len(texts), batch):
            encode(texts[i:i + batch])
        best = min(best, time.perf_counter() - start)
    return best / len(texts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--encoder", default="minilm")
    parser.add_argument("--ks", type=int, nargs="+", default=[5, 10, 20])
    parser.add_argument("--max-drop", type=float, default=0.5, help="points of recall int8 may lose")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--data-dir", help="benchmark data (default: $RMM_DATA_DIR / the shared data folder)")
    args = parser.parse_args()
    dataset, bank, encoder = locomo_turn_bank(args.encoder, args.data_dir, args.threads)
    assert encoder is not None
    paths = {"float32": encoder, "int8 padded": Int8QueryEncoder(encoder, packed=False),
             "int8": Int8QueryEncoder(encoder)}  # the last: what the server runs
    reports = {}
    for label, query_path in paths.items():
        bank.encoder = query_path  # type: ignore[union-attr]  # the bank encodes queries with it
        reports[label] = evaluate(dataset, bank, "turn", ks=args.ks, retriever_name=label, progress=False)
    texts = [q.text for q in dataset.questions[:512]]
    with torch.inference_mode():
        exact = encoder.encode_queries(texts)
        cosines = {label: torch.nn.functional.cosine_similarity(exact, path.encode_queries(texts))
                   for label, path in paths.items() if label != "float32"}
    speed = {label: seconds_per_query(path.encode_queries, texts[:256]) for label, path in paths.items()}

    load = os.getloadavg()[0]
    print(f"LoCoMo turn recall, {args.encoder}, {reports['float32'].overall['n']} questions (categories 1-4); "
          f"torch {torch.__version__}, {args.threads} thread(s), load average {load:.1f}")
    metrics = [m for m in reports["float32"].overall if m != "n"]
    print(f"{'metric':>14} | " + " | ".join(f"{label:>11}" for label in paths) + f" | {'int8 drop':>9}")
    worst = 0.0
    for metric in metrics:
        values = {label: 100 * reports[label].overall[metric] for label in paths}
        drop = values["float32"] - values["int8"]
        worst = max(worst, drop)
        print(f"{metric:>14} | " + " | ".join(f"{v:11.2f}" for v in values.values()) + f" | {drop:+9.2f}")
    for label, cosine in cosines.items():
        print(f"query cosine {label} vs float32: min {cosine.min():.4f}, mean {cosine.mean():.4f}")
    print("query encoding, batches of 32: " + ", ".join(
        f"{label} {1000 * seconds:.2f} ms/query ({speed['float32'] / seconds:.2f}x)" for label, seconds in speed.items()))
    return drop_verdict(worst, args.max_drop)


if __name__ == "__main__":
    sys.exit(main())
