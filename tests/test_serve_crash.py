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
