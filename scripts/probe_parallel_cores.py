#!/usr/bin/env python
"""Can this machine run two compute-heavy threads at once? Before spreading server work over cores.

Times one process alone, then two at once, for three kinds of work: an int8 matmul (what the
server's query encoder spends its time in), a float32 matmul, and a pure-Python loop. A second
process that runs at the first one's speed means a second core for that kind of work; one that
halves both means the cores share it (SMT siblings, or a host that gives the machine less than it
shows). Prints each kind's throughput with two processes relative to one.

    python scripts/probe_parallel_cores.py
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time


def work(kind: str, seconds: float, out: mp.Queue) -> None:
    import torch

    torch.set_num_threads(1)
    if kind == "int8 matmul":
        a = torch.randint(-127, 127, (256, 384), dtype=torch.int8)
        b = torch.randint(-127, 127, (384, 1536), dtype=torch.int8)
        step = lambda: torch._int_mm(a, b)
    elif kind == "float32 matmul":
        a, b = torch.randn(256, 384), torch.randn(384, 1536)
        step = lambda: a @ b
    else:
        def step() -> int:
            return sum(i * i % 7 for i in range(2000))
    for _ in range(5):
        step()
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        step()
        done += 1
    out.put(done / (time.perf_counter() - start))


def rate(kind: str, processes: int, seconds: float) -> float:
    out: mp.Queue = mp.Queue()
    workers = [mp.Process(target=work, args=(kind, seconds, out)) for _ in range(processes)]
    for w in workers:
        w.start()
    total = sum(out.get() for _ in workers)
    for w in workers:
        w.join()
    return total


def main() -> int:
    seconds = 3.0
    print(f"{os.cpu_count()} CPUs reported; {seconds:.0f} s per measurement")
    for kind in ("int8 matmul", "float32 matmul", "pure Python"):
        one, two = rate(kind, 1, seconds), rate(kind, 2, seconds)
        print(f"{kind:>15}: two processes do {two / one:.2f}x the work of one")
    print(f"load average {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
