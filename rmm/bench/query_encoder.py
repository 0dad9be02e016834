#!/usr/bin/env python
"""The server's query engines on this CPU, per query, and the one `query_precision: auto` picks.

Every engine of `rmm.encoders.query.precision.QUERY_ENGINES` as the server builds it: float32;
int8 (packed BERT forward, every linear on the portable `torch._int_mm`); int8-onednn (the same with
layers of 32+ rows on oneDNN's prepacked int8 kernel); int8-padded (each query padded to a multiple
of 8 tokens); int8-onnx (ONNX Runtime, when installed). LoCoMo questions in micro-batches of each
`--batch` size (1 is a query alone); per engine the CPU milliseconds per query (best of `--repeats`
passes, one thread: CPU time is the work done on a shared machine; engines interleaved pass by
pass, so a change in load hurts none more than another), its ratio to float32 from the same run,
and the cosine of its vectors to float32's. An engine more than 10x slower than float32 on its
first pass at a size is not passed again there.

Then `auto`'s choice, measured afresh as the server measures at start-up
(`rmm.encoders.query.choice`, probe batches 1/16/32), and how far that engine is from the fastest
engine of the table at batch 16. Exits 1 when any engine is more than 10x slower than float32 at
any batch (a fast path that is pathological on this CPU: `auto` will not choose it, but it must not
go unseen), or when auto's engine is more than 10% slower than the fastest at batch 16.

    python -m rmm.bench.query_encoder
    python -m rmm.bench.query_encoder --batch 1 16 32 --queries 256 --repeats 5
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import time
from collections.abc import Callable

import torch

from rmm.data import load_dataset
from rmm.encoders import load_encoder
from rmm.encoders.query.choice import choose_query_engine, probe_batch_sizes
from rmm.encoders.query.precision import QUERY_ENGINES, build_engine
from rmm.errors import ConfigError

PATHOLOGICAL = 10.0  # an engine this many times slower than float32 fails the run
AUTO_TOLERANCE = 1.10  # auto's engine at batch 16 within 10% of the fastest


def cpu_ms_per_query(encode: Callable[[list[str]], torch.Tensor], batches: list[list[str]]) -> float:
    started = time.process_time()
    for batch in batches:
        encode(batch)
    return 1000 * (time.process_time() - started) / sum(len(b) for b in batches)


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
    engines: dict[str, Callable[[list[str]], torch.Tensor]] = {}
    for name in QUERY_ENGINES:
        try:
            engines[name] = build_engine(encoder, name).encode_queries
        except ConfigError as err:  # an engine this machine cannot run: say why and go on
            print(f"({name} left out: {err})")
    questions = [q.text for q in load_dataset("locomo", data_dir=args.data_dir).questions]
    random.Random(0).shuffle(questions)
    texts = questions[:args.queries]
    best_at: dict[int, dict[str, float]] = {}
    with torch.inference_mode():
        # vectors checked on 32 questions encoded one at a time (cheap on every engine and CPU)
        exact = encoder.encode_queries(texts[:32])
        cosine = {name: float(torch.nn.functional.cosine_similarity(
            exact, torch.cat([encode([text]) for text in texts[:32]])).min()) for name, encode in engines.items()}
        print(f"{args.encoder}, {len(texts)} LoCoMo questions, {args.threads} thread(s), torch {torch.__version__}, "
              f"CPU {cpu_name()}")
        print(f"{'batch':>5} | " + " | ".join(f"{name:>20}" for name in engines) + " | min cosine to float32")
        for size in args.batch:
            batches = [texts[i:i + size] for i in range(0, len(texts), size)]
            best = dict.fromkeys(engines, float("inf"))
            dropped: set[str] = set()
            for _ in range(args.repeats):
                for name, encode in engines.items():
                    if name in dropped:
                        continue
                    best[name] = min(best[name], cpu_ms_per_query(encode, batches))
                    if name != "float32" and best[name] > PATHOLOGICAL * best["float32"]:
                        dropped.add(name)  # one pass is enough to know
            base = best["float32"]
            print(f"{size:>5} | " + " | ".join(f"{ms:8.2f} ms ({ms / base:5.2f}x)" for ms in best.values())
                  + " | " + ", ".join(f"{name} {value:.4f}" for name, value in cosine.items() if name != "float32"))
            best_at[size] = best
    print(f"load average {os.getloadavg()[0]:.1f}; (Nx) = engine / float32, same run")
    logging.getLogger("rmm.encoders.query.choice").setLevel(logging.WARNING)
    _, choice = choose_query_engine(encoder, "auto", batch_sizes=probe_batch_sizes(True, 64), cache_dir=None)
    print(f"auto chooses {choice.engine}: {choice.summary()}")
    if 16 in best_at:
        at16 = best_at[16]
        fastest = min(at16, key=at16.__getitem__)
        print(f"at batch 16: auto's {choice.engine} {at16[choice.engine]:.2f} ms/query, the fastest ({fastest}) "
              f"{at16[fastest]:.2f}: {at16[choice.engine] / at16[fastest]:.2f}x")
    failures = verdict(best_at, choice.engine)
    for failure in failures:
        print(f"FAIL: {failure}")
    return 1 if failures else 0


def verdict(best_at: dict[int, dict[str, float]], auto: str) -> list[str]:
    """What fails the run: an engine more than `PATHOLOGICAL` times slower than float32 at a batch
    size, and auto's engine more than `AUTO_TOLERANCE` times the fastest at batch 16."""
    failures = [f"{name} is {ms / best['float32']:.1f}x slower than float32 at batch {size}"
                for size, best in best_at.items() for name, ms in best.items() if ms > PATHOLOGICAL * best["float32"]]
    if 16 in best_at:
        at16 = best_at[16]
        fastest = min(at16, key=at16.__getitem__)
        if at16[auto] > AUTO_TOLERANCE * at16[fastest]:
            failures.append(f"auto's {auto} is {at16[auto] / at16[fastest]:.2f}x the fastest ({fastest}) at batch 16")
    return failures


def cpu_name() -> str:
    from rmm.device import cpu_fingerprint

    return str(cpu_fingerprint()["cpu"])


if __name__ == "__main__":
    raise SystemExit(main())
