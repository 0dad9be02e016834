"""rmm/bench/serve.py's own reporting, without starting a server."""

from __future__ import annotations

import dataclasses

from rmm.bench import serve as bench


def test_stage_busy_is_reported_only_for_the_pipelined_stages_of_micro_batching() -> None:
    fields = {f.name: 0 for f in dataclasses.fields(bench.Row)}
    on = bench.Row(**{**fields, "batching": "on", "prepare_busy": 0.674, "finish_busy": 0.56})
    # without micro-batching many requests encode at once: their summed stage time is no share
    off = bench.Row(**{**fields, "batching": "off", "prepare_busy": 5.63, "finish_busy": 0.35})
    assert bench.stage_busy(on) == "67% / 56%"
    assert bench.stage_busy(off) == "–"


def test_batching_on_slower_than_off_fails_the_bench() -> None:
    fields = {f.name: 0 for f in dataclasses.fields(bench.Row)}

    def row(mode: str, clients: int, rps: float):
        return bench.Row(**{**fields, "batching": mode, "clients": clients, "req_per_s": rps})

    healthy = [row("on", 32, 380.0), row("off", 32, 125.0), row("on", 8, 90.0), row("off", 8, 90.0)]
    assert bench.batching_slower(healthy) == []
    broken = [row("on", 32, 0.3), row("off", 32, 124.6), row("on", 1, 20.0)]  # 1 client: no 'off' row to compare
    assert bench.batching_slower(broken) == ["batching on is slower than off at 32 clients: 0.3 vs 124.6 req/s"]


def test_the_bench_names_the_servers_query_engine() -> None:
    health = {"query_engine": {"engine": "int8", "requested": "auto", "cached": True, "batch_sizes": [1, 16],
                               "ms_per_query": {"float32": {"1": 5.0, "16": 2.0}, "int8": {"1": 2.5, "16": 1.0}},
                               "skipped": {}, "note": ""}}
    assert bench.engine_line(health) == ("query engine int8 (asked auto, cached ms/query at batch 1/16: "
                                         "float32 5.00/2.00; int8 2.50/1.00)")
    assert bench.engine_line({}) == "query engine not reported"
