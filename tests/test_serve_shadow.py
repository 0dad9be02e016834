"""Shadow scoring and guarded promotion in `rmm serve` (issue 32 items 4–5): the shadow is judged
off-policy on the selections the serving policy sampled and logged, never on its own picks; it is
promoted only when its lower bound clears the live value with enough evidence, and a promotion is
logged, kept reversible and survives a restart. Seeded synthetic traffic through the real service
(its SQLite selection store and its feedback claim)."""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import pytest
import torch
from fakes import DIM, BagOfWordsEncoder
from fastapi.testclient import TestClient

from rmm.policy.learner import Learner
from rmm.policy.registry import SHARED
from rmm.policy.reranker import ResidualLinearReranker
from rmm.serve.app import create_app
from rmm.serve.config import load_config
from rmm.serve.selection_rows import PendingSelection
from rmm.serve.service import CHECKPOINT_DIR, RetrievalService
from rmm.serve.shadow import PREVIOUS_DIR, PROMOTIONS_FILE, PromotionRefusedError
from rmm.types import Candidates

KEYS = {"key-admin-123": "admin", "key-alpha-123": "alpha"}
K, M = 8, 3
GOOD = torch.nn.functional.normalize(torch.arange(DIM, dtype=torch.float32).sin(), dim=0)  # quality direction
Q0 = torch.nn.functional.normalize(torch.arange(DIM, dtype=torch.float32).cos(), dim=0)  # every row's query


def config(bank: Path, **shadow: object):
    return load_config(None, {"bank": str(bank), "auth.keys": KEYS, "device": "cpu", "reranker_per": "bank",
                              "learner": {"batch_size": 100_000},  # the live weights hold still in these tests
                              **({"shadow": {"admin_tenants": ["admin"], "min_selections": 200, "min_ess": 30.0,
                                             "bootstrap": 200, **shadow}} if shadow else {})}, environ={})


def service_of(bank: Path, **shadow: object) -> RetrievalService:
    service = RetrievalService(config(bank, **shadow), encoder=BagOfWordsEncoder())
    service.start()
    return service


def write_shadow(bank: Path, folder: Path, direction: float) -> None:
    """A checkpoint of the live learner's kind whose query leans `direction` × GOOD: q' = q + c·GOOD(Q0·q)."""
    service = service_of(bank)
    try:
        learner = copy.deepcopy(service.learner(SHARED))
    finally:
        service.close()
    with torch.no_grad():
        learner.reranker.W_q.weight.copy_(direction * torch.outer(GOOD, Q0))
    learner.reranker.invalidate()
    learner.save(folder)


def log_traffic(service: RetrievalService, n: int, seed: int = 0) -> None:
    """n selections sampled by the untrained (live) policy at the server's τ, stored in its selection
    store, and rewarded through `service.feedback`: a memory is cited with probability σ(8·GOOD·m)."""
    g = torch.Generator().manual_seed(seed)
    mu = ResidualLinearReranker(DIM)
    tau = service.learner_config.tau
    cands = []
    for i in range(n):
        mem = torch.nn.functional.normalize(torch.randn(K, DIM, generator=g), dim=-1)
        cands.append(Candidates(query=f"q{i}", memory_ids=[f"m{i}-{j}" for j in range(K)],
                                retriever_scores=torch.zeros(K), embeddings=mem, query_embedding=Q0.clone(),
                                user_id="alpha\x1fu"))
    sels = mu.select(cands, M, tau=tau, explore=True, generator=g)
    now = time.time()
    service.selections.put_many([
        PendingSelection(id=f"s{seed}-{i}", tenant="alpha", user_id="alpha\x1fu", reranker_key=SHARED, query=c.query,
                         memory_ids=list(c.memory_ids), chosen=list(s.chosen), explore=True,
                         query_embedding=c.query_embedding, scores=s.scores, logp=s.logp, noise=s.noise,
                         created_at=now, expires_at=now + 3600, embeddings=c.embeddings, tau=s.tau,
                         version=s.version, mask=s.mask)
        for i, (c, s) in enumerate(zip(cands, sels))])
    for i, (c, s) in enumerate(zip(cands, sels)):
        p = torch.sigmoid(8 * (c.embeddings[list(s.chosen)] @ GOOD))
        cited = [j for j in range(len(s.chosen)) if torch.rand(1, generator=g).item() < p[j].item()]
        service.feedback("alpha", f"s{seed}-{i}", cited=cited, no_cite=False) if cited else \
            service.feedback("alpha", f"s{seed}-{i}", no_cite=True)


@pytest.fixture
def shadows(tmp_path: Path) -> dict[str, Path]:
    bank = tmp_path / "bank"
    out = {"better": tmp_path / "better", "worse": tmp_path / "worse"}
    write_shadow(bank, out["better"], 2.0)
    write_shadow(bank, out["worse"], -2.0)
    return out


def test_a_better_shadow_is_promoted_logged_kept_reversible_and_survives_restart(tmp_path: Path, shadows) -> None:
    bank = tmp_path / "bank"
    service = service_of(bank, checkpoint=str(shadows["better"]))
    try:
        before = {k: v.clone() for k, v in service.learner(SHARED).reranker.state_dict().items()}
        log_traffic(service, 400)
        decision = service.shadow.decide()
        assert decision.status == "promote", decision.reason
        assert decision.selections == 400 and decision.ess >= 30
        assert decision.low > decision.live_value  # the bar it cleared, both figures reported
        shown = service.learner(SHARED).reranker.W_q.weight.clone()
        assert torch.equal(shown, before["W_q.weight"])  # judging the shadow never changed the live weights
        service.shadow.promote()
        promoted = service.learner(SHARED).reranker.W_q.weight.clone()
        assert torch.allclose(promoted, 2.0 * torch.outer(GOOD, Q0))
        on_disk = Learner.load(bank / CHECKPOINT_DIR)  # saved at once: a crash now still keeps the promotion
        assert torch.equal(on_disk.reranker.W_q.weight, promoted) and on_disk.stats.step == 1
        assert service.stats()["shadow_promotions"] == 1 and len(service.shadow) == 0  # the window restarts
    finally:
        service.close()
    (entry,) = [json.loads(line) for line in (bank / CHECKPOINT_DIR / PROMOTIONS_FILE).read_text().splitlines()]
    assert entry["promoted"] and entry["status"] == "promote" and entry["low"] == decision.low
    (previous,) = (bank / CHECKPOINT_DIR / PREVIOUS_DIR).iterdir()
    assert entry["previous"] == str(previous)
    restarted = service_of(bank)  # no shadow: the promoted weights are the live ones after a restart
    try:
        assert torch.allclose(restarted.learner(SHARED).reranker.W_q.weight, promoted)
    finally:
        restarted.close()
    reverted = service_of(bank, checkpoint=str(previous))  # the previous version, judged like any shadow
    try:
        assert torch.equal(reverted.shadow.shadow.reranker.W_q.weight, before["W_q.weight"])
        assert len(reverted.shadow) == 0  # the rows logged before the promotion judged the policy it replaced
        log_traffic(reverted, 3, seed=1)
        assert len(reverted.shadow) == 3
    finally:
        reverted.close()


def test_a_worse_shadow_is_refused_with_both_figures(tmp_path: Path, shadows) -> None:
    bank = tmp_path / "bank"
    service = service_of(bank, checkpoint=str(shadows["worse"]))
    try:
        before = service.learner(SHARED).reranker.W_q.weight.clone()
        log_traffic(service, 400)
        with pytest.raises(PromotionRefusedError) as refused:
            service.shadow.promote()
        d = refused.value.decision
        assert d.status == "keep" and d.estimate < d.live_value and d.low is not None
        assert torch.equal(service.learner(SHARED).reranker.W_q.weight, before)
        assert service.stats()["shadow_refusals"] == 1
    finally:
        service.close()
    (entry,) = [json.loads(line) for line in (bank / CHECKPOINT_DIR / PROMOTIONS_FILE).read_text().splitlines()]
    assert not entry["promoted"] and entry["live_value"] == d.live_value
    assert not (bank / CHECKPOINT_DIR / PREVIOUS_DIR).exists()


def test_too_little_data_gives_no_decision(tmp_path: Path, shadows) -> None:
    service = service_of(tmp_path / "bank", checkpoint=str(shadows["better"]))
    try:
        log_traffic(service, 50)
        d = service.shadow.decide()
        assert d.status == "insufficient" and d.estimate is None and "200 needed" in d.reason
        with pytest.raises(PromotionRefusedError):
            service.shadow.promote()
    finally:
        service.close()


def test_only_sampled_rewarded_selections_of_the_key_are_kept(tmp_path: Path, shadows) -> None:
    service = service_of(tmp_path / "bank", checkpoint=str(shadows["better"]))
    try:
        log_traffic(service, 5)
        assert len(service.shadow) == 5
        pending = service.selections  # a greedy selection claimed through the service is not a sample
        now = time.time()
        pending.put_many([PendingSelection(id="g", tenant="alpha", user_id="alpha\x1fu", reranker_key=SHARED,
                                           query="q", memory_ids=["a"], chosen=[0], explore=False,
                                           query_embedding=Q0, scores=torch.zeros(1), logp=None, noise=None,
                                           created_at=now, expires_at=now + 60, embeddings=torch.zeros(1, DIM),
                                           tau=None, version=0, mask=None)])
        service.feedback("alpha", "g", cited=[0])
        assert len(service.shadow) == 5
    finally:
        service.close()


def test_admin_routes(tmp_path: Path, shadows) -> None:
    app = create_app(config(tmp_path / "bank", checkpoint=str(shadows["worse"])), encoder=BagOfWordsEncoder())
    with TestClient(app) as client:
        admin, alpha = {"X-API-Key": "key-admin-123"}, {"X-API-Key": "key-alpha-123"}
        assert client.get("/v1/ope", headers=alpha).status_code == 403
        assert client.post("/v1/reranker/promote", headers=alpha).status_code == 403
        body = client.get("/v1/ope", headers=admin).json()
        assert body["status"] == "insufficient" and body["selections"] == 0
        refused = client.post("/v1/reranker/promote", headers=admin)
        assert refused.status_code == 409 and refused.json()["code"] == "promotion_refused"
        assert refused.json()["decision"]["status"] == "insufficient"
        assert 'rmm_reranker_promotions_total{outcome="refused"} 1.0' in client.get("/metrics").text
        assert "rmm_shadow_selections 0.0" in client.get("/metrics").text


def test_without_a_shadow_the_routes_say_so(tmp_path: Path) -> None:
    cfg = config(tmp_path / "bank")
    cfg.shadow.admin_tenants = ["admin"]
    with TestClient(create_app(cfg, encoder=BagOfWordsEncoder())) as client:
        r = client.get("/v1/ope", headers={"X-API-Key": "key-admin-123"})
        assert r.status_code == 404 and r.json()["code"] == "no_shadow"


def test_the_margin_is_part_of_the_bar(tmp_path: Path, shadows) -> None:
    service = service_of(tmp_path / "bank", checkpoint=str(shadows["better"]), margin=0.2)
    try:
        log_traffic(service, 400)
        d = service.shadow.decide()
        assert d.status == "keep" and d.low > d.live_value and d.low < d.live_value + 0.2
    finally:
        service.close()


def test_a_shadow_needs_a_key_unless_the_bank_shares_one(tmp_path: Path) -> None:
    from rmm.errors import ConfigError

    with pytest.raises(ConfigError, match="shadow.key"):
        load_config(None, {"bank": str(tmp_path), "reranker_per": "tenant", "shadow": {"checkpoint": "x"}},
                    environ={})


def test_the_window_resumes_from_the_store_after_a_restart(tmp_path: Path, shadows) -> None:
    bank = tmp_path / "bank"
    service = service_of(bank, checkpoint=str(shadows["better"]), window=300)
    try:
        log_traffic(service, 400)
        assert len(service.shadow) == 300  # the newest `window`
        first, ids = service.shadow.decide(), [r.id for r in service.shadow._rows]
    finally:
        service.close()
    again = service_of(bank, checkpoint=str(shadows["better"]), window=300)
    try:
        assert len(again.shadow) == 300
        resumed = again.shadow.decide()
        assert [r.id for r in again.shadow._rows] == ids  # the same rows, in the same order
        assert resumed.status == first.status and resumed.low == pytest.approx(first.low, abs=1e-9)
    finally:
        again.close()


# ---- replicas over PostgreSQL ----------------------------------------------------------------------
def replica(tmp_path: Path, url: str, name: str, shadow: Path | None) -> RetrievalService:
    cfg = config(tmp_path / name, **({"checkpoint": str(shadow)} if shadow else {"admin_tenants": ["admin"]}))
    cfg.store, cfg.reload_interval_s = url, 0.2
    service = RetrievalService(cfg.validate(), encoder=BagOfWordsEncoder())
    service.start()
    return service


def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_replicas_judge_every_replicas_traffic_and_promotion_is_a_version_all_load(tmp_path: Path, pg_url: str,
                                                                                   shadows) -> None:
    a = replica(tmp_path, pg_url, "a", shadows["better"])
    wait_for(lambda: a.shared_learning.is_learner)
    b = replica(tmp_path, pg_url, "b", shadows["better"])
    try:
        log_traffic(b, 400)  # claimed on B only: A reads them from the database
        assert len(b.shadow) == 400
        decision = a.shadow.decide()
        assert decision.status == "promote" and decision.selections == 400, decision.reason
        with pytest.raises(PromotionRefusedError, match="not the learner"):
            b.shadow.promote()
        step = a.learner(SHARED).stats.step
        a.shadow.promote()
        target = 2.0 * torch.outer(GOOD, Q0)
        assert a.learner(SHARED).stats.step == step + 1 and a.learners.version_of(SHARED) == step + 1
        assert torch.allclose(a.learner(SHARED).reranker.W_q.weight, target)
        wait_for(lambda: torch.allclose(b.learner(SHARED).reranker.W_q.weight, target))  # B loads the version
    finally:
        b.close()
        a.close()
    c = replica(tmp_path, pg_url, "c", None)  # a fresh replica starts from the promoted version
    try:
        assert torch.allclose(c.learner(SHARED).reranker.W_q.weight, target)
    finally:
        c.close()
