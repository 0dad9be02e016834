#!/usr/bin/env python
"""GPU benchmarks: the fused Triton rerank kernel vs torch eager, and encoder throughput in bf16.

Rerank: for B ∈ {1, 64, 1024}, K ∈ {20, 200}, d ∈ {768, 1024} (M = 5, τ = 0.5, exploring, bank of
`--bank-size` rows), the median time of `rmm.kernels.rerank(..., backend="triton")` against the
torch reference (`backend="torch"`: gather → bmm → sort → Plackett–Luce), each checked to pick the
same candidates first. The kernel's achieved bandwidth (bytes it must read: the K candidate rows,
the query, the candidate ids) is reported as a fraction of the device's copy bandwidth measured in
the same run (`clone()` of a large buffer: read + write) — the memory roofline — by two clocks: the
host's around each synchronised call (what a caller waits, launch costs included) and, on CUDA, the
GPU's own kernel time from the profiler (what the kernel's memory traffic achieves). Encoder: MiniLM passages/s in bf16 (fp32 on CPU) over synthetic turns.

    python -m rmm.bench.kernels --out report.json [--markdown report.md] [--device cuda]
    python -m rmm.bench.kernels --quick --device cpu   # smoke run of the script itself

Figures are only meaningful on the GPU they were measured on; the report names the device.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch

BATCHES = (1, 64, 1024)
KS = (20, 200)
DIMS = (768, 1024)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn, device: torch.device, repeats: int, warmup: int = 3) -> float:
    """Median seconds per call, synchronised (GPU work is asynchronous)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def device_event_seconds(events) -> float:
    """Seconds the GPU spent in the profiled events that ran on it (kernels, copies, fills)."""
    from torch.autograd import DeviceType

    return sum(e.time_range.elapsed_us() for e in events if e.device_type == DeviceType.CUDA) / 1e6


def kernel_seconds(fn, repeats: int, warmup: int = 3) -> float | None:
    """GPU time per call, from the profiler's device timestamps (CUPTI): the device's own work,
    without the launch and synchronisation costs a host clock adds to `time_call` (on some
    machines ~0.1 ms a call, more than a small kernel runs). None when the profiler saw no GPU
    activity (no CUPTI in some containers)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    seconds = device_event_seconds(prof.events())
    return seconds / repeats if seconds > 0 else None


def copy_bandwidth(device: torch.device, repeats: int, quick: bool) -> tuple[float, float | None]:
    """GB/s of a device-to-device copy (bytes read + written): the roofline the kernel is held to;
    by the host clock, and by the GPU's own (None off CUDA)."""
    n_bytes = (16 if quick else 1024) * 2**20
    buffer = torch.empty(n_bytes, dtype=torch.uint8, device=device)
    copy, calls = (lambda: buffer.clone()), max(3, repeats // 5)
    seconds = time_call(copy, device, calls)
    on_device = kernel_seconds(copy, calls) if device.type == "cuda" else None
    return 2 * n_bytes / seconds / 1e9, (2 * n_bytes / on_device / 1e9 if on_device else None)


def bench_rerank(device: torch.device, dtype: torch.dtype, bank_size: int, repeats: int, quick: bool) -> list[dict[str, Any]]:
    from rmm.kernels import rerank, triton_available

    have_triton = triton_available() and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")
    batches, ks, dims = ((1, 4), (20,), (64,)) if quick else (BATCHES, KS, DIMS)
    rows = []
    gen = torch.Generator(device="cpu").manual_seed(0)
    for dim in dims:
        bank = torch.randn(bank_size, dim, generator=gen).to(device, dtype)
        for batch in batches:
            queries = torch.randn(batch, dim, generator=gen).to(device, dtype)
            for k in ks:
                ids = torch.randint(0, bank_size, (batch, k), generator=gen).to(device)
                row: dict[str, Any] = {"B": batch, "K": k, "d": dim, "M": 5}
                # torch eager as the reranker runs it without a kernel: torch's own RNG (the
                # Philox re-implementation exists for testing, not speed)
                eager = lambda: rerank(queries, bank, ids, 5, 0.5, explore=True, backend="torch", generator=None)
                row["torch_ms"] = 1e3 * time_call(eager, device, repeats)
                if have_triton:
                    fused = lambda: rerank(queries, bank, ids, 5, 0.5, seed=1, explore=True, backend="triton")
                    row["triton_ms"] = 1e3 * time_call(fused, device, repeats)
                    row["speedup"] = row["torch_ms"] / row["triton_ms"]
                    # the launch configuration the autotuner chose on this GPU for this shape
                    from rmm.kernels.triton_rerank import config_for

                    chosen = config_for(batch, k, dim, dtype)
                    row["triton_config"] = str(chosen) if chosen is not None else None
                    a = rerank(queries, bank, ids, 5, 0.5, explore=False, backend="torch")
                    b = rerank(queries, bank, ids, 5, 0.5, explore=False, backend="triton")
                    row["first_pick_agreement"] = (a.indices[:, 0] == b.indices[:, 0]).float().mean().item()
                    # bytes the kernel must read: the K candidate rows of d values, the query, the ids
                    moved = batch * (k + 1) * dim * bank.element_size() + ids.numel() * ids.element_size()
                    row["triton_GBps"] = moved / (row["triton_ms"] / 1e3) / 1e9
                    on_device = kernel_seconds(fused, repeats) if device.type == "cuda" else None
                    if on_device:
                        row["triton_kernel_ms"] = 1e3 * on_device
                        row["triton_kernel_GBps"] = moved / on_device / 1e9
                rows.append(row)
                print(json.dumps(row), file=sys.stderr)
    return rows


def bench_encoder(device: torch.device, n_texts: int, batch_size: int, repeats: int) -> dict[str, Any]:
    from rmm.encoders import load_encoder

    dtype = "bf16" if device.type == "cuda" else "float32"
    encoder = load_encoder("minilm", device=str(device), dtype=dtype, batch_size=batch_size)
    words = ["remember", "that", "my", "sister", "moved", "to", "Lisbon", "last", "spring", "and", "we", "talk", "every", "Sunday", "about", "books"]
    gen = torch.Generator().manual_seed(0)
    texts = [" ".join(words[int(i)] for i in torch.randint(0, len(words), (int(n),), generator=gen))
             for n in torch.randint(8, 48, (n_texts,), generator=gen)]
    seconds = time_call(lambda: encoder.encode_passages(texts), device, repeats, warmup=1)
    return {"model": "minilm", "dtype": dtype, "batch_size": batch_size, "texts": n_texts,
            "passages_per_s": n_texts / seconds}


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def _figure(value: float | None, spec: str, unit: str = "") -> str:
    return "—" if value is None else f"{value:{spec}}{unit}"


def _share(gbps: float | None, roofline: float | None) -> str:
    return "—" if gbps is None or not roofline else f"{100 * gbps / roofline:.0f}%"


def markdown(report: dict[str, Any]) -> str:
    lines = [f"## Kernel benchmarks — {report['device']}", "",
             f"torch {report['torch']}, triton {report['triton']}, bank {report['bank_size']} rows "
             f"({report['dtype']}), M = 5, τ = 0.5, exploring; median of {report['repeats']} calls.", "",
             f"Device copy bandwidth (read + write, measured in this run): {report['copy_GBps']:.0f} GB/s by the "
             f"host clock, {_figure(report.get('copy_kernel_GBps'), '.0f')} GB/s by the GPU's.", "",
             "Per call: host clock (launch + synchronisation included, what a caller waits); kernel: the GPU's "
             "own time (profiler), each against the copy bandwidth by the same clock. Triton config: "
             "CHUNK_K × BLOCK_D (u: d unrolled) / warps, stages, as the autotuner chose on this GPU.", "",
             "| B | K | d | torch eager (ms) | Triton (ms) | speed-up | Triton GB/s | of copy | "
             "kernel (ms) | kernel GB/s | of copy | same greedy 1st pick | Triton config |",
             "|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|:--|"]
    for r in report["rerank"]:
        agree = f"{100 * r['first_pick_agreement']:.1f}%" if "first_pick_agreement" in r else "—"
        lines.append(
            f"| {r['B']} | {r['K']} | {r['d']} | {r['torch_ms']:.3f} | {_figure(r.get('triton_ms'), '.3f')} | "
            f"{_figure(r.get('speedup'), '.1f', '×')} | {_figure(r.get('triton_GBps'), '.0f')} | "
            f"{_share(r.get('triton_GBps'), report['copy_GBps'])} | {_figure(r.get('triton_kernel_ms'), '.3f')} | "
            f"{_figure(r.get('triton_kernel_GBps'), '.0f')} | "
            f"{_share(r.get('triton_kernel_GBps'), report.get('copy_kernel_GBps'))} | {agree} | "
            f"{r.get('triton_config') or '—'} |")
    enc = report.get("encoder")
    if enc:
        lines += ["", f"Encoder: {enc['model']} in {enc['dtype']}, batch {enc['batch_size']}: "
                      f"**{enc['passages_per_s']:.0f} passages/s** ({enc['texts']} texts)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"),
                        help="bank and query dtype (the kernel accumulates in float32)")
    parser.add_argument("--bank-size", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--encoder-texts", type=int, default=4096)
    parser.add_argument("--encoder-batch-size", type=int, default=256)
    parser.add_argument("--skip-encoder", action="store_true")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: check the script runs")
    parser.add_argument("--out", help="write the report as JSON")
    parser.add_argument("--markdown", help="write the report as a markdown table")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    if device.type == "cpu" and dtype == torch.bfloat16 and not args.quick:
        print("note: bf16 on CPU is slow; pass --dtype float32 for CPU numbers", file=sys.stderr)
    if args.quick:
        args.bank_size, args.repeats, args.encoder_texts = min(args.bank_size, 1000), min(args.repeats, 3), 64
        dtype = torch.float32 if device.type == "cpu" else dtype
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    report: dict[str, Any] = {
        "device": device_name(device), "torch": torch.__version__, "triton": triton_version,
        "dtype": str(dtype).removeprefix("torch."), "bank_size": args.bank_size, "repeats": args.repeats,
    }
    report["copy_GBps"], report["copy_kernel_GBps"] = copy_bandwidth(device, args.repeats, args.quick)
    report["rerank"] = bench_rerank(device, dtype, args.bank_size, args.repeats, args.quick)
    for row in report["rerank"]:
        if "triton_GBps" in row:
            row["fraction_of_copy_bandwidth"] = row["triton_GBps"] / report["copy_GBps"]
        if "triton_kernel_GBps" in row and report["copy_kernel_GBps"]:
            row["kernel_fraction_of_copy_bandwidth"] = row["triton_kernel_GBps"] / report["copy_kernel_GBps"]
    if not args.skip_encoder:
        report["encoder"] = bench_encoder(device, args.encoder_texts, args.encoder_batch_size, max(1, args.repeats // 10))
    text = markdown(report)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
