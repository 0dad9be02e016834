"""scripts/bench_serve.py's own reporting, without starting a server."""

from __future__ import annotations

import dataclasses

from script_modules import load_script


def test_stage_busy_is_reported_only_for_the_pipelined_stages_of_micro_batching() -> None:
    bench = load_script("bench_serve")
    fields = {f.name: 0 for f in dataclasses.fields(bench.Row)}
    on = bench.Row(**{**fields, "batching": "on", "prepare_busy": 0.674, "finish_busy": 0.56})
    # without micro-batching many requests encode at once: their summed stage time is no share
    off = bench.Row(**{**fields, "batching": "off", "prepare_busy": 5.63, "finish_busy": 0.35})
    assert bench.stage_busy(on) == "67% / 56%"
    assert bench.stage_busy(off) == "–"
