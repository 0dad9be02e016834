"""`rmm ope` (issue 32 item 2): logs from rmm serve's SQLite selection store and from a training run,
targets from a checkpoint, a run folder and the baselines."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from rmm.cli import main
from rmm.cli.ope import read_logs
from rmm.policy.learner import Learner
from rmm.policy.recipes import LearnerConfig
from rmm.policy.reranker import ResidualLinearReranker
from rmm.serve.pending import SelectionStore
from rmm.serve.selection_rows import PendingSelection
from rmm.types import Candidates

D, K, M = 8, 6, 2


def _candidates(g: torch.Generator, n: int) -> list[Candidates]:
    return [Candidates(query=f"q{i}", memory_ids=[f"m{i}-{j}" for j in range(K)], retriever_scores=torch.zeros(K),
                       embeddings=torch.randn(K, D, generator=g), query_embedding=torch.randn(D, generator=g),
                       user_id="u")
            for i in range(n)]


def _fill(store: Any, n: int) -> None:
    """n sampled, rewarded selections, one greedy one and one without a parseable citation, written
    and claimed through one of rmm serve's own stores."""
    g = torch.Generator().manual_seed(0)
    mu = ResidualLinearReranker(D)
    cands = _candidates(g, n + 2)
    sels = mu.select(cands[:n + 1], M, tau=0.5, explore=True, generator=g) + mu.select(cands[n + 1:], M)
    now = time.time()
    pending = [PendingSelection(id=f"s{i}", tenant="t", user_id="u", reranker_key="", query=c.query,
                                memory_ids=list(c.memory_ids), chosen=list(s.chosen), explore=s.explore,
                                query_embedding=c.query_embedding, scores=s.scores, logp=s.logp, noise=s.noise,
                                created_at=now + i, expires_at=now + 3600, embeddings=c.embeddings, tau=s.tau,
                                version=s.version, mask=s.mask)
               for i, (c, s) in enumerate(zip(cands, sels))]
    store.put_many(pending)
    for i in range(n + 2):
        rewards = None if i == n else [1.0 if torch.rand(1, generator=g).item() < 0.4 else -1.0 for _ in range(M)]
        store.claim("t", f"s{i}", lambda _p, r=rewards: {"cited": [], "rewards": r}, now=now + i)


def _bank_with_log(folder: Path, n: int = 60) -> None:
    """A bank folder whose selections.sqlite holds `_fill`'s selections."""
    store = SelectionStore(folder / "selections.sqlite", ttl_s=3600)
    _fill(store, n)
    store.close()


def test_reads_the_serve_log_and_skips_what_it_cannot_use(tmp_path: Path) -> None:
    _bank_with_log(tmp_path)
    rows, skipped, source = read_logs(str(tmp_path))
    assert source == "sqlite" and len(rows) == 60
    assert skipped == {"greedy (explore=false)": 1, "no parseable citation": 1}
    assert [r.id for r in rows[:2]] == ["s0", "s1"]  # oldest first
    limited, _, _ = read_logs(str(tmp_path / "selections.sqlite"), limit=10)
    assert [r.id for r in limited] == [f"s{i}" for i in range(52, 60)]  # the newest 10, less the 2 skipped


def test_reads_the_postgresql_log(pg_url: str) -> None:
    from rmm.memory.pg_database import PgDatabase
    from rmm.serve.pg_pending import PgSelectionStore

    db = PgDatabase(pg_url, pool_max=2)
    try:
        _fill(PgSelectionStore(db, ttl_s=3600), 20)
    finally:
        db.close()
    rows, skipped, source = read_logs(pg_url)
    assert source == "postgresql" and [r.id for r in rows] == [f"s{i}" for i in range(20)]
    assert skipped == {"greedy (explore=false)": 1, "no parseable citation": 1}
    sqlite_like, _, _ = read_logs(pg_url, key="someone else")
    assert sqlite_like == []


def test_rows_that_do_not_match_their_logged_mu_or_are_corrupt_are_skipped(tmp_path: Path) -> None:
    import sqlite3

    _bank_with_log(tmp_path, n=10)
    with sqlite3.connect(tmp_path / "selections.sqlite") as conn:
        conn.execute("UPDATE selections SET scores = ? WHERE id = 's3'", (torch.arange(K, dtype=torch.float32)
                                                                          .numpy().tobytes(),))
        conn.execute("UPDATE selections SET embeddings = substr(embeddings, 1, 8) WHERE id = 's4'")
    rows, skipped, _ = read_logs(str(tmp_path))
    assert [r.id for r in rows] == [f"s{i}" for i in range(10) if i not in (3, 4)]
    assert skipped["stored scores do not reproduce the logged μ"] == 1 and skipped["stored corrupt"] == 1


def test_rmm_ope_prints_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _bank_with_log(tmp_path / "bank")
    checkpoint = Learner(ResidualLinearReranker(D), LearnerConfig(tau=0.5)).save(tmp_path / "ckpt")
    out = tmp_path / "ope.json"
    assert main(["ope", str(tmp_path / "bank"), str(checkpoint), "--bootstrap", "50", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "dr" in printed and "snips" in printed and "interval" in printed
    report = json.loads(out.read_text())
    assert report["selections"] == 60 and report["source"] == "sqlite" and report["skipped"]
    by_name = {e["name"]: e for e in report["estimates"]}
    # the checkpoint is the logging policy (untrained, same τ): every weight is 1
    assert by_name["ips"]["value"] == pytest.approx(by_name["logged"]["value"], abs=1e-4)
    assert main(["ope", str(tmp_path / "bank"), "uniform", "--bootstrap", "20", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["target"] == "uniform"


def test_rmm_ope_refuses_zero_overlap_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _bank_with_log(tmp_path)
    assert main(["ope", str(tmp_path), "retriever", "--greedy", "--bootstrap", "10", "--min-ess", "1000"]) == 2
    assert "effective sample size" in capsys.readouterr().out


def test_training_run_folder_as_logs_and_target(tmp_path: Path) -> None:
    """A run folder keeps only its learners' buffered records; those its checkpoint's weights sampled are used."""
    g = torch.Generator().manual_seed(1)
    learner = Learner(ResidualLinearReranker(D), LearnerConfig(tau=0.5, batch_size=100))
    for c in _candidates(g, 12):
        s = learner.select([c], M, explore=True, generator=g)[0]
        learner.record(s, torch.tensor([1.0, -1.0]))
    learner.save(tmp_path / "run" / "rerankers")
    (tmp_path / "run" / "state.json").write_text("{}")
    rows, skipped, source = read_logs(str(tmp_path / "run"))
    assert source == "training run" and len(rows) == 12 and not skipped
    assert main(["ope", str(tmp_path / "run"), str(tmp_path / "run"), "--bootstrap", "10", "--min-ess", "1"]) == 0


def test_training_run_records_sampled_by_earlier_weights_are_skipped(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(2)
    learner = Learner(ResidualLinearReranker(D), LearnerConfig(tau=0.5, batch_size=4, lr=0.05))
    sampled = [learner.select([c], M, explore=True, generator=g)[0] for c in _candidates(g, 6)]
    for s in sampled:  # the 4th record steps the learner: the last 2 stay buffered, sampled by the old weights
        learner.record(s, torch.tensor([1.0, -1.0]))
    assert learner.stats.step == 1 and learner.pending == 2
    learner.save(tmp_path / "run" / "rerankers")
    (tmp_path / "run" / "state.json").write_text("{}")
    rows, skipped, _ = read_logs(str(tmp_path / "run"))
    assert rows == [] and skipped == {"sampled by earlier weights than the run's checkpoint": 2}


def test_unknown_logs_and_target_are_one_line_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ope", str(tmp_path / "nowhere"), "uniform"]) == 2
    assert "no logs at" in capsys.readouterr().out
    _bank_with_log(tmp_path / "bank", n=4)
    assert main(["ope", str(tmp_path / "bank"), str(tmp_path), "--bootstrap", "5"]) == 2
    assert "is not a reranker checkpoint" in capsys.readouterr().out
