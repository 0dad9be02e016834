#!/usr/bin/env python
"""ONNX Runtime against torch for the MiniLM encoder on the CPU: same vectors? how much faster?

Text sets: what the non-LLM topic fallback encodes on one LoCoMo conversation (turn lines,
topics, merged memories — recorded as `research/topic_encoder_floor.py` does) and the LoCoMo
questions (what the server's query path encodes). Paths, all through the encoder's own batching:

* torch        — the encoder as it runs today (oneDNN linears, float32)
* ort          — the exported graph in ONNX Runtime, float32, all graph optimizations
* ort-fused    — the same after `onnxruntime.transformers.optimizer` (model_type bert) fused it
* ort-int8     — ort-fused with dynamic int8 quantization (questions only: passages stay float32)

Then the server's two int8 query paths (`query_precision: int8` in torch, `int8-onnx`) on
micro-batches of 32 questions, as the server encodes them.

Per path and set: CPU seconds (best of `--repeats`, one thread: CPU time is the work done, the
machine is shared), the ratio torch/path from the same run, and max |Δ| of its vectors against torch.

    python research/bench_onnx_encoder.py --conversation 0 --threads 1
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from topic_encoder_floor import fallback_texts

from rmm.data import load_dataset
from rmm.encoders import load_encoder
from rmm.encoders.onnx_backend import OnnxRunner, export_onnx


def cpu_seconds(run: Callable[[], torch.Tensor], repeats: int) -> tuple[float, torch.Tensor]:
    """Best CPU seconds of `repeats` runs and the last result."""
    best, out = float("inf"), torch.empty(0)
    for _ in range(repeats):
        start = time.process_time()
        out = run()
        best = min(best, time.process_time() - start)
    return best, out


def fused_graph(source: Path, target: Path, heads: int, hidden: int) -> Path:
    """ORT's transformer optimizer (attention, layer norm, GELU fusions) on the exported graph."""
    from onnxruntime.transformers.optimizer import optimize_model

    model = optimize_model(str(source), model_type="bert", num_heads=heads, hidden_size=hidden, opt_level=0)
    model.save_model_to_file(str(target))
    return target


def int8_graph(source: Path, target: Path) -> Path:
    """ORT's dynamic quantization: int8 weights per channel, activations quantized on the fly."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    # the fused graph's contrib ops defeat shape inference; its tensors are float32
    quantize_dynamic(str(source), str(target), weight_type=QuantType.QInt8, per_channel=True,
                     extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
    return target


def encode_with(encoder: Any, runner: Callable[[dict[str, torch.Tensor]], torch.Tensor] | None,
                texts: list[str], prefix: str = "") -> torch.Tensor:
    """`texts` encoded with `encoder`'s batching and padding, each batch run by `runner` (None:
    the encoder's own torch forward); no cache, no de-duplication, so both sides do the same work."""
    sequences = encoder.tokenize(texts, prefix)
    out = torch.empty(len(texts), encoder.dim)
    with torch.inference_mode():
        for batch in encoder.batches([len(seq) for seq in sequences]):
            inputs = encoder.collate([sequences[i] for i in batch])
            out[torch.tensor(batch)] = (runner or encoder.embed)(inputs).float()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversation", type=int, default=0, help="index of the LoCoMo conversation")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dataset = load_dataset("locomo", download=False)
    encoder = load_encoder("minilm", device="cpu")
    sets, _ = fallback_texts(encoder, dataset.sessions[dataset.users[args.conversation]])
    sets["questions"] = list(dict.fromkeys(q.text for q in dataset.questions))
    config = encoder.model.config
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        plain = export_onnx(encoder, Path(tmp) / "minilm.onnx")
        exported = time.perf_counter() - start
        fused = fused_graph(plain, Path(tmp) / "fused.onnx", config.num_attention_heads, config.hidden_size)
        quantized = int8_graph(fused, Path(tmp) / "int8.onnx")
        runners = {"ort": OnnxRunner(plain, args.threads), "ort-fused": OnnxRunner(fused, args.threads),
                   "ort-int8": OnnxRunner(quantized, args.threads)}
        print(f"MiniLM · LoCoMo {dataset.users[args.conversation]} · {args.threads} thread(s) · torch "
              f"{torch.__version__} · onnxruntime {_ort_version()} · export {exported:.1f} s · "
              f"load {os.getloadavg()[0]:.1f}")
        print(f"{'set':<10}{'texts':>6}{'tokens':>8} | {'path':<10}{'CPU s':>8}{'torch/path':>11}{'max |Δ|':>10}")
        for name, texts in sets.items():
            tokens = sum(len(ids) for ids in encoder.tokenize(texts))
            base, reference = cpu_seconds(lambda texts=texts: encode_with(encoder, None, texts), args.repeats)
            print(f"{name:<10}{len(texts):>6}{tokens:>8} | {'torch':<10}{base:>8.2f}{1.0:>11.2f}{0.0:>10.1e}")
            for label, runner in runners.items():
                if label == "ort-int8" and name != "questions":
                    continue
                seconds, vectors = cpu_seconds(lambda r=runner, texts=texts: encode_with(encoder, r, texts),
                                               args.repeats)
                delta = float((vectors - reference).abs().max())
                print(f"{'':<24} | {label:<10}{seconds:>8.2f}{base / seconds:>11.2f}{delta:>10.1e}", flush=True)
        for batch in (32, 1):
            server_query_paths(encoder, sets["questions"], args.repeats + 2, tmp, batch)
    return 0


def server_query_paths(encoder: Any, questions: list[str], repeats: int, cache: str, batch: int = 32) -> None:
    """The server's int8 query scheme in torch and as an ONNX graph on micro-batches of `batch`
    shuffled questions, alternated `repeats` times so a change in load hits both: best CPU ms/query."""
    import random

    from rmm.encoders.query.precision import Int8QueryEncoder

    order = questions[:]
    random.Random(0).shuffle(order)
    chunks = [order[i:i + batch] for i in range(0, len(order), batch)]
    os.environ["RMM_CACHE_DIR"] = cache
    paths = {"int8": Int8QueryEncoder(encoder), "int8-onnx": Int8QueryEncoder(encoder, engine="onnx")}
    best = dict.fromkeys(paths, float("inf"))
    for _ in range(repeats):
        for label, path in paths.items():
            start = time.process_time()
            for chunk in chunks:
                path.encode_queries(chunk)
            best[label] = min(best[label], time.process_time() - start)
    print(f"server query paths, micro-batches of {batch} questions, best of {repeats} alternated runs, load "
          f"{os.getloadavg()[0]:.1f}: " + ", ".join(f"{k} {1000 * v / len(order):.2f}" for k, v in best.items())
          + f" CPU ms/query; int8 / int8-onnx {best['int8'] / best['int8-onnx']:.2f}x")


def _ort_version() -> str:
    import onnxruntime

    return str(onnxruntime.__version__)


if __name__ == "__main__":
    raise SystemExit(main())
