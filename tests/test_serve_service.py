"""The server's core without HTTP: tenants, batched retrieval, feedback → learner, durability."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from fakes import BagOfWordsEncoder

from rmm.errors import UnknownUserError
from rmm.reflection import EXTRACTIVE_LABEL
from rmm.serve.config import load_config
from rmm.serve.errors import (
    BadRequestError,
    NoOpenSessionError,
    SelectionExpiredError,
    SelectionUsedError,
    UnknownJobError,
    UnknownSelectionError,
)
from rmm.serve.records import NewMemory, RetrieveItem, RetrieveResult
from rmm.serve.service import RetrievalService

KEYS = {"key-alpha-123": "alpha", "key-beta-4567": "beta"}
FACTS = ["Ana hikes mountain trails every weekend", "Ana bakes sourdough bread on Sundays",
         "Ana plays cello in a community orchestra", "Ana adopted a golden retriever puppy",
         "Ana works as a nurse at the city hospital", "Ana booked a summer trip to Lisbon"]


def make_service(tmp_path: Path, start: bool = True, **overrides) -> RetrievalService:
    config = load_config(None, {"bank": str(tmp_path / "bank"), "auth.keys": KEYS, "device": "cpu", **overrides},
                         environ={})
    service = RetrievalService(config, encoder=BagOfWordsEncoder())
    if start:
        service.start()
    return service


@pytest.fixture
def service(tmp_path: Path):
    s = make_service(tmp_path, learner={"batch_size": 2})
    s.add_memories("alpha", "ana", [NewMemory(text=t) for t in FACTS])
    yield s
    s.close()


def item(user: str, query: str, tenant: str = "alpha", k: int = 20, m: int = 3, explore: bool = False) -> RetrieveItem:
    return RetrieveItem(tenant=tenant, user=user, query=query, k=k, m=m, explore=explore)


def one(service: RetrievalService, *args, **kwargs) -> RetrieveResult:
    (result,) = service.retrieve_batch([item(*args, **kwargs)])
    assert isinstance(result, RetrieveResult), result
    return result


def wait_job(service: RetrievalService, tenant: str, job_id: str, timeout: float = 15.0):
    deadline = time.monotonic() + timeout
    while True:
        job = service.job(tenant, job_id)
        if job.status in ("done", "failed", "cancelled") or time.monotonic() > deadline:
            return job
        time.sleep(0.02)


# ---- tenants ------------------------------------------------------------------------------------
def test_tenants_with_the_same_user_name_never_see_each_other(service: RetrievalService) -> None:
    service.add_memories("beta", "ana", [NewMemory(text="Beta's Ana collects vintage typewriters")])
    alpha = one(service, "ana", "typewriters sourdough", tenant="alpha")
    beta = one(service, "ana", "typewriters sourdough", tenant="beta")
    assert "typewriters" not in " ".join(m.text for m in alpha.memories)
    assert [m.text for m in beta.memories] == ["Beta's Ana collects vintage typewriters"]
    assert service.users("alpha") == ["ana"] and service.users("beta") == ["ana"]
    service.add_memories("alpha", "carl", [NewMemory(text="Carl fixes bicycles")])
    with pytest.raises(UnknownUserError):
        service.memories("beta", "carl")
    with pytest.raises(UnknownUserError):
        service.delete_user("beta", "carl")
    assert [m.text for m in service.memories("alpha", "carl")] == ["Carl fixes bicycles"]


# ---- batched retrieval --------------------------------------------------------------------------
def test_a_batch_is_one_encoder_call_across_users_and_tenants(service: RetrievalService) -> None:
    service.add_memories("beta", "bob", [NewMemory(text="Bob repairs old radios"), NewMemory(text="Bob grows tomatoes")])
    calls = service.encoder.query_calls
    results = service.retrieve_batch([
        item("ana", "mountain trails hikes"), item("bob", "radios repair", tenant="beta"),
        item("ana", "which sourdough bread"), item("ghost", "anything"), item("bob", "tomatoes", tenant="beta"),
    ])
    assert service.encoder.query_calls == calls + 1
    assert "hikes" in results[0].memories[0].text
    assert "radios" in results[1].memories[0].text
    assert "sourdough" in results[2].memories[0].text
    assert isinstance(results[3], UnknownUserError) and "ghost" in str(results[3])
    assert "tomatoes" in results[4].memories[0].text


def test_per_query_k_and_m_and_greedy_order(service: RetrievalService) -> None:
    small, large = service.retrieve_batch([item("ana", "cello orchestra", k=3, m=2), item("ana", "cello", k=6, m=5)])
    assert len(small.memories) == 2 and len(large.memories) == 5
    assert [m.index for m in large.memories] == list(range(5))
    scores = [m.score for m in large.memories]
    assert scores == sorted(scores, reverse=True)  # greedy: the top-M in score order
    assert "cello" in small.memories[0].text


def test_exploring_samples_and_user_without_memories_gets_nothing(service: RetrievalService) -> None:
    seen = {tuple(m.id for m in one(service, "ana", "weekend", m=3, explore=True).memories) for _ in range(12)}
    assert len(seen) > 1  # Gumbel sampling varies the shown set
    service.add_memories("alpha", "zoe", [NewMemory(text="Zoe swims", id="z1")])
    service.delete_memory("alpha", "zoe", "z1")
    empty = one(service, "zoe", "swimming")
    assert empty.memories == [] and empty.selection_id is None


def test_bank_scope_searches_with_the_learned_query(tmp_path: Path) -> None:
    """scope: bank with a learned (non-identity) A: q·A brings a memory that q's own top-k lacks
    into the candidates, and every candidate is scored on q's features, not q·A's (issue 35)."""
    from test_serve_hybrid import capture_selections

    service = make_service(tmp_path, scope="bank", retriever="hybrid")
    try:
        service.add_memories("alpha", "ana", [NewMemory(text=t, id=f"f{i}") for i, t in enumerate(FACTS)])
        query = "cello orchestra"
        q, target = service.encoder.encode_queries([query])[0], service.encoder.encode_passages([FACTS[1]])[0]
        reranker = service.learner("alpha").reranker
        with torch.no_grad():  # q·A = the sourdough memory's vector
            reranker.W_q.weight.copy_(torch.outer(target - q, q) / q.dot(q))
        sampled = capture_selections(service)
        one(service, "ana", query, k=2, m=2)
        (alone,) = service.retriever.first_stage.search([query], "alpha:ana", 2)
        (everything,) = service.retriever.first_stage.search([query], "alpha:ana", len(FACTS))
        (chosen,) = [s.candidates for s in sampled]
        assert "f1" in chosen.memory_ids and "f1" not in alone.memory_ids  # chosen by q·A
        assert torch.allclose(chosen.query_embedding, q)
        rows = {m: everything.features[i] for i, m in enumerate(everything.memory_ids)}
        for i, m in enumerate(chosen.memory_ids):  # the features q gives these memories
            assert torch.allclose(chosen.features[i], rows[m], atol=1e-6), m
    finally:
        service.close()


def test_a_bfloat16_int8_or_int4_index_retrieves_what_float32_does(tmp_path: Path) -> None:
    ranked = {}
    for precision in ("float32", "bfloat16", "int8", "int4"):
        service = make_service(tmp_path / precision, index_precision=precision)
        try:
            service.add_memories("alpha", "ana", [NewMemory(text=t) for t in FACTS])
            assert service.bank.index_options == ({} if precision == "float32" else {"precision": precision})
            queries = ("sourdough bread every weekend trails", "cello orchestra at the hospital")
            ranked[precision] = [[(m.text, round(m.retriever_score, 5)) for m in shown.memories
                                  if m.retriever_score > 0.01]  # the matches; the rest tie near 0
                                 for shown in (one(service, "ana", q, k=3, m=3) for q in queries)]
        finally:
            service.close()
    assert ranked["bfloat16"] == ranked["float32"] == ranked["int8"] == ranked["int4"]
    assert all(matches for matches in ranked["float32"])  # something matched: the comparison has content


# ---- feedback → learner -------------------------------------------------------------------------
def test_feedback_feeds_the_learner_and_a_full_batch_moves_the_weights(service: RetrievalService) -> None:
    first, second = (one(service, "ana", q, explore=True) for q in ("hiking trails", "sourdough bread"))
    learner = service.learner("alpha")
    before = learner.reranker.W_q.weight.detach().clone()
    r1 = service.feedback("alpha", first.selection_id, cited=[0])
    assert r1.rewards == [1.0, -1.0, -1.0] and not r1.updated
    assert learner.stats.records == 1 and learner.pending == 1
    assert torch.equal(learner.reranker.W_q.weight, before)
    r2 = service.feedback("alpha", second.selection_id, text="She bakes sourdough. [1, 2]")
    assert r2.cited == [1, 2] and r2.rewards == [-1.0, 1.0, 1.0]
    assert r2.updated and r2.learner_step == 1 and learner.stats.step == 1
    assert not torch.equal(learner.reranker.W_q.weight, before)
    assert service.learner_updates == 1


def test_feedback_variants_and_refusals(service: RetrievalService) -> None:
    a, b, c = (one(service, "ana", q) for q in ("cello", "puppy", "Lisbon"))
    with pytest.raises(BadRequestError, match="outside the 3 memories shown"):
        service.feedback("alpha", a.selection_id, cited=[7])
    with pytest.raises(BadRequestError, match="exactly one of"):
        service.feedback("alpha", a.selection_id, cited=[0], text="[0]")
    assert service.feedback("alpha", a.selection_id, cited=[2]).rewards == [-1.0, -1.0, 1.0]  # still usable
    with pytest.raises(SelectionUsedError, match="already received feedback"):
        service.feedback("alpha", a.selection_id, cited=[0])
    assert service.feedback("alpha", b.selection_id, no_cite=True).rewards == [-1.0] * 3
    skipped = service.feedback("alpha", c.selection_id, text="I am not sure what you mean.")
    assert skipped.rewards is None and service.learner("alpha").stats.skipped_no_citation == 1


def test_another_tenants_selection_is_unknown_and_old_ones_expire(tmp_path: Path) -> None:
    service = make_service(tmp_path, selection_ttl_s=0.3)
    try:
        service.add_memories("alpha", "ana", [NewMemory(text=t) for t in FACTS])
        result = one(service, "ana", "hiking")
        with pytest.raises(UnknownSelectionError):
            service.feedback("beta", result.selection_id, cited=[0])
        with pytest.raises(UnknownSelectionError):
            service.feedback("alpha", "no-such-selection", cited=[0])
        time.sleep(0.4)
        with pytest.raises(SelectionExpiredError, match="expired .* selection_ttl_s"):
            service.feedback("alpha", result.selection_id, cited=[0])
        assert service.selections.count_pending() == 0
        assert service.selections.sweep(now=time.time() + 1) == 1  # purged after one more TTL
        with pytest.raises(UnknownSelectionError):
            service.feedback("alpha", result.selection_id, cited=[0])
    finally:
        service.close()


# ---- deletes ------------------------------------------------------------------------------------
def test_delete_user_removes_memories_index_and_pending_selections(service: RetrievalService) -> None:
    selection = one(service, "ana", "hiking")
    service.append_turns("alpha", "ana", [("ana", "I like tea")])
    counts = service.delete_user("alpha", "ana")
    assert counts == {"memories": len(FACTS), "selections": 1, "session_turns": 1, "jobs_cancelled": 0}
    assert service.users("alpha") == []
    with pytest.raises(UnknownSelectionError):
        service.feedback("alpha", selection.selection_id, cited=[0])
    assert isinstance(service.retrieve_batch([item("ana", "hiking")])[0], UnknownUserError)
    with pytest.raises(UnknownUserError):
        service.delete_user("alpha", "ana")


def test_delete_memory_keeps_the_selections_that_showed_it_learnable(service: RetrievalService) -> None:
    shown = one(service, "ana", "sourdough bread", k=2, m=1, explore=True)
    other = one(service, "ana", "golden retriever puppy", k=1, m=1, explore=True)
    assert service.delete_memory("alpha", "ana", shown.memories[0].id) == 0  # nothing invalidated any more
    learned = service.feedback("alpha", shown.selection_id, cited=[0])
    assert learned.learned and learned.rewards == [1.0] and learned.learner_records == 1
    assert service.feedback("alpha", other.selection_id, cited=[0]).rewards == [1.0]
    assert shown.memories[0].id not in [m.id for m in service.memories("alpha", "ana")]
    again = one(service, "ana", "sourdough bread", k=len(FACTS), m=len(FACTS) - 1)
    assert shown.memories[0].id not in [m.id for m in again.memories]


def _capture_records(service: RetrievalService) -> list:
    """The Selections the tenant's learner is given, in order (its `record` still runs)."""
    learner = service.learner("alpha")
    seen: list = []
    original = learner.record

    def record(selection, rewards):
        seen.append(selection)
        return original(selection, rewards)

    learner.record = record  # type: ignore[method-assign]
    return seen


def test_feedback_after_a_memory_delete_and_a_restart_learns_the_update_as_sampled(tmp_path: Path) -> None:
    """The selection is rebuilt from its stored row only: the deleted memory's vector, τ and the
    weights version come back as they were at sampling time, and the step equals the one taken
    by a server that neither restarted nor deleted anything."""
    learner = {"batch_size": 1, "tau": 0.7}
    runs = {}
    for name, disrupt in (("plain", False), ("disrupted", True)):
        service = make_service(tmp_path / name, learner=learner)
        service.add_memories("alpha", "ana", [NewMemory(text=t, id=f"f{i}") for i, t in enumerate(FACTS)])
        result = one(service, "ana", "sourdough bread weekend", k=len(FACTS), m=3, explore=True)
        sampled = service.bank.embeddings("alpha:ana", [f"f{i}" for i in range(len(FACTS))])
        if disrupt:
            assert service.delete_memory("alpha", "ana", result.memories[0].id) == 0
            service.close()
            service = make_service(tmp_path / name, learner=learner)
        seen = _capture_records(service)
        try:
            answer = service.feedback("alpha", result.selection_id, cited=[0])
            assert answer.learned and answer.updated and answer.reason is None
            (selection,) = seen
            order = [int(i[1:]) for i in selection.candidates.memory_ids]
            assert torch.equal(selection.candidates.embeddings, sampled[order])  # as scored, deleted one included
            assert selection.tau == pytest.approx(0.7) and selection.version == 0 and selection.explore
            assert [selection.candidates.memory_ids[i] for i in selection.chosen] == [m.id for m in result.memories]
            runs[name] = (result.memories, service.learner("alpha").reranker.state_dict())
        finally:
            service.close()
    assert [m.id for m in runs["plain"][0]] == [m.id for m in runs["disrupted"][0]]  # same seed, same sample
    for key, weight in runs["plain"][1].items():
        assert torch.equal(weight, runs["disrupted"][1][key]), key


def test_greedy_feedback_is_stored_and_answered_but_not_learned(service: RetrievalService) -> None:
    greedy = one(service, "ana", "cello orchestra", explore=False)
    answer = service.feedback("alpha", greedy.selection_id, cited=[0])
    assert not answer.learned and answer.reason is not None and "greedy selection (explore=false)" in answer.reason
    assert answer.rewards == [1.0, -1.0, -1.0] and answer.cited == [0] and not answer.updated
    learner = service.learner("alpha")
    assert learner.stats.records == 0 and learner.stats.skipped_greedy == 1 and learner.pending == 0
    stored = service.selections.feedback_of("alpha", greedy.selection_id)
    assert stored is not None and stored["cited"] == [0] and stored["learned"] is False
    with pytest.raises(SelectionUsedError):  # stored means used: it cannot be sent again as a sample
        service.feedback("alpha", greedy.selection_id, cited=[1])
    sampled = one(service, "ana", "cello orchestra", explore=True)
    assert service.feedback("alpha", sampled.selection_id, cited=[0]).learned
    assert service.selections.feedback_of("alpha", sampled.selection_id)["learned"] is True
    uncited = one(service, "ana", "puppy", explore=True)
    skipped = service.feedback("alpha", uncited.selection_id, text="no idea")
    assert not skipped.learned and "no parseable citation" in (skipped.reason or "")


# ---- sessions and reflection --------------------------------------------------------------------
def test_end_session_reflects_in_the_background_into_topic_memories(service: RetrievalService) -> None:
    with pytest.raises(NoOpenSessionError):
        service.end_session("alpha", "newbie")
    service.append_turns("alpha", "newbie", [("newbie", "I went hiking in the Alps with my sister"),
                                             ("assistant", "That sounds lovely!"),
                                             ("newbie", "We also adopted a golden retriever puppy named Max")])
    job = service.end_session("alpha", "newbie")
    assert job.status == "queued"
    with pytest.raises(UnknownJobError):
        service.job("beta", job.id)
    done = wait_job(service, "alpha", job.id)
    assert done.status == "done", done.error
    assert done.result["method"].startswith("fallback") and done.result["speakers"] == ["newbie"]
    topics = service.memories("alpha", "newbie")
    assert topics and all(m.kind == "topic" and EXTRACTIVE_LABEL in m.source_text for m in topics)
    assert "That sounds lovely" not in " ".join(m.text for m in topics)
    assert {m.id for m in topics} == set(done.result["memories"])
    assert service.sessions.current("alpha:newbie").turns == []  # the next turns open a new session


def test_a_whole_session_with_stored_turns(service: RetrievalService) -> None:
    from rmm.types import Turn

    turns = [Turn(id="", session_id="", speaker="kim", text="I play the cello in an orchestra"),
             Turn(id="", session_id="", speaker="kim", text="Our next concert is in Lisbon")]
    job = service.add_session("alpha", "kim", turns, session_id="kim-s1", store_turns=True)
    done = wait_job(service, "alpha", job.id)
    assert done.status == "done", done.error
    assert done.result["turn_memories"] == ["kim-s1:0", "kim-s1:1"]
    kinds = sorted(m.kind for m in service.memories("alpha", "kim"))
    assert kinds.count("turn") == 2 and "topic" in kinds


# ---- durability across restarts ----------------------------------------------------------------
def test_checkpoint_on_close_and_reload_on_restart(tmp_path: Path) -> None:
    service = make_service(tmp_path, learner={"batch_size": 1})
    service.add_memories("alpha", "ana", [NewMemory(text=t) for t in FACTS])
    service.feedback("alpha", one(service, "ana", "hiking", explore=True).selection_id, cited=[0])
    pending = one(service, "ana", "sourdough bread", explore=True)  # left waiting for feedback across the restart
    weights = service.learner("alpha").reranker.W_q.weight.detach().clone()
    assert service.learner("alpha").stats.step == 1
    service.close()
    assert (tmp_path / "bank" / "reranker" / "tenants" / "alpha-be76331b95" / "meta.json").exists()

    again = make_service(tmp_path, learner={"batch_size": 1})
    try:
        learner = again.learner("alpha")
        assert learner.stats.step == 1 and torch.equal(learner.reranker.W_q.weight, weights)
        result = again.feedback("alpha", pending.selection_id, cited=[0])
        assert result.updated and result.learner_step == 2
        assert [m.text for m in again.memories("alpha", "ana")] == FACTS
    finally:
        again.close()


def test_periodic_checkpoints(tmp_path: Path) -> None:
    service = make_service(tmp_path, learner={"batch_size": 1}, checkpoint_interval_s=0.1)
    try:
        service.add_memories("alpha", "ana", [NewMemory(text=t) for t in FACTS])
        service.feedback("alpha", one(service, "ana", "hiking", explore=True).selection_id, cited=[0])
        meta = tmp_path / "bank" / "reranker" / "tenants" / "alpha-be76331b95" / "meta.json"
        deadline = time.monotonic() + 5
        while not meta.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert meta.exists()
        assert service.checkpoint() == 0  # nothing new since the periodic save
    finally:
        service.close()


def test_queued_reflection_jobs_resume_after_a_restart(tmp_path: Path) -> None:
    service = make_service(tmp_path, start=False)  # no worker: the job stays queued
    service.append_turns("alpha", "ana", [("ana", "I bake sourdough bread every Sunday morning")])
    job = service.end_session("alpha", "ana")
    service.close()
    again = make_service(tmp_path)
    try:
        done = wait_job(again, "alpha", job.id)
        assert done.status == "done", done.error
        assert again.memories("alpha", "ana")
    finally:
        again.close()


def test_one_reranker_per_user_and_deleting_the_user_deletes_it(tmp_path: Path) -> None:
    service = make_service(tmp_path, reranker_per="user", learner={"batch_size": 1})
    try:
        for user in ("ana", "bob"):
            service.add_memories("alpha", user, [NewMemory(text=t) for t in FACTS])
        service.feedback("alpha", one(service, "ana", "hiking", explore=True).selection_id, cited=[0])
        assert service.learner("alpha:ana").stats.step == 1
        assert service.learner("alpha:bob").stats.step == 0
        service.checkpoint()
        folder = service.learners.path("alpha:ana")
        assert (folder / "meta.json").exists()
        service.delete_user("alpha", "ana")
        assert not folder.exists()
    finally:
        service.close()


@pytest.mark.parametrize(("per", "folder"), [("user", "users/alpha_ana-d7ded1ee97"),
                                             ("tenant", "tenants/alpha-be76331b95")])
def test_checkpoint_folders_keep_their_layout_so_existing_checkpoints_load(tmp_path: Path, per: str,
                                                                           folder: str) -> None:
    key = "alpha:ana" if per == "user" else "alpha"
    service = make_service(tmp_path, reranker_per=per, learner={"batch_size": 1})
    try:
        service.add_memories("alpha", "ana", [NewMemory(text=t) for t in FACTS])
        service.feedback("alpha", one(service, "ana", "hiking", explore=True).selection_id, cited=[0])
    finally:
        service.close()
    assert (tmp_path / "bank" / "reranker" / folder / "meta.json").exists()
    assert not (tmp_path / "bank" / "reranker" / "meta.json").exists()  # nothing learned by a shared one
    again = make_service(tmp_path, reranker_per=per)
    try:
        assert again.learner(key).stats.step == 1
    finally:
        again.close()


def test_a_database_store_that_is_not_postgresql_is_a_config_error_not_an_assert(tmp_path: Path, monkeypatch) -> None:
    """The check survives `python -O` (an assert would vanish) and closes the bank it opened."""
    from rmm.errors import ConfigError
    from rmm.memory.bank import MemoryBank
    from rmm.serve import service as service_module

    opened: list[MemoryBank] = []

    def folder_bank(location, encoder, **options):  # a store that is not a PostgresStore
        opened.append(MemoryBank(tmp_path / "folder", encoder, index_backend=options["index_backend"]))
        return opened[-1]

    monkeypatch.setattr(service_module, "MemoryBank", folder_bank)
    config = load_config(None, {"bank": str(tmp_path / "bank"), "auth.keys": KEYS, "device": "cpu",
                                "store": "postgresql://u:secret@h/db"}, environ={})
    with pytest.raises(ConfigError, match="opened as MemoryStore, not a PostgresStore") as caught:
        RetrievalService(config, encoder=BagOfWordsEncoder())
    assert "secret" not in str(caught.value)
    (bank,) = opened
    assert bank._closed
