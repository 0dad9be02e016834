"""`python -m rmm.bench.serve --shadow`'s reporting (issue 32 item 4), without starting a server: the arms
alternate, the ratio is shadow-on over shadow-off server CPU per request, and shadow-on rows never
stand in for a batching on/off comparison."""

from __future__ import annotations

import dataclasses

from rmm.bench import serve as bench


def row(mode: str, shadow: str, cpu: float, rps: float = 100.0, clients: int = 32) -> bench.Row:
    fields = {f.name: 0 for f in dataclasses.fields(bench.Row)}
    return bench.Row(**{**fields, "batching": mode, "clients": clients, "shadow": shadow, "server_cpu_ms": cpu,
                        "req_per_s": rps})


def test_the_arms_alternate_so_a_drift_cancels() -> None:
    assert bench.shadow_arms(1) == ["off", "on"]
    assert bench.shadow_arms(2) == ["off", "on", "on", "off"]


def test_the_summary_is_the_ratio_of_the_arms_means_with_the_ope_latency() -> None:
    rows = [row("on", "off", 10.0), row("on", "on", 10.4), row("on", "on", 10.8), row("on", "off", 11.0)]
    calls = [("on", 32, 1.25, {"selections": 900, "status": "keep"}), ("on", 32, 1.5, {"selections": 1800,
                                                                                         "status": "promote"})]
    (line,) = bench.shadow_summary(rows, calls)
    assert "shadow on / off = 10.60 / 10.50 ms = 1.010x (+1.0%)" in line
    assert "GET /v1/ope 1250 ms (900 rows, keep), 1500 ms (1800 rows, promote)" in line


def test_shadow_rows_never_stand_in_for_a_batching_comparison() -> None:
    rows = [row("on", "off", 10.0, rps=300.0), row("on", "on", 10.0, rps=1.0), row("off", "off", 10.0, rps=100.0)]
    assert bench.batching_slower(rows) == []  # the shadow arm's 1 req/s is not "batching on"
    assert bench.shadow_summary([row("on", "none", 10.0)], []) == []  # no --shadow: no summary
