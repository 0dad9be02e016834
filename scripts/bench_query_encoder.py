#!/usr/bin/env python
"""The server's query encoder paths on the CPU, per query: float32, int8 padded (each query padded
to a multiple of 8 tokens, one forward per padded length), int8 packed (the server's default for
BERT encoders: a micro-batch's tokens unpadded, one pass; `rmm.encoders.query.packed_bert`), the same with
every linear layer on `torch._int_mm` instead of oneDNN's prepacked int8 kernel (`int8 _int_mm`:
what `rmm.encoders.query.int8_linear` gains from that kernel; the vectors are the same to the bit) and, when
onnxruntime is installed, `int8-onnx`.

LoCoMo questions in micro-batches of each `--batch` size (1 is a query alone, as the server
without micro-batching encodes it); per path the CPU milliseconds per query (best of `--repeats`
passes, one thread: CPU time is the work done on a shared machine), the ratio to int8 padded from
the same run (the paths run interleaved, pass by pass, so a change in load hurts none more than
another), and the cosine of its vectors to float32's.

    python scripts/bench_query_encoder.py
    python scripts/bench_query_encoder.py --batch 1 16 32 --queries 256 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from collections.abc import Callable

import torch

from rmm.data import load_dataset
from rmm.encoders import load_encoder
from rmm.encoders.query import int8_linear
from rmm.encoders.query.precision import Int8QueryEncoder


def cpu_ms_per_query(encode: Callable[[list[str]], torch.Tensor], batches: list[list[str]]) -> float:
    started = time.process_time()
    for batch in batches:
        encode(batch)
    return 1000 * (time.process_time() - started) / sum(len(b) for b in batches)


def on_int_mm(encode: Callable[[list[str]], torch.Tensor]) -> Callable[[list[str]], torch.Tensor]:
    """`encode` with every int8 linear layer on `torch._int_mm` (oneDNN's prepacked kernel never
    reaches its row threshold while it runs)."""
    def run(texts: list[str]) -> torch.Tensor:
        saved, int8_linear.PACKED_MIN_ROWS = int8_linear.PACKED_MIN_ROWS, sys.maxsize
        try:
            return encode(texts)
        finally:
            int8_linear.PACKED_MIN_ROWS = saved
    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--encoder", default="minilm")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 32])
    parser.add_argument("--queries", type=int, default=256, help="LoCoMo questions per pass")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--data-dir", help="benchmark data (default: $RMM_DATA_DIR / the shared data folder)")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    encoder = load_encoder(args.encoder, device="cpu")
    paths: dict[str, Callable[[list[str]], torch.Tensor]] = {
        "float32": encoder.encode_queries,
        "int8 padded": Int8QueryEncoder(encoder, packed=False).encode_queries,
        "int8 packed": (packed := Int8QueryEncoder(encoder).encode_queries),
        "int8 _int_mm": on_int_mm(packed),
    }
    try:
        paths["int8-onnx"] = Int8QueryEncoder(encoder, engine="onnx").encode_queries
    except Exception as err:  # noqa: BLE001 - optional engine: say why it is left out and go on
        print(f"(int8-onnx left out: {err})")
    questions = [q.text for q in load_dataset("locomo", data_dir=args.data_dir).questions]
    random.Random(0).shuffle(questions)
    texts = questions[:args.queries]
    with torch.inference_mode():
        exact = encoder.encode_queries(texts)
        cosine = {name: float(torch.nn.functional.cosine_similarity(exact, encode(texts)).min())
                  for name, encode in paths.items()}
        print(f"{args.encoder}, {len(texts)} LoCoMo questions, {args.threads} thread(s), torch {torch.__version__}")
        print(f"{'batch':>5} | " + " | ".join(f"{name:>17}" for name in paths) + " | min cosine to float32")
        for size in args.batch:
            batches = [texts[i:i + size] for i in range(0, len(texts), size)]
            best = dict.fromkeys(paths, float("inf"))
            for _ in range(args.repeats):
                for name, encode in paths.items():
                    best[name] = min(best[name], cpu_ms_per_query(encode, batches))
            base = best["int8 padded"]
            print(f"{size:>5} | " + " | ".join(f"{ms:6.2f} ms ({base / ms:4.2f}x)" for ms in best.values())
                  + " | " + ", ".join(f"{name} {value:.4f}" for name, value in cosine.items() if name != "float32"))
    print(f"load average {os.getloadavg()[0]:.1f}; (Nx) = int8 padded / path, same run")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
