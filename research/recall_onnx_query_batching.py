#!/usr/bin/env python
"""Does ONNX Runtime's int8 query path keep a query's ranking independent of its micro-batch?

`research/recall_query_batching.py`'s check (each LoCoMo question encoded alone and inside a
micro-batch of `--batch` random questions, searched in its conversation's MiniLM turn bank) for
the ONNX Runtime query paths, next to the server's torch paths:

* float32      — torch, as the bank was built
* int8         — the server's int8 path (`Int8QueryEncoder`: activations quantized per token)
* ort-float32  — the exported graph in ONNX Runtime
* ort-int8     — ONNX Runtime's dynamic quantization (per-channel weights, one activation scale
                 per tensor: the scheme that made rankings batch-dependent in torch)
* int8-onnx    — the server's `query_precision: int8-onnx`: its int8 scheme (per-token scales)
                 as an ONNX graph (`rmm.encoders.onnx_backend.row_int8_graph`)

Also prints each path's CPU milliseconds per query in micro-batches of `--batch` (one thread).

    python research/recall_onnx_query_batching.py
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from bench_onnx_encoder import encode_with, fused_graph, int8_graph
from recall_query_batching import alone_vs_batched
from recall_query_encoder import locomo_turn_bank

from rmm.encoders.onnx_backend import OnnxRunner, export_onnx
from rmm.encoders.query.precision import Int8QueryEncoder, build_engine


class RunnerQueries:
    """`encoder`'s queries encoded as it batches them, each batch run in an ONNX Runtime session."""

    def __init__(self, encoder: Any, runner: OnnxRunner) -> None:
        self.encoder, self.runner = encoder, runner

    def encode_queries(self, texts: list[str]) -> torch.Tensor:
        return encode_with(self.encoder, self.runner, texts, self.encoder.config.query_prefix)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--k", type=int, default=20)
    parser.add_argument("--m", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    dataset, bank, encoder = locomo_turn_bank("minilm", None, args.threads)
    questions = dataset.questions
    texts = list(dict.fromkeys(q.text for q in questions))
    config = encoder.model.config
    with tempfile.TemporaryDirectory() as tmp:
        plain = export_onnx(encoder, Path(tmp) / "minilm.onnx")
        fused = fused_graph(plain, Path(tmp) / "fused.onnx", config.num_attention_heads, config.hidden_size)
        paths = {"float32": encoder, "int8": Int8QueryEncoder(encoder),
                 "ort-float32": RunnerQueries(encoder, OnnxRunner(plain, args.threads)),
                 "ort-int8": RunnerQueries(encoder, OnnxRunner(int8_graph(fused, Path(tmp) / "q.onnx"), args.threads)),
                 "int8-onnx": build_engine(encoder, "int8-onnx")}
        rng = random.Random(args.seed)
        order = texts[:]
        rng.shuffle(order)
        chunks = [order[i:i + args.batch] for i in range(0, len(order), args.batch)]
        print(f"LoCoMo turns, MiniLM; {len(questions)} questions; micro-batches of {args.batch}; top-{args.m} / "
              f"top-{args.k}; {args.threads} thread(s), load average {os.getloadavg()[0]:.1f}")
        print(f"{'path':>13} | {'CPU ms/q':>8} | {'R@5 alone':>9} {'batched':>8} | {'R@20 alone':>10} {'batched':>8} | "
              f"{'top-M changed':>13} {'top-K changed':>13} | {'min cos':>8}")
        for label, path in paths.items():
            check = alone_vs_batched(path, chunks, dataset, bank, encoder, args.k, args.m)
            print(f"{label:>13} | {check.ms:8.2f} | {check.row(args.k)}", flush=True)
        bank.encoder = encoder  # type: ignore[union-attr]
    return 0


if __name__ == "__main__":
    sys.exit(main())
