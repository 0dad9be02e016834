"""rmm/bench/search.py over several users' indexes: every index is searched, and each
lower-precision torch index (and faiss's 8-bit one) finds what float32 finds on the first."""

from __future__ import annotations

import pytest

from rmm.bench import search as bench


def test_queries_spread_over_every_users_index(capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    searched: dict[int, int] = {}
    search = bench.TorchIndex.search

    kept = []  # each index stays alive, so no later one can take its id

    def counting(self, queries, k):  # type: ignore[no-untyped-def]
        kept.append(self)
        searched[id(self)] = searched.get(id(self), 0) + 1
        return search(self, queries, k)

    monkeypatch.setattr(bench.TorchIndex, "search", counting)
    code = bench.main(["--sizes", "640", "--users", "3", "--backends", "torch", "torch-int8", "torch-int4",
                       "faiss-sq8", "torch-auto", "--queries", "40", "--k", "5", "--threads", "1"])
    assert code == 0
    assert len(searched) == 12 and min(searched.values()) >= 2  # 4 torch backends x 3 users, each searched
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("|       640")]
    assert len(table) == 5 and all("|     1.000 |" in line for line in table), table
    assert "| scans " in table[-1] and " at 16 q" in table[-1]  # torch-auto names what its measurement chose
