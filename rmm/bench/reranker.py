#!/usr/bin/env python
"""Per-turn cost of the reranker + learner versus the retrieval it sits behind (CPU).

Reranker turn = `select` (score K=20 candidates, Gumbel top-M=5, Plackett–Luce logp) + `record`
(+1/−1 rewards) + the amortised REINFORCE update (one Adam step every 4 turns). Retrieval turn =
exact search of one query over a per-user bank (N=600 and N=10k random d-dim vectors) with
`rmm.memory.index.TorchIndex` (plain torch matmul+topk when that module is unavailable) and, with
`--with-encoder`, MiniLM query encoding through `rmm.encoders.load_encoder("minilm")` (384-d
only). Goal: reranker < 1 ms per turn and < 10% of retrieval including encoding.

Timings are medians over `--repeats` repetitions (each a loop of `--turns` turns) after warm-up,
with `time.perf_counter`, or with `--clock cpu` this thread's CPU time (`time.thread_time`), which
a loaded machine inflates far less. Another process competing for the cores inflates multi-threaded
timings of tiny ops a lot (OpenMP workers waiting on a busy core), hence `--threads` (default
1: per-turn work on one query is too small to gain from threads).

The update is memory-bound: each Adam step reads and writes the two d×d weights, their
gradients and both moment buffers (~45 MB of traffic at d=768), so it is sensitive to other
processes' memory traffic. The update is torch's autograd and fused Adam (`rmm.policy.optimizer`).
The rest of a turn is per-op overhead (~70 small torch ops in `select`):
`--dims 16` shows it alone, the difference to 384 is memory traffic.

    python -m rmm.bench.reranker --dims 384 768 --with-encoder

`--baseline REV` times the reranker of another revision against this tree's in the same run: REV's
`rmm` and `kernels` exported with `git archive` into a temporary folder, each side a fresh process
(old and new alternating, ABBA, `--rounds` times), and prints both sides' figures per round with
new/old — a ratio on one machine at one time, which a shared machine's load shifts far less than
either figure.

    python -m rmm.bench.reranker --dims 384 --clock cpu --baseline HEAD~1 --rounds 4
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from io import BytesIO
from pathlib import Path

import torch

from rmm.policy.learner import Learner, LearnerConfig, rewards_from_citations
from rmm.policy.reranker import ResidualLinearReranker
from rmm.types import Candidates

log = logging.getLogger("rmm.bench.reranker")

K, M, BATCH = 20, 5, 4
DEFAULT_SIZES = (600, 10_000)


STATISTIC: Callable[[list[float]], float] = statistics.median
CLOCK: Callable[[], float] = time.perf_counter


def median_us(fn: Callable[[], object], turns: int, repeats: int, warmup: int = 2) -> float:
    """Median (or `--statistic min`) over repeats of (time for `turns` calls) / turns, in µs."""
    for _ in range(warmup):
        for _ in range(turns):
            fn()
    samples = []
    for _ in range(repeats):
        start = CLOCK()
        for _ in range(turns):
            fn()
        samples.append((CLOCK() - start) / turns)
    return STATISTIC(samples) * 1e6


def make_candidates(n: int, dim: int, seed: int) -> list[Candidates]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        q = torch.nn.functional.normalize(torch.randn(dim, generator=gen), dim=0)
        m = torch.nn.functional.normalize(torch.randn(K, dim, generator=gen), dim=1)
        scores = m @ q
        order = torch.argsort(scores, descending=True)
        out.append(Candidates(f"q{i}", [f"m{i}-{j}" for j in range(K)], scores[order], m[order], q))
    return out


def bench_reranker(dim: int, turns: int, repeats: int) -> dict[str, float]:
    cands = make_candidates(64, dim, seed=dim)
    reranker = ResidualLinearReranker(dim)
    learner = Learner(reranker, LearnerConfig(batch_size=BATCH), encoder_name="bench")
    gen = torch.Generator().manual_seed(0)
    state = {"i": 0}

    def next_candidates() -> Candidates:
        state["i"] = (state["i"] + 1) % len(cands)
        return cands[state["i"]]

    def select() -> object:
        return reranker.select([next_candidates()], M, explore=True, generator=gen)[0]

    def full_turn() -> None:
        sel = reranker.select([next_candidates()], M, explore=True, generator=gen)[0]
        learner.record(sel, rewards_from_citations(M, [0, 2]))

    greedy = median_us(lambda: reranker.select([next_candidates()], M), turns, repeats)
    sampled = median_us(select, turns, repeats)
    per_turn = median_us(full_turn, turns - turns % BATCH or BATCH, repeats)
    sels = [select() for _ in range(BATCH)]
    rewards = rewards_from_citations(M, [1])

    def one_update() -> None:
        for s in sels:
            learner.record(s, rewards)

    update = median_us(one_update, max(1, turns // BATCH), repeats)  # 4 records incl. one update
    return {"greedy_select": greedy, "explore_select": sampled, "update_batch": update, "turn": per_turn}


def bench_retrieval(dim: int, n: int, turns: int, repeats: int) -> tuple[float, str]:
    gen = torch.Generator().manual_seed(n)
    vectors = torch.nn.functional.normalize(torch.randn(n, dim, generator=gen), dim=1)
    queries = torch.nn.functional.normalize(torch.randn(256, dim, generator=gen), dim=1)
    state = {"i": 0}
    try:
        from rmm.memory.index import TorchIndex

        index = TorchIndex(dim, device="cpu")
        index.add([f"m{i}" for i in range(n)], vectors)
        label = "TorchIndex"

        def search() -> object:
            state["i"] = (state["i"] + 1) % len(queries)
            return index.search(queries[state["i"] : state["i"] + 1], K)
    except ImportError:
        label = "torch matmul+topk"

        def search() -> object:
            state["i"] = (state["i"] + 1) % len(queries)
            return torch.topk(queries[state["i"] : state["i"] + 1] @ vectors.T, K, dim=1)

    return median_us(search, turns, repeats), label


def bench_encoder(turns: int, repeats: int) -> float | None:
    try:
        from rmm.encoders import load_encoder

        encoder = load_encoder("minilm", device="cpu")
    except Exception as exc:  # noqa: BLE001 - optional part of the benchmark
        log.warning("MiniLM encoder unavailable (%s); skipping encoding", exc)
        return None
    texts = [
        "What did I say about my sister's wedding last spring?",
        "Which hiking trail did we talk about?",
        "Do you remember the name of my dog?",
        "When am I travelling to Lisbon?",
    ]
    state = {"i": 0}

    def encode() -> object:
        state["i"] = (state["i"] + 1) % len(texts)
        return encoder.encode_queries([texts[state["i"]]])

    return median_us(encode, max(4, turns // 10), repeats)


ROOT = Path(__file__).resolve().parents[2]  # the checkout
REPORTED = ("explore_select", "update_batch", "turn")


def export_tree(revision: str, folder: Path) -> Path:
    """`rmm` and `kernels` as of `revision`, laid out as installed (`kernels` → `rmm.kernels`) under `folder`."""
    for path in ("rmm", "kernels"):  # a clear refusal, not git archive's pathspec error
        found = subprocess.run(["git", "cat-file", "-e", f"{revision}:{path}"], cwd=ROOT, capture_output=True,
                               check=False)
        if found.returncode:
            raise SystemExit(f"--baseline {revision}: no {path}/ folder at that revision (or no such revision); "
                             "the baseline must have rmm/ and kernels/ (from the commit that added kernels/ on)")
    archive = subprocess.run(["git", "archive", "--format=tar", revision, "rmm", "kernels"], cwd=ROOT,
                             capture_output=True, check=True).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(folder, filter="data")
    (folder / "kernels").rename(folder / "rmm" / "kernels")
    return folder


def run_side(tree: Path | None, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """One fresh process timing the reranker (`--worker`) on `tree`'s rmm, or this checkout's when None."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
    # by path, not `-m` (the baseline tree has no rmm.bench); -P keeps rmm/bench/ off sys.path, where its
    # module names (kernels, search, …) would shadow installed packages
    command = [sys.executable, "-P", str(Path(__file__).resolve()), "--worker", "--dims", *map(str, args.dims),
               "--turns", str(args.turns), "--repeats", str(args.repeats), "--threads", str(args.threads),
               "--statistic", args.statistic, "--clock", args.clock]
    done = subprocess.run(command, env=env, cwd=tempfile.gettempdir(), capture_output=True, text=True, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    expected = (tree or ROOT).resolve()
    for package in ("rmm", "kernels"):  # an editable install's mapping could serve another tree's kernels
        if not Path(result[package]).resolve().is_relative_to(expected):
            raise SystemExit(f"a worker imported {package} from {result[package]}, not from {expected}")
    return result["dims"]


def compare(args: argparse.Namespace) -> None:
    """Old (`--baseline`) and new reranker turns, alternating fresh processes; prints each round and new/old."""
    def load() -> str:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())

    with tempfile.TemporaryDirectory(prefix="bench_reranker_") as tmp:
        tree = export_tree(args.baseline, Path(tmp))
        print(f"baseline {args.baseline} vs this tree; {args.statistic} of {args.repeats} x {args.turns} turns, "
              f"{args.clock} clock, {args.threads} thread(s); load averages at start {load()}")
        print(f"{'round':>5} {'side':>4} {'d':>4} | {'explore':>8} {'upd/4':>8} {'rerank':>8} | {'new/old':>7}")
        turns: dict[int, dict[str, list[float]]] = {d: {"old": [], "new": []} for d in args.dims}
        for r in range(args.rounds):
            sides = ("old", "new") if r % 2 == 0 else ("new", "old")
            results = {side: run_side(tree if side == "old" else None, args) for side in sides}
            for dim in args.dims:
                for side in ("old", "new"):
                    fig = results[side][str(dim)]
                    turns[dim][side].append(fig["turn"])
                    ratio = fig["turn"] / results["old"][str(dim)]["turn"] if side == "new" else None
                    print(f"{r + 1:>5} {side:>4} {dim:>4} | " + " ".join(f"{fig[k]:>8.1f}" for k in REPORTED)
                          + (f" | {ratio:>7.2f}" if ratio is not None else " |"))
        print(f"load averages at end {load()}")
        for dim in args.dims:
            old, new = (statistics.median(turns[dim][side]) for side in ("old", "new"))
            print(f"d={dim}: rerank per turn, median of {args.rounds} rounds: old {old:.1f} µs, new {new:.1f} µs, "
                  f"new/old {new / old:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[384, 768])
    parser.add_argument("--sizes", type=int, nargs="+", help=f"bank sizes N for the retrieval side "
                        f"(default {' '.join(map(str, DEFAULT_SIZES))}; not with --baseline)")
    parser.add_argument("--turns", type=int, default=200, help="turns per timed repetition")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (0 = leave as is)")
    parser.add_argument("--with-encoder", action="store_true",
                        help="also time MiniLM query encoding (384-d; not with --baseline)")
    parser.add_argument("--statistic", choices=["median", "min"], default="median",
                        help="min = least-disturbed repetition, for a machine shared with other work")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="cpu = this thread's CPU time (time.thread_time): what a turn costs whatever else "
                             "the machine runs; needs --threads 1")
    parser.add_argument("--baseline", metavar="REV",
                        help="also time git revision REV's reranker in the same run (fresh processes, alternating)")
    parser.add_argument("--rounds", type=int, default=4, help="old/new process pairs with --baseline")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # one side of --baseline
    args = parser.parse_args()
    if args.baseline and (args.with_encoder or args.sizes):
        parser.error("--baseline times only the reranker: drop --with-encoder and --sizes")
    global STATISTIC, CLOCK
    STATISTIC = min if args.statistic == "min" else statistics.median
    if args.clock == "cpu" and args.threads != 1:
        parser.error("--clock cpu counts only this thread's time: use it with --threads 1")
    CLOCK = time.thread_time if args.clock == "cpu" else time.perf_counter
    logging.basicConfig(level=logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.worker:
        import rmm.kernels

        dims = {str(dim): bench_reranker(dim, args.turns, args.repeats) for dim in args.dims}
        print(json.dumps({"rmm": rmm.__file__, "kernels": rmm.kernels.__file__, "dims": dims}))
        return
    if args.baseline:
        compare(args)
        return
    sizes = args.sizes or DEFAULT_SIZES

    encode_us = bench_encoder(args.turns, args.repeats) if args.with_encoder else None
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s) of {os.cpu_count()} CPUs "
          f"(1-min load average {load:.1f}); K={K} M={M} batch={BATCH}; "
          f"{args.statistic} of {args.repeats} x {args.turns} turns, {args.clock} clock")
    header = (f"{'d':>4} {'N':>6} | {'select':>8} {'explore':>8} {'upd/4':>8} {'rerank':>8} | "
              f"{'search':>8} {'encode':>8} {'retr.':>8} | {'ratio':>7} {'<1ms':>5}")
    print(header)
    print("-" * len(header))
    for dim in args.dims:
        rr = bench_reranker(dim, args.turns, args.repeats)
        for n in sizes:
            search_us, label = bench_retrieval(dim, n, args.turns, args.repeats)
            enc = encode_us if dim == 384 else None
            retrieval = search_us + (enc or 0.0)
            ratio = rr["turn"] / retrieval
            print(
                f"{dim:>4} {n:>6} | {rr['greedy_select']:>8.1f} {rr['explore_select']:>8.1f} "
                f"{rr['update_batch']:>8.1f} {rr['turn']:>8.1f} | {search_us:>8.1f} "
                f"{'-' if enc is None else f'{enc:.0f}':>8} {retrieval:>8.1f} | {ratio:>7.1%} "
                f"{'yes' if rr['turn'] < 1000 else 'no':>5}"
            )
    print(f"\nAll figures µs per turn. search = {label} exact top-{K} of one query; encode = MiniLM "
          "query encoding (384-d rows only); retr. = search + encode; rerank = select(explore) + "
          f"record + 1/{BATCH} of an Adam update; upd/4 = {BATCH} records incl. one update; "
          "ratio = rerank / retr.")


if __name__ == "__main__":
    main()
