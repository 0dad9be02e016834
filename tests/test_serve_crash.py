"""kill -9 under write load: every acknowledged memory and selection survives (real subprocess server)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_crash_test_script_loses_nothing_acknowledged(minilm_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "rmm.bench.crash", "--writers", "4", "--readers", "1",
         "--seconds", "4", "--rounds", "2", "--sample", "10"],
        check=False, capture_output=True, text=True, timeout=900, env={**os.environ, "HF_HUB_OFFLINE": "1"}, cwd=REPO,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "CRASH TEST PASSED" in result.stdout and " 0 lost" in result.stdout


@pytest.mark.slow
def test_crash_test_keeps_the_event_graph_consistent(minilm_path: Path) -> None:
    """--events: sessions into the event graph and event memories under load, kill -9 twice; every
    acknowledged event is there, every acknowledged session's events job finishes, no dangling edge."""
    result = subprocess.run(
        [sys.executable, "-m", "rmm.bench.crash", "--events", "--writers", "2", "--readers", "1",
         "--event-writers", "2", "--seconds", "6", "--rounds", "2", "--sample", "5"],
        check=False, capture_output=True, text=True, timeout=900, env={**os.environ, "HF_HUB_OFFLINE": "1"}, cwd=REPO,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "CRASH TEST PASSED" in out and " 0 lost" in out
    assert "0 edges from a missing memory, 0 edges to a missing memory" in out
    assert "0 failed or cancelled, 0 unfinished" in out and "0 sessions with no event over their turns" in out
