"""Time the non-LLM topic fallback (what `rmm eval --granularity topic` builds without an LLM),
old code against new, on N LoCoMo conversations, and check that all build the same memories.

Three builds per conversation, each in a fresh process with memory ids from a counter (so the
outputs can be compared field by field):

* old   — the `rmm` package at a git revision (default: the commit before this script was added,
          i.e. before the speed-up), exported with `git archive`; `fill_topics`, one
          `reflect(session)` after another
* new   — this working tree, `fill_topics` with an empty passage cache attached, as `rmm eval`
          does on a machine that never encoded this conversation (cold: every vector computed)
* warm  — the same, after the conversation's turn bank was built with the cache attached (not
          timed: that is the turn granularity's own cost), as in `rmm eval --granularity turn topic`;
          the segmentation's turn vectors then come from the cache

The order of the builds rotates between conversations, so a change in machine load hurts no
side more than another:

    python -m rmm.bench.topics                      # 3 conversations, minilm
    python -m rmm.bench.topics --conversations 10 --threads 1 --json bench_topics.json

Timings cover the build only (not loading the model): wall seconds, and the process's CPU seconds,
which on a shared machine follow the work done more closely (with `--threads 1` no thread spins
in them). The load average is printed per row.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout
SPED_UP_IN = "scripts/bench_topics.py"  # this module's first path, added with the speed-up: its parent is the baseline
SIDES = ("old", "new", "warm")


def default_baseline() -> str:
    """The parent of the commit that added this script (HEAD while it is not committed)."""
    added = subprocess.run(["git", "log", "--diff-filter=A", "--format=%H", "--", SPED_UP_IN], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    return f"{added[-1]}^" if added else "HEAD"


def export_package(revision: str, folder: Path) -> Path:
    """The `rmm` package as of `revision`, written under `folder` (importable from there)."""
    archive = subprocess.run(["git", "archive", "--format=tar", revision, "rmm"], cwd=ROOT,
                             capture_output=True, check=True).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(folder, filter="data")
    return folder


# ---- one build, in a process whose `rmm` is the tree under test -----------------------------------
def worker(conversation: str, encoder_name: str, out: Path, root: Path, threads: int | None, side: str) -> None:
    import itertools

    import torch

    import rmm
    from rmm.data import load_dataset
    from rmm.encoders import load_encoder
    from rmm.eval import benchmark_bank
    from rmm.eval.benchmark_bank import fill_topics
    from rmm.memory.bank import MemoryBank
    from rmm.reflection import ProspectiveReflector
    from rmm.types import Dataset, Memory

    if threads:
        torch.set_num_threads(threads)
    if not Path(rmm.__file__).resolve().is_relative_to(root.resolve()):
        raise SystemExit(f"imported rmm from {rmm.__file__}, not from {root}")
    sessions = load_dataset("locomo", download=False).sessions[conversation]
    encoder = load_encoder(encoder_name, device="cpu")
    ids = itertools.count(1)
    Memory.new_id = staticmethod(lambda: f"m{next(ids):05d}")  # type: ignore[method-assign]
    dataset = Dataset("locomo", {conversation: sessions}, [])
    with tempfile.TemporaryDirectory() as tmp, MemoryBank(Path(tmp) / "bank", encoder, device="cpu") as bank:
        cached = side != "old"
        if side == "warm":
            with MemoryBank(Path(tmp) / "turns", encoder, device="cpu") as turns, \
                    benchmark_bank.passage_cache(encoder, tmp):
                benchmark_bank.fill(turns, dataset, "turn", progress=False)
        reflector = ProspectiveReflector(bank, None)
        with benchmark_bank.passage_cache(encoder, tmp) if cached else contextlib.nullcontext():
            t0, c0 = time.perf_counter(), time.process_time()
            fill_topics(bank, dataset, reflector, progress=False)
            seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        memories = bank.memories(conversation)
        vectors = bank.embeddings(conversation, [m.id for m in memories])
    records = [{"id": m.id, "kind": m.kind, "text": m.text, "refs": m.refs, "merged_from": m.merged_from,
                "source_text": m.source_text, "time_span": list(m.time_span or [])} for m in memories]
    out.write_text(json.dumps({"seconds": seconds, "cpu": cpu, "load": os.getloadavg()[0], "memories": records,
                               "vectors": vectors.tolist()}))


def build(side: str, root: Path, conversation: str, args: argparse.Namespace, scratch: Path) -> dict:
    out = scratch / f"{side}-{conversation}.json"
    env = {**os.environ, "PYTHONPATH": str(root), "HF_HUB_OFFLINE": "1"}
    # by path, not `-m` (the old tree has no rmm.bench); -P keeps rmm/bench/ off sys.path
    command = [sys.executable, "-P", str(Path(__file__).resolve()), "--worker", conversation, "--encoder", args.encoder, "--out", str(out),
               "--root", str(root), *(["--threads", str(args.threads)] if args.threads else []),
               "--side", side]
    subprocess.run(command, env=env, check=True, cwd=scratch)
    return json.loads(out.read_text())


def compare(old: dict, new: dict) -> tuple[bool, float]:
    """(same memories field by field, largest difference between their stored vectors)."""
    import torch

    if old["memories"] != new["memories"]:
        return False, float("nan")
    if not old["vectors"]:
        return True, 0.0
    return True, float((torch.tensor(old["vectors"]) - torch.tensor(new["vectors"])).abs().max())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=3, help="how many LoCoMo conversations, from the first")
    parser.add_argument("--baseline", help="git revision of the old code (default: before the speed-up)")
    parser.add_argument("--encoder", default="minilm")
    parser.add_argument("--threads", type=int, help="torch threads per build (default: torch's, one per core)")
    parser.add_argument("--json", help="write the rows as JSON")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    parser.add_argument("--side", choices=SIDES, default="new", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.encoder, Path(args.out), Path(args.root), args.threads, args.side)
        return 0

    from rmm.data import load_dataset

    conversations = load_dataset("locomo", download=False).users[: args.conversations]
    baseline = args.baseline or default_baseline()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        roots = {"old": export_package(baseline, scratch / "old"), "new": ROOT, "warm": ROOT}
        print(f"old: rmm at {baseline} · new, warm: {ROOT} · encoder {args.encoder} · "
              f"threads {args.threads or 'default'} · {os.cpu_count()} cores")
        print(f"{'':<9}{'wall seconds':>24}{'CPU seconds':>24}{'old/new':>9}{'old/warm':>10}")
        print(f"{'conv':<9}{'old':>8}{'new':>8}{'warm':>8}{'old':>8}{'new':>8}{'warm':>8}{'wall':>5}{'cpu':>5}"
              f"{'wall':>5}{'cpu':>5}{'load':>6}  same memories (max |Δvector| new, warm)")
        for n, conversation in enumerate(conversations):
            order = SIDES[n % 3:] + SIDES[:n % 3]
            built = {side: build(side, roots[side], conversation, args, scratch) for side in order}
            checks = {side: compare(built["old"], built[side]) for side in ("new", "warm")}
            row = {"conversation": conversation, "memories": len(built["old"]["memories"]),
                   "load": sum(b["load"] for b in built.values()) / 3,
                   "same": all(same for same, _ in checks.values()),
                   **{f"{side}_seconds": built[side]["seconds"] for side in SIDES},
                   **{f"{side}_cpu": built[side]["cpu"] for side in SIDES},
                   **{f"{side}_max_vector_delta": checks[side][1] for side in ("new", "warm")}}
            rows.append(row)
            print(_line(conversation, row) + f"{row['load']:>6.1f}  {'yes' if row['same'] else 'NO'} "
                  f"({row['new_max_vector_delta']:.0e}, {row['warm_max_vector_delta']:.0e}), {row['memories']} memories",
                  flush=True)
    total = {key: sum(r[key] for r in rows) for key in rows[0] if key.endswith(("_seconds", "_cpu"))}
    print(_line("total", total) + f"  identical output: {all(r['same'] for r in rows)}")
    print("per conversation, wall s: " + ", ".join(f"{side} {total[f'{side}_seconds'] / len(rows):.1f}" for side in SIDES))
    if args.json:
        Path(args.json).write_text(json.dumps({"baseline": baseline, "threads": args.threads, "rows": rows}, indent=2) + "\n")
    return 0 if all(r["same"] for r in rows) else 1


def _line(label: str, r: dict) -> str:
    times = "".join(f"{r[f'{side}_{kind}']:>8.1f}" for kind in ("seconds", "cpu") for side in SIDES)
    ratios = "".join(f"{r[f'old_{kind}'] / r[f'{side}_{kind}']:>5.1f}" for side in ("new", "warm")
                     for kind in ("seconds", "cpu"))
    return f"{label:<9}{times}{ratios}"


if __name__ == "__main__":
    raise SystemExit(main())
