"""kill -9 under write load: every acknowledged memory, selection, event and tree node survives (real
subprocess server); the --tree checker itself fails on each kind of damage to a bank file."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from rmm.bench.crash import TENANT, NodeState, StoreTreeAcks, TreeAcks, verify_store_tree, verify_tree_tables
from rmm.memory.bank import STORE_FILE
from rmm.memory.tree import SQLITE_TABLES

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


@pytest.mark.slow
def test_crash_test_keeps_the_tree_consistent(minilm_path: Path) -> None:
    """--tree: tree nodes added (showing memories, and inner nodes), edited and removed under load,
    kill -9 twice; every acknowledged node is at its last acknowledged version or tombstoned, nothing
    dangles, no node's versions or request is half-written."""
    result = subprocess.run(
        [sys.executable, "-m", "rmm.bench.crash", "--tree", "--writers", "2", "--readers", "1",
         "--tree-writers", "3", "--seconds", "6", "--rounds", "2", "--sample", "5"],
        check=False, capture_output=True, text=True, timeout=900, env={**os.environ, "HF_HUB_OFFLINE": "1"}, cwd=REPO,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "CRASH TEST PASSED" in out and " 0 lost" in out
    assert "tree (api): 0 lost, 0 wrong, 0 not removed, 0 unexplained, 0 unknown" in out
    assert "tree (sqlite): 0 lost, 0 wrong, 0 not removed, 0 unexplained, 0 unknown" in out
    assert ("0 with broken versions, 0 rows showing a missing memory, 0 with another text than their memory's, "
            "0 live nodes with a missing or removed parent") in out
    assert " 0 half-written;" in out and " 0 half\n" in out and "tree (store writer): 0 lost, 0 wrong" in out
    assert "0 lost or changed;" in out and " 0 half stored" in out


def _tree_bank(tmp_path: Path) -> tuple[Path, TreeAcks]:
    """A bank file holding what `_tree_acks` acknowledged: a session, a Turn edited once, a Turn
    removed; and the acknowledgements, with an add of two nodes cut off before it landed."""
    bank = tmp_path / "bank"
    bank.mkdir()
    with sqlite3.connect(bank / STORE_FILE) as db:
        db.executescript(SQLITE_TABLES + "CREATE TABLE memories (user_id TEXT, id TEXT, text TEXT);")
        user = f"{TENANT}:u"
        db.executemany("INSERT INTO memories VALUES (?,?,?)", [(user, "m1", "one"), (user, "m2", "two")])
        rows = [("s1", 1, 1, 0, None, "Session", {}, None, None), ("t1", 1, 0, 0, "s1", "Turn", {}, "m1", "one"),
                ("t1", 2, 1, 0, "s1", "Turn", {"label": "e"}, "m1", "one"),
                ("t2", 1, 0, 0, "s1", "Turn", {}, "m2", "two"), ("t2", 2, 1, 1, "s1", "Turn", {}, "m2", "two")]
        db.executemany("INSERT INTO tree_nodes (user_id, node_id, version, revision, latest, deleted, parent_id, "
                       "node_type, position, attributes, memory_id, text) VALUES (?,?,?,1,?,?,?,?,0,?,?,?)",
                       [(user, n, v, latest, d, parent, t, json.dumps(a), m, text)
                        for n, v, latest, d, parent, t, a, m, text in rows])
    acks = TreeAcks()
    acks.nodes = {("u", "s1"): NodeState("Session", None, {}, None),
                  ("u", "t1"): NodeState("Turn", "s1", {"label": "e"}, "m1", 2),
                  ("u", "t2"): NodeState("Turn", "s1", {}, "m2", 2, deleted=True)}
    acks.adds = [("u", ["s1", "t1", "t2"], True), ("u", ["c1", "c2"], False)]
    cut = {"c1": NodeState("Session", None, {}, None), "c2": NodeState("Turn", "c1", {}, "m1")}
    acks.cut = [("u", {}, cut)]
    acks.maybe = {("u", i): [None, state] for i, state in cut.items()}
    acks.counts.update(adds=1, nodes=3, edits=1, removes=1, tombstones=1)
    return bank, acks


FAULTS = {
    "edit lost": ("DELETE FROM tree_nodes WHERE node_id='t1' AND version=2; "
                  "UPDATE tree_nodes SET latest=1 WHERE node_id='t1'", "1 wrong"),
    "removal lost": ("DELETE FROM tree_nodes WHERE node_id='t2' AND version=2; "
                     "UPDATE tree_nodes SET latest=1 WHERE node_id='t2'", "1 not removed"),
    "no latest row": ("UPDATE tree_nodes SET latest=0 WHERE node_id='t1' AND version=2", "1 with broken versions"),
    "memory missing": ("DELETE FROM memories WHERE id='m1'", "2 rows showing a missing memory"),
    "parent removed": ("UPDATE tree_nodes SET deleted=1 WHERE node_id='s1'", "1 live nodes with a missing"),
    "node lost": ("DELETE FROM tree_nodes WHERE node_id='t1'", "1 half-written"),
    "cut-off add torn": ("INSERT INTO tree_nodes VALUES ('crash:u','c1',1,2,1,0,NULL,'Session',0,'{}',NULL,NULL)",
                         "0 not at all, 1 half"),
}


def test_tree_check_passes_a_consistent_bank(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bank, acks = _tree_bank(tmp_path)
    assert verify_tree_tables(bank, acks) is False, capsys.readouterr()
    assert "1 tree requests cut off by the kills: 0 landed whole, 1 not at all, 0 half" in capsys.readouterr().out


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_tree_check_finds_each_fault(tmp_path: Path, capsys: pytest.CaptureFixture[str], fault: str) -> None:
    """The --tree check is not vacuous: each kind of damage to the bank file fails it, by name."""
    bank, acks = _tree_bank(tmp_path)
    sql, message = FAULTS[fault]
    with sqlite3.connect(bank / STORE_FILE) as db:
        db.executescript(sql)
    assert verify_tree_tables(bank, acks) is True
    assert message in capsys.readouterr().out


@pytest.mark.parametrize("fault", ["", "memory changed", "cut-off add half stored"])
def test_store_writer_check_finds_lost_memories_and_torn_adds(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                              fault: str) -> None:
    bank, tree_acks = _tree_bank(tmp_path)
    acks = StoreTreeAcks(tree=tree_acks, memories={("u", "m1"): "one"}, cut=[("u", ["m3"], ["c1", "c2"])])
    with sqlite3.connect(bank / STORE_FILE) as db:
        if fault == "memory changed":
            db.execute("UPDATE memories SET text='other' WHERE id='m1'")
        elif fault:
            db.execute("INSERT INTO memories VALUES (?, 'm3', 'three')", (f"{TENANT}:u",))
    assert verify_store_tree(bank, acks) is bool(fault)
    out = capsys.readouterr().out
    assert {"": "0 lost or changed; 1 adds with memories cut off by the kills, 0 half stored",
            "memory changed": "1 lost or changed;", "cut-off add half stored": "1 half stored"}[fault] in out
