"""The server's shared state on PostgreSQL: selections + feedback, jobs, reranker versions, one learner.

Against a real embedded PostgreSQL with pgvector (skipped only where `pgserver` cannot be imported).
Two `RetrievalService`s over one bank schema stand for two replicas.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from fakes import BagOfWordsEncoder

pytest.importorskip("psycopg", reason="PostgreSQL banks need psycopg (postgres extra)")

import psycopg

from rmm.memory.pg_connect import parse_location
from rmm.memory.pg_database import PgDatabase
from rmm.policy.learner import Learner, rewards_from_citations
from rmm.policy.pg_versions import RerankerVersions, learner_to_bytes
from rmm.policy.registry import LearnerRegistry
from rmm.policy.reranker import ResidualLinearReranker
from rmm.serve.config import load_config
from rmm.serve.errors import (
    SelectionExpiredError,
    SelectionUsedError,
    UnknownSelectionError,
)
from rmm.serve.feedback import rebuild
from rmm.serve.learner_lease import learner_holder
from rmm.serve.metrics import ServiceCollector
from rmm.serve.pending import PendingSelection, SelectionStore, open_selections
from rmm.serve.pg_jobs import PgJobQueue
from rmm.serve.pg_pending import PgSelectionStore, unapplied_feedback
from rmm.serve.records import NewMemory, RetrieveItem, RetrieveResult
from rmm.serve.service import RetrievalService

KEYS = {"key-alpha-123": "alpha", "key-beta-4567": "beta"}
FACTS = ["Ana hikes mountain trails every weekend", "Ana bakes sourdough bread on Sundays",
         "Ana plays cello in a community orchestra", "Ana adopted a golden retriever puppy",
         "Ana works as a nurse at the city hospital", "Ana booked a summer trip to Lisbon"]
D = 8


@pytest.fixture
def url(pg_url: str) -> str:
    """The module's bank, with the server tables emptied too."""
    with psycopg.connect(parse_location(pg_url).conninfo, autocommit=True) as conn:
        schema = parse_location(pg_url).schema
        exists = conn.execute("SELECT 1 FROM pg_tables WHERE schemaname = %s AND tablename = 'feedback'",
                              (schema,)).fetchone()
        if exists:
            conn.execute(f"TRUNCATE {schema}.feedback, {schema}.selections, {schema}.jobs, "
                         f"{schema}.reranker_versions RESTART IDENTITY")
    return pg_url


@pytest.fixture
def db(url: str) -> Iterator[PgDatabase]:
    handle = PgDatabase(url)
    yield handle
    handle.close()


def pending(sid: str, *, tenant: str = "alpha", explore: bool = True, k: int = 4, ttl: float = 60.0,
            seed: int = 0) -> PendingSelection:
    g = torch.Generator().manual_seed(seed)
    now = time.time()
    return PendingSelection(
        id=sid, tenant=tenant, user_id=f"{tenant}:ana", reranker_key=tenant, query="q", memory_ids=[f"m{i}" for i in range(k)],
        chosen=[2, 0], explore=explore, query_embedding=torch.randn(D, generator=g), scores=torch.randn(k, generator=g),
        logp=torch.tensor([-0.7, -0.9]) if explore else None, noise=None, created_at=now, expires_at=now + ttl,
        embeddings=torch.randn(k, D, generator=g), tau=0.5, version=3, mask=torch.tensor([True, True, False, True]))


# ---- selections and feedback ----------------------------------------------------------------------
def test_a_selection_written_by_one_replica_is_claimed_once_by_another_with_its_feedback_durable(
        db: PgDatabase, url: str) -> None:
    a, b = PgSelectionStore(db, ttl_s=60), open_selections(url, ttl_s=60)
    assert isinstance(b, PgSelectionStore) and b.learns_in_background and not a.db is b.db
    original = pending("s1")
    a.put_many([original, pending("s2", explore=False, seed=1)])
    assert a.count_pending() == 2
    with pytest.raises(UnknownSelectionError):
        b.claim("beta", "s1")  # another tenant's
    got = b.claim("alpha", "s1", lambda s: {"rewards": [1.0, -1.0], "learned": True})
    for name in ("query_embedding", "scores", "logp", "embeddings", "mask"):
        assert torch.equal(getattr(got, name), getattr(original, name)), name
    assert (got.chosen, got.tau, got.version, got.memory_ids) == ([2, 0], 0.5, 3, original.memory_ids)
    with pytest.raises(SelectionUsedError):
        a.claim("alpha", "s1")
    b.claim("alpha", "s2", lambda s: {"rewards": [1.0, 1.0], "learned": False})  # greedy: stored, never learned
    assert a.feedback_of("alpha", "s1") == {"rewards": [1.0, -1.0], "learned": True}
    with db.tx() as cur:
        rows = unapplied_feedback(cur)
    assert [(r.seq, r.selection.id, r.rewards) for r in rows] == [(1, "s1", [1.0, -1.0])]
    assert a.count_unapplied() == 1
    b.close()


def test_refused_feedback_leaves_the_selection_open_and_expired_ones_answer_410(db: PgDatabase) -> None:
    store = PgSelectionStore(db, ttl_s=60)
    store.put_many([pending("open"), pending("old", ttl=-1.0)])

    def refuse(_: PendingSelection) -> None:
        raise ValueError("bad citation")

    with pytest.raises(ValueError):
        store.claim("alpha", "open", refuse)
    assert store.count_unapplied() == 0
    store.claim("alpha", "open", lambda s: {"rewards": [1.0, -1.0]})
    with pytest.raises(SelectionExpiredError):
        store.claim("alpha", "old")


def test_sweep_keeps_rewarded_rows_until_the_learner_applied_them_and_delete_user_cascades(db: PgDatabase) -> None:
    store = PgSelectionStore(db, ttl_s=10)
    store.put_many([pending("rewarded"), pending("waiting", ttl=-100)])
    store.claim("alpha", "rewarded", lambda s: {"rewards": [1.0, -1.0]}, now=time.time() - 50)
    assert store.sweep() == 1  # the expired one; the rewarded one's feedback is not applied yet
    with db.tx() as cur:
        cur.execute("UPDATE feedback SET applied_version = 1")
    assert store.sweep() == 1
    store.put_many([pending("x")])
    store.claim("alpha", "x", lambda s: {"rewards": [1.0, -1.0]})
    assert store.delete_user("alpha:ana") == 1
    with db.tx() as cur:
        assert cur.execute("SELECT count(*) FROM feedback").fetchone()[0] == 0


def test_sqlite_stays_the_default_selection_store(tmp_path: Path) -> None:
    store = open_selections(tmp_path / "s.sqlite", ttl_s=60)
    assert isinstance(store, SelectionStore) and not store.learns_in_background
    store.close()


# ---- jobs ---------------------------------------------------------------------------------------
def test_jobs_run_once_across_two_workers_in_each_users_order(db: PgDatabase) -> None:
    ran: list[tuple[str, str, int]] = []
    lock = threading.Lock()

    def handler(name: str):
        def run(job, payload):
            time.sleep(0.02)
            with lock:
                ran.append((name, job.user_id, payload["n"]))
            return {"n": payload["n"]}
        return run

    a, b = PgJobQueue(db, handler("a"), poll_s=0.05), PgJobQueue(db, handler("b"), poll_s=0.05)
    ids = [a.submit("alpha", f"alpha:u{n % 3}", "reflect", {"n": n}).id for n in range(12)]
    a.start()
    b.start()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and a.counts().get("done", 0) < 12:
        time.sleep(0.05)
    a.close()
    b.close()
    assert a.counts() == {"done": 12}
    assert sorted(n for _, _, n in ran) == list(range(12))  # each exactly once
    for user in ("alpha:u0", "alpha:u1", "alpha:u2"):
        order = [n for _, u, n in ran if u == user]
        assert order == sorted(order)  # a user's sessions in the order they happened
    assert {name for name, _, _ in ran} == {"a", "b"}  # both replicas worked
    assert b.get("alpha", ids[0]).result == {"n": 0}


def test_a_crashed_claimers_job_is_claimed_again_after_its_lease(db: PgDatabase) -> None:
    crashed = PgJobQueue(db, lambda job, payload: {}, lease_s=0.4)
    job = crashed.submit("alpha", "alpha:ana", "reflect", {"n": 1})
    assert crashed.claim() is not None  # claimed, then the replica "dies": never finished, never renewed
    survivor = PgJobQueue(db, lambda job, payload: {"by": "survivor"}, lease_s=0.4)
    assert survivor.claim() is None  # still leased
    time.sleep(0.5)
    assert survivor.run_one()
    assert survivor.get("alpha", job.id).status == "done"
    with db.tx() as cur:
        assert cur.execute("SELECT attempts FROM jobs WHERE id = %s", (job.id,)).fetchone()[0] == 2


# ---- reranker versions --------------------------------------------------------------------------
def test_registry_loads_the_newest_stored_version_and_refresh_swaps_in_newer_ones(db: PgDatabase) -> None:
    from rmm.policy.recipes import LearnerConfig

    versions = RerankerVersions(db, keep=2)
    reader = LearnerRegistry(D, LearnerConfig(), encoder_name="enc", versions=versions)
    assert reader.get("alpha").stats.step == 0 and reader.version_of("alpha") == 0
    trained = Learner(ResidualLinearReranker(D, lexical_feature=LearnerConfig().lexical_feature,
                                             feature_names=reader.feature_names), LearnerConfig(), encoder_name="enc")
    for version in (1, 2, 3):
        with torch.no_grad():
            trained.reranker.W_q.weight.fill_(version)
        trained.stats.step = version
        with db.tx() as cur:
            versions.write(cur, "alpha", version, learner_to_bytes(trained))
    assert versions.latest() == {"alpha": 3}
    with db.tx() as cur:
        assert [r[0] for r in cur.execute("SELECT version FROM reranker_versions ORDER BY version")] == [2, 3]
    assert reader.refresh(versions.latest()) == ["alpha"]
    assert reader.version_of("alpha") == 3 and float(reader.get("alpha").reranker.W_q.weight.detach()[0, 0]) == 3.0
    assert reader.get("alpha").reranker.version == 3  # stamped on what it samples
    assert reader.save() == 0  # replicas never write versions by checkpointing
    fresh = LearnerRegistry(D, LearnerConfig(), encoder_name="enc", versions=versions)
    assert fresh.get("alpha").stats.step == 3
    with pytest.raises(psycopg.errors.UniqueViolation), db.tx() as cur:
        versions.write(cur, "alpha", 3, b"a second writer")


# ---- two replicas, one learner ----------------------------------------------------------------------
def make_replica(tmp_path: Path, url: str, name: str, **overrides) -> RetrievalService:
    config = load_config(None, {"bank": str(tmp_path / name), "store": url, "auth.keys": KEYS, "device": "cpu",
                                "reranker_per": "tenant", "learner": {"batch_size": 2}, "reload_interval_s": 0.2,
                                **overrides}, environ={})
    service = RetrievalService(config, encoder=BagOfWordsEncoder())
    service.start()
    return service


def retrieve(service: RetrievalService, query: str, explore: bool = True) -> RetrieveResult:
    (result,) = service.retrieve_batch([RetrieveItem(tenant="alpha", user="ana", query=query, k=6, m=2,
                                                     explore=explore)])
    assert isinstance(result, RetrieveResult), result
    return result


def wait_for(predicate, timeout: float = 10.0) -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError("condition not reached in time")
        time.sleep(0.05)
    return time.monotonic() - start


def test_feedback_on_the_other_replica_is_learned_once_as_sampled_and_every_replica_loads_the_version(
        tmp_path: Path, url: str) -> None:
    a = make_replica(tmp_path, url, "a")
    wait_for(lambda: a.shared_learning.is_learner)
    b = make_replica(tmp_path, url, "b")
    try:
        a.add_memories("alpha", "ana", [NewMemory(text=t) for t in FACTS])
        sampled = [retrieve(a, q) for q in ("hiking trails", "sourdough bread", "cello", "puppy")]
        greedy = retrieve(b, "nurse hospital", explore=False)
        with a.db.tx() as cur:  # what the learner must learn from: the rows as sampled
            stored = {r.selection_id: _row(cur, r.selection_id) for r in sampled}
        for n, result in enumerate(sampled):
            answer = (b if n % 2 == 0 else a).feedback("alpha", result.selection_id, cited=[n % 2])
            assert answer.learned and not answer.updated  # committed, learned in the background
        b.feedback("alpha", greedy.selection_id, cited=[0])
        wait_for(lambda: b.learner("alpha").stats.step == 2)  # two batches of 2, reloaded by B
        assert not b.shared_learning.is_learner and a.shared_learning.stats.applied == 4
        assert a.learner("alpha").stats.skipped_greedy == 0  # the greedy row never reached the learner
        # the same updates, recomputed by a local learner from the stored rows in feedback order
        reference = Learner(ResidualLinearReranker(a.bank.dim), a.learner_config, encoder_name=a.encoder.fingerprint)
        for n, result in enumerate(sampled):
            reference.record(rebuild(stored[result.selection_id]), rewards_from_citations(2, [n % 2]))
        learned = b.learner("alpha").reranker.state_dict()
        for name, mine in reference.reranker.state_dict().items():
            assert torch.allclose(mine, learned[name], atol=1e-6), (name, float((mine - learned[name]).abs().max()))
        assert b.learner("alpha").reranker.version == 2
        gauges = unlabelled_gauges(a)  # what /metrics shows of the shared learning
        assert gauges["rmm_is_learner"] == 1 and gauges["rmm_feedback_applied"] == 4
        assert gauges["rmm_reranker_versions_written"] == 2 and unlabelled_gauges(b)["rmm_is_learner"] == 0
        after = retrieve(b, "Lisbon trip")
        with a.db.tx() as cur:
            assert cur.execute("SELECT version FROM selections WHERE id = %s",
                               (after.selection_id,)).fetchone()[0] == 2  # stamped with the version it used
            assert cur.execute("SELECT count(*) FROM feedback WHERE NOT learn AND applied_version IS NULL"
                               ).fetchone()[0] == 1
    finally:
        b.close()
        a.close()


def unlabelled_gauges(service: RetrievalService) -> dict[str, float]:
    return {m.name: m.samples[0].value for m in ServiceCollector(service).collect()
            if m.samples and not m.samples[0].labels}


def _row(cur, sid: str) -> PendingSelection:
    from rmm.serve.pg_pending import _COLUMNS, _from_row

    return _from_row(cur.execute(f"SELECT {_COLUMNS} FROM selections WHERE id = %s", (sid,)).fetchone())


def test_a_replica_searches_with_the_configured_database_settings(tmp_path: Path, url: str) -> None:
    a = make_replica(tmp_path, url, "a", database={"ef_search": 150, "exact_limit": 3})
    try:
        assert (a.bank.store.ef_search, a.bank.store.exact_limit) == (150, 3)
        a.add_memories("alpha", "ana", [NewMemory(text=t) for t in FACTS])  # 6 memories > exact_limit: HNSW path
        assert retrieve(a, "sourdough bread").memories
    finally:
        a.close()


def test_when_the_learner_goes_another_replica_takes_over_and_learns_what_was_left(tmp_path: Path, url: str) -> None:
    a = make_replica(tmp_path, url, "a")
    wait_for(lambda: a.shared_learning.is_learner)
    b = make_replica(tmp_path, url, "b")
    try:
        a.add_memories("alpha", "ana", [NewMemory(text=t) for t in FACTS])
        first = retrieve(b, "hiking trails")
        b.feedback("alpha", first.selection_id, cited=[0])  # half a batch: buffered by A, not applied
        wait_for(lambda: a.learner("alpha").pending == 1)
        with a.db.tx() as cur:
            assert learner_holder(cur, a.db.where.schema) == os.getpid()  # found through pg_locks
        a.shared_learning.stop()  # the learner's lock connection goes (as when its process dies)
        took = wait_for(lambda: b.shared_learning.is_learner, timeout=5.0)
        assert took < 3.0
        second = retrieve(b, "sourdough bread")
        b.feedback("alpha", second.selection_id, cited=[1])

        def applied() -> int:
            with b.db.tx() as cur:
                return int(cur.execute("SELECT count(*) FROM feedback WHERE applied_version = 1").fetchone()[0])

        wait_for(lambda: applied() == 2)  # A's half batch was re-read and learned with B's feedback
        assert b.learner("alpha").stats.step == 1 and b.shared_learning.stats.versions_written == 1
    finally:
        b.close()
        a.close()


def test_a_row_the_learner_cannot_use_is_set_aside_and_the_rest_is_learned(tmp_path: Path, url: str) -> None:
    a = make_replica(tmp_path, url, "a")
    try:
        wait_for(lambda: a.shared_learning.is_learner)
        a.add_memories("alpha", "ana", [NewMemory(text=t) for t in FACTS])
        bad = pending("bad")
        bad.tau, bad.reranker_key = -1.0, "alpha"  # a learner refuses tau <= 0
        bad.query_embedding, bad.embeddings = torch.zeros(a.bank.dim), torch.zeros(4, a.bank.dim)
        a.selections.put_many([bad])
        a.selections.claim("alpha", "bad", lambda s: {"rewards": [1.0, -1.0]})
        for query in ("hiking trails", "sourdough bread"):
            result = retrieve(a, query)
            a.feedback("alpha", result.selection_id, cited=[0])

        def settled() -> bool:
            with a.db.tx() as cur:
                return cur.execute("SELECT count(*) FROM feedback WHERE learn AND applied_version IS NULL"
                                   ).fetchone()[0] == 0

        wait_for(settled)
        assert a.learner("alpha").stats.step == 1 and a.shared_learning.is_learner  # kept the lock, kept learning
        with a.db.tx() as cur:
            assert cur.execute("SELECT learn FROM feedback WHERE selection_id = 'bad'").fetchone()[0] is False
    finally:
        a.close()


def test_a_session_ended_on_one_replica_is_reflected_once_and_its_job_is_visible_on_both(
        tmp_path: Path, url: str) -> None:
    a, b = make_replica(tmp_path, url, "a"), make_replica(tmp_path, url, "b")
    try:
        a.append_turns("alpha", "newbie", [("newbie", "I went hiking in the Alps with my sister"),
                                           ("newbie", "We also adopted a golden retriever puppy named Max")])
        job = a.end_session("alpha", "newbie")
        wait_for(lambda: b.job("alpha", job.id).status == "done", timeout=30)
        assert {m.id for m in b.memories("alpha", "newbie")} == set(b.job("alpha", job.id).result["memories"])
        with a.db.tx() as cur:
            assert cur.execute("SELECT attempts FROM jobs WHERE id = %s", (job.id,)).fetchone()[0] == 1
    finally:
        b.close()
        a.close()


def test_deleting_a_user_deletes_their_reranker_versions_when_rerankers_are_per_user(
        tmp_path: Path, url: str) -> None:
    a = make_replica(tmp_path, url, "a", reranker_per="user")
    try:
        wait_for(lambda: a.shared_learning.is_learner)
        a.add_memories("alpha", "ana", [NewMemory(text=t) for t in FACTS])
        for query in ("hiking trails", "sourdough bread"):
            a.feedback("alpha", retrieve(a, query).selection_id, cited=[0])
        wait_for(lambda: RerankerVersions(a.db).latest() == {"alpha:ana": 1})
        a.delete_user("alpha", "ana")
        assert RerankerVersions(a.db).latest() == {}
    finally:
        a.close()
