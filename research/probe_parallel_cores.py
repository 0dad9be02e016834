#!/usr/bin/env python
"""Can this machine run two compute-heavy threads at once? Before spreading server work over cores.

Times one process alone, then two at once, for three kinds of work: an int8 matmul (what the
server's query encoder spends its time in), a float32 matmul, and a pure-Python loop. A second
process that runs at the first one's speed means a second core for that kind of work; one that
halves both means the cores share it (SMT siblings, or a host that gives the machine less than it
shows). Prints each kind's throughput with two processes relative to one.

Then the GIL: 300 small torch ops in one thread, alone and beside a thread running pure Python.
Each op hands the GIL back and takes it again, so beside a thread that holds it they crawl — why
the server encodes queries in a child process (`rmm.encoders.query.process`).

    python research/probe_parallel_cores.py
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
    alone, beside = gil_probe()
    print(f"300 small torch ops: {alone:.1f} ms alone, {beside:.1f} ms beside a pure-Python thread "
          f"({beside / alone:.0f}x)")
    print(f"load average {os.getloadavg()[0]:.1f}")
    return 0


def gil_probe() -> tuple[float, float]:
    """Milliseconds for 300 GELU-and-scale ops on a [64, 384] tensor, alone and beside a busy thread."""
    import threading

    import torch

    torch.set_num_threads(1)
    x = torch.randn(64, 384)

    def ops() -> float:
        y, start = x, time.perf_counter()
        for _ in range(300):
            y = torch.nn.functional.gelu(y) * 0.5 + 0.1
        return 1000 * (time.perf_counter() - start)

    ops()
    alone = ops()
    stop = threading.Event()

    def busy() -> None:
        total = 0
        while not stop.is_set():
            for i in range(1000):
                total += i

    thread = threading.Thread(target=busy)
    thread.start()
    try:
        beside = ops()
    finally:
        stop.set()
        thread.join()
    return alone, beside


if __name__ == "__main__":
    raise SystemExit(main())
