#!/usr/bin/env python
"""Does a query's ranking depend on the micro-batch it was encoded in? (`rmm serve`'s query paths)

The server encodes every query of a micro-batch in one call, so a query path must give a query
the same embedding whatever else is in its batch, or a request's answer changes with whoever
else is asking. For each query path — float32, the server's int8 (`query_precision: int8`,
activations quantized per token) and, for comparison, torch's dynamic quantization (one
activation scale per tensor, the int8 path before) — every LoCoMo question is encoded once alone
and once inside a micro-batch of `--batch` questions drawn at random (as concurrent clients
would send them), then searched in its conversation's turn bank (MiniLM, cached by `rmm eval`).
Prints recall@K both ways (categories 1-4, `rmm eval`'s headline), the share of questions whose
top-M / top-K ids differ between the two encodings, and the cosine of alone vs batched vectors.
Exits 1 when the server's int8 path changes more than `--max-changed` of the top-M lists.

    python research/recall_query_batching.py
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import sys
import time
import warnings
from dataclasses import dataclass

import torch
from recall_query_encoder import locomo_turn_bank

from rmm.eval.retrieval import evaluate
from rmm.encoders.query.precision import Int8QueryEncoder


class Precomputed:
    """An encoder whose query vectors were computed beforehand (text → vector)."""

    def __init__(self, inner: object, vectors: dict[str, torch.Tensor]) -> None:
        self.inner, self.vectors = inner, vectors
        self.name, self.dim, self.fingerprint = inner.name, inner.dim, inner.fingerprint  # type: ignore[attr-defined]

    def encode_queries(self, texts: list[str]) -> torch.Tensor:
        return torch.stack([self.vectors[t] for t in texts])

    def encode_passages(self, texts: list[str]) -> torch.Tensor:
        return self.inner.encode_passages(texts)  # type: ignore[attr-defined]


def per_tensor_int8(encoder: object) -> object:
    """torch's dynamic quantization of the linears (one activation scale per input tensor)."""
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    copied = copy.copy(encoder)
    model = copy.deepcopy(encoder.model)  # type: ignore[attr-defined]
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.__class__ = torch.nn.Linear
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        copied.model = quantize_dynamic(model, {torch.nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8)
    return copied


@dataclass
class BatchingCheck:
    """One query path's figures: recall@5 / @k with each query encoded alone and in its micro-batch,
    the shares of top-m / top-k lists that differ, the smallest cosine, CPU ms per query batched."""

    recall: dict[str, dict[str, float]]
    changed_m: float
    changed_k: float
    min_cos: float
    ms: float

    def row(self, k: int) -> str:
        r5, rk = "recall@5", f"recall@{k}"
        a, b = self.recall["alone"], self.recall["batched"]
        return (f"{100 * a[r5]:9.2f} {100 * b[r5]:8.2f} | {100 * a[rk]:10.2f} {100 * b[rk]:8.2f} | "
                f"{100 * self.changed_m:12.2f}% {100 * self.changed_k:12.2f}% | {self.min_cos:8.5f}")


def alone_vs_batched(path: object, chunks: list[list[str]], dataset: object, bank: object, encoder: object,
                     k: int, m: int) -> BatchingCheck:
    """Encode every question alone and in its chunk with `path`, search the bank both ways, compare."""
    texts = [t for chunk in chunks for t in chunk]
    questions = dataset.questions  # type: ignore[attr-defined]
    with torch.inference_mode():
        alone = {t: path.encode_queries([t])[0] for t in texts}  # type: ignore[attr-defined]
        batched: dict[str, torch.Tensor] = {}
        start = time.process_time()
        for chunk in chunks:
            batched.update(zip(chunk, path.encode_queries(chunk)))  # type: ignore[attr-defined]
        ms = 1000 * (time.process_time() - start) / len(texts)
    recall, ids = {}, {}
    for how, vectors in (("alone", alone), ("batched", batched)):
        bank.encoder = Precomputed(encoder, vectors)  # type: ignore[attr-defined]
        report = evaluate(dataset, bank, "turn", ks=[5, k], retriever_name=how, progress=False)  # type: ignore[arg-type]
        recall[how] = report.overall
        ids[how] = [bank.search([q.text], q.user_id, k)[0].memory_ids for q in questions]  # type: ignore[attr-defined]
    bank.encoder = encoder  # type: ignore[attr-defined]
    changed_m = sum(a[:m] != b[:m] for a, b in zip(ids["alone"], ids["batched"])) / len(questions)
    changed_k = sum(a != b for a, b in zip(ids["alone"], ids["batched"])) / len(questions)
    cos = torch.nn.functional.cosine_similarity(torch.stack([alone[t] for t in texts]),
                                                torch.stack([batched[t] for t in texts])).min()
    return BatchingCheck(recall, changed_m, changed_k, float(cos), ms)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32, help="micro-batch size the server would encode")
    parser.add_argument("--k", type=int, default=20)
    parser.add_argument("--m", type=int, default=5)
    parser.add_argument("--max-changed", type=float, default=0.01, help="share of top-M lists int8 may change")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-dir", help="benchmark data (default: $RMM_DATA_DIR / the shared data folder)")
    args = parser.parse_args()
    dataset, bank, encoder = locomo_turn_bank("minilm", args.data_dir, args.threads)
    questions = dataset.questions
    texts = list(dict.fromkeys(q.text for q in questions))
    paths = {"float32": encoder, "int8": Int8QueryEncoder(encoder), "int8-per-tensor": per_tensor_int8(encoder)}
    rng = random.Random(args.seed)
    print(f"LoCoMo turns, MiniLM; {len(questions)} questions; micro-batches of {args.batch} random questions; "
          f"top-{args.m} / top-{args.k}; torch {torch.__version__}, {args.threads} thread(s), "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'path':>16} | {'R@5 alone':>9} {'batched':>8} | {'R@20 alone':>10} {'batched':>8} | "
          f"{'top-M changed':>13} {'top-K changed':>13} | {'min cos':>8}")
    verdict = 0
    for label, path in paths.items():
        order = texts[:]
        rng.shuffle(order)
        chunks = [order[start:start + args.batch] for start in range(0, len(order), args.batch)]
        check = alone_vs_batched(path, chunks, dataset, bank, encoder, args.k, args.m)
        print(f"{label:>16} | {check.row(args.k)}")
        if label == "int8" and check.changed_m > args.max_changed:
            verdict = 1
    print("int8 path " + ("OVER" if verdict else "within") + f" the {100 * args.max_changed:.1f}% budget of changed "
          f"top-{args.m} lists")
    return verdict


if __name__ == "__main__":
    sys.exit(main())
