"""How fast can the non-LLM topic fallback get without changing its output? Its floor, measured.

The fallback's output is fixed by the vectors of three sets of texts: every turn line of the
sessions it segments, every topic (its turns joined), and every memory a merge rewrites. This
script builds one LoCoMo conversation's topic bank while recording what was encoded, then times
the encoder alone on exactly those texts (one call per set, the encoder's own batching), counts
their tokens, and prints the time the model's linear layers alone would need at the machine's
measured float32 GEMM speed — a lower bound for any exact (float32) build:

    python research/topic_encoder_floor.py --conversation 0 --threads 1

Every text in those sets is needed for the output: a turn vector feeds the segmentation's gap
similarities, a topic vector is stored or decides a merge, a merged memory's vector is stored and
searched by the next session; token sequences the encoder reads twice (a merge that appends past
`max_length`) are run once and are counted once here (`distinct`). `--old-cpu` takes
`rmm/bench/topics.py`'s old CPU seconds for the same conversation and prints the largest
speed-up an exact (float32) build could reach, cold and warm. CPU seconds, as the machine is shared.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("topic_encoder_floor")


def gemm_gflops(hidden: int, intermediate: int, rows: int = 1024, seconds: float = 1.0) -> float:
    """Float32 GEMM speed of this process (oneDNN's linear, as the encoder runs it), in GFLOP/s."""
    x, w, b = torch.randn(rows, hidden), torch.randn(intermediate, hidden), torch.randn(intermediate)
    run = (lambda: torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")) if hasattr(
        torch.ops.mkldnn, "_linear_pointwise") else (lambda: torch.nn.functional.linear(x, w, b))
    with torch.inference_mode():
        run()
        count, start = 0, time.process_time()
        while time.process_time() - start < seconds:
            run()
            count += 1
        elapsed = time.process_time() - start
    return 2 * rows * hidden * intermediate * count / elapsed / 1e9


def fallback_texts(encoder: Any, sessions: list[Any]) -> tuple[dict[str, list[str]], float]:
    """The texts the non-LLM topic fallback encodes while building a topic bank from `sessions`
    (turn lines, topics, merged memories) and the build's CPU seconds; memory ids from a counter."""
    from rmm.memory.bank import MemoryBank
    from rmm.reflection import ProspectiveReflector
    from rmm.types import Memory

    calls: list[list[str]] = []
    encode = encoder.encode_passages

    def recording(texts):  # type: ignore[no-untyped-def]
        calls.append(list(texts))
        return encode(texts)

    encoder.encode_passages = recording
    ids = itertools.count(1)
    Memory.new_id = staticmethod(lambda: f"m{next(ids):05d}")  # type: ignore[method-assign]
    try:
        with tempfile.TemporaryDirectory() as tmp, MemoryBank(Path(tmp) / "bank", encoder, device="cpu") as bank:
            start = time.process_time()
            ProspectiveReflector(bank, None).reflect_many(sessions)
            build = time.process_time() - start
    finally:
        encoder.encode_passages = encode
    # reflect_many: the turns, then the topics, then one call per session that merged
    return {"turns": calls[0], "topics": calls[1], "merged": [t for call in calls[2:] for t in call]}, build


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversation", type=int, default=0, help="index of the LoCoMo conversation")
    parser.add_argument("--encoder", default="minilm")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--old-cpu", type=float, help="the old build's CPU seconds (python -m rmm.bench.topics) for the bounds")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)

    from rmm.data import load_dataset
    from rmm.encoders import load_encoder

    dataset = load_dataset("locomo", download=False)
    user = dataset.users[args.conversation]
    encoder = load_encoder(args.encoder, device="cpu")
    sets, build = fallback_texts(encoder, dataset.sessions[user])
    config = encoder.model.config
    hidden, intermediate, layers = int(config.hidden_size), int(config.intermediate_size), int(config.num_hidden_layers)
    per_token = 2 * layers * (4 * hidden * hidden + 2 * hidden * intermediate)  # Q, K, V, O and the FFN
    gflops = gemm_gflops(hidden, intermediate)
    log.info("%s · %s · %d thread(s) · load %.1f · build %.1f CPU s · GEMM %.0f GFLOP/s · %.1f MFLOP/token in linears",
             user, args.encoder, args.threads, os.getloadavg()[0], build, gflops, per_token / 1e6)
    log.info("%-8s%7s%9s%9s%9s%14s%16s", "texts", "count", "distinct", "tokens", "padded", "encoder CPU s",
             "linears floor s")
    rows: dict[str, tuple[int, int, int, int, float, float]] = {}
    for name, texts in sets.items():
        unique = list(dict.fromkeys(tuple(ids) for ids in encoder.tokenize(texts))) if texts else []
        tokens = sum(len(ids) for ids in unique)
        padded = sum(len(batch) * len(unique[batch[0]]) for batch in encoder.batches([len(ids) for ids in unique]))
        start = time.process_time()
        if texts:
            encoder.encode_passages(texts)
        rows[name] = (len(texts), len(unique), tokens, padded, time.process_time() - start,
                      tokens * per_token / (gflops * 1e9))
        log.info("%-8s%7d%9d%9d%9d%14.2f%16.2f", name, *rows[name])
    total = [sum(row[i] for row in rows.values()) for i in range(6)]
    warm = [total[i] - rows["turns"][i] for i in range(6)]
    log.info("%-8s%7d%9d%9d%9d%14.2f%16.2f", "total", *total)
    log.info("%-8s%7d%9d%9d%9d%14.2f%16.2f  (turn vectors cached by the turn bank)", "warm", *warm)
    if args.old_cpu:
        log.info("5x needs <= %.2f CPU s; an exact build needs >= %.2f s cold (linears alone at %.0f GFLOP/s), "
                 "%.2f s warm: at most %.1fx cold, %.1fx warm (today's encoder on these texts: %.1fx, %.1fx)",
                 args.old_cpu / 5, total[5], gflops, warm[5], args.old_cpu / total[5], args.old_cpu / warm[5],
                 args.old_cpu / total[4], args.old_cpu / warm[4])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
