#!/usr/bin/env python
"""What a half-precision, int8 or int4 torch index (`index_precision: bfloat16|float16|int8|int4`) costs
in recall and buys in speed.

Recall@K on LoCoMo (turn granularity, `rmm eval`'s runner and headline: categories 1-4) with the
real MiniLM bank: the same stored float32 vectors and the same query vectors, searched by a
`TorchIndex` per user at float32 and at each lower precision (each kernel as asked:
`measured=False`). Also reports how often a question's top-max(K) ids differ from float32's and
the search time per query (one query at a time, one thread, median); and, since a LoCoMo user has
only 369-689 memories, the same with every turn of all conversations in one index (5,882 rows):
how often the shortlist of 2K+8 missed a true top-K member (the top-K *set* differs) rather than
re-ordering near-ties. Acceptable when no recall drops by more than `--max-drop` points (default
0.5); exits 1 otherwise.

    python research/recall_index_precision.py
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time

import torch
from recall_query_encoder import drop_verdict, locomo_turn_bank

from rmm.eval.retrieval import evaluate
from rmm.memory.index import TorchIndex
from rmm.types import Candidates

log = logging.getLogger("recall_index_precision")


class PrecisionRetriever:
    """`search` over one TorchIndex per user, built from the bank's stored vectors at `precision`;
    query vectors come from `query_vectors` (encoded once, shared by every precision)."""

    def __init__(self, bank, precision: str, query_vectors: dict[str, torch.Tensor]) -> None:
        self.bank, self.precision, self.query_vectors = bank, precision, query_vectors
        self.store = bank.store  # the runner maps ids back to memories (and their refs) through it
        self.indexes: dict[str, TorchIndex] = {}
        self.seconds: list[float] = []
        self.results: dict[tuple[str, str], list[str]] = {}

    def _index(self, user: str) -> TorchIndex:
        if user not in self.indexes:
            ids, vectors = self.bank.store.embeddings(user)
            index = TorchIndex(vectors.shape[1], device="cpu", precision=self.precision, measured=False)
            index.add(ids, vectors)
            self.indexes[user] = index
        return self.indexes[user]

    def search(self, queries: list[str], user: str, k: int) -> list[Candidates]:
        index = self._index(user)
        out = []
        for text in queries:
            q = self.query_vectors[text]
            start = time.perf_counter()
            scores, (ids,) = index.search(q.unsqueeze(0), k)
            self.seconds.append(time.perf_counter() - start)
            self.results[(user, text)] = ids
            out.append(Candidates(query=text, memory_ids=ids, retriever_scores=scores[0], query_embedding=q,
                                  user_id=user))
        return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--encoder", default="minilm")
    parser.add_argument("--ks", type=int, nargs="+", default=[5, 10, 20])
    parser.add_argument("--precisions", nargs="+", default=["bfloat16", "float16", "int8", "int4"])
    parser.add_argument("--max-drop", type=float, default=0.5, help="points of recall half precision may lose")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--data-dir", help="benchmark data (default: $RMM_DATA_DIR / the shared data folder)")
    args = parser.parse_args()
    dataset, bank, encoder = locomo_turn_bank(args.encoder, args.data_dir, args.threads)
    assert encoder is not None
    texts = sorted({q.text for q in dataset.questions})
    with torch.inference_mode():
        vectors = torch.cat([encoder.encode_queries(texts[i:i + 256]) for i in range(0, len(texts), 256)])
    query_vectors = dict(zip(texts, vectors.float()))

    runs = {}
    for precision in ["float32", *args.precisions]:
        retriever = PrecisionRetriever(bank, precision, query_vectors)
        report = evaluate(dataset, retriever, "turn", ks=args.ks, retriever_name=precision, progress=False)
        runs[precision] = (report, retriever)

    base_report, base = runs["float32"]
    sizes = [len(index) for index in base.indexes.values()]
    print(f"LoCoMo turn recall, {args.encoder}, {base_report.overall['n']} questions (categories 1-4), "
          f"{len(sizes)} users of {min(sizes)}-{max(sizes)} memories; torch {torch.__version__}, "
          f"{args.threads} thread(s), load average {os.getloadavg()[0]:.1f}")
    metrics = [m for m in base_report.overall if m != "n"]
    print(f"{'metric':>14} | {'float32':>8} | " + " | ".join(f"{p:>8} | {'drop':>6}" for p in args.precisions))
    worst = 0.0
    for metric in metrics:
        full = base_report.overall[metric]
        cells = []
        for precision in args.precisions:
            half = runs[precision][0].overall[metric]
            drop = 100 * (full - half)
            worst = max(worst, drop)
            cells.append(f"{100 * half:8.2f} | {drop:+6.2f}")
        print(f"{metric:>14} | {100 * full:8.2f} | " + " | ".join(cells))
    base_ms = 1000 * statistics.median(base.seconds)
    print(f"search per query (median, one at a time): float32 {base_ms:.3f} ms")
    for precision in args.precisions:
        retriever = runs[precision][1]
        differ = sum(retriever.results[key] != ids for key, ids in base.results.items())
        ms = 1000 * statistics.median(retriever.seconds)
        print(f"  {precision}: {ms:.3f} ms ({base_ms / ms:.2f}x float32); top-{max(args.ks)} ids differ from "
              f"float32 for {differ}/{len(base.results)} queries")
    one_bank(dataset, bank, query_vectors, args.precisions, max(args.ks))
    return drop_verdict(worst, args.max_drop)


def one_bank(dataset, bank, query_vectors: dict[str, torch.Tensor], precisions: list[str], k: int) -> None:
    """Every user's turns in one index: a bank ten times a LoCoMo user's, searched at top-`k`."""
    ids, vectors = [], []
    for user in dataset.users:
        user_ids, user_vectors = bank.store.embeddings(user)
        ids += [f"{user}/{i}" for i in user_ids]
        vectors.append(user_vectors)
    matrix = torch.cat(vectors)
    queries = torch.stack(list(query_vectors.values()))
    exact = TorchIndex(matrix.shape[1], device="cpu")
    exact.add(ids, matrix)
    want = [row for start in range(0, len(queries), 64) for row in exact.search(queries[start:start + 64], k)[1]]
    for precision in precisions:
        index = TorchIndex(matrix.shape[1], device="cpu", precision=precision, measured=False)
        index.add(ids, matrix)
        got = [row for start in range(0, len(queries), 64) for row in index.search(queries[start:start + 64], k)[1]]
        missed = sum(set(a) != set(b) for a, b in zip(want, got))
        reordered = sum(a != b for a, b in zip(want, got))
        print(f"  {precision}, all {len(ids)} turns in one index: top-{k} set differs for {missed}/{len(want)} "
              f"queries, order for {reordered}")


if __name__ == "__main__":
    sys.exit(main())
