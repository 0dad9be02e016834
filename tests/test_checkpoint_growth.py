"""A checkpoint without a term the run asks for gains it at 0 (issue 14 follow-up, rmm.policy.growth).

Before, a format-4 checkpoint loaded once *without* the feature weights the run asked for, was saved as
format 5 with `feature_names: []`, and the next start refused it; likewise a pre-lexical checkpoint.
Now it gains them at 0: same ranking, the saved Adam state kept by parameter, and restarts load it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from rmm.errors import CheckpointError
from rmm.memory.features import CANDIDATE_FEATURES
from rmm.memory.hybrid import LEXICAL_DEFINITION
from rmm.policy.checkpoint import FORMAT_VERSION
from rmm.policy.learner import Learner, LearnerConfig
from rmm.policy.optimizer import FEATURE_LR_SCALE
from rmm.policy.pg_versions import learner_from_bytes, learner_to_bytes
from rmm.policy.registry import LearnerRegistry
from rmm.policy.reranker import ResidualLinearReranker
from rmm.types import Candidates

D, K, F = 6, 5, len(CANDIDATE_FEATURES)
FEATURES = tuple(CANDIDATE_FEATURES)


def featured(seed: int, k: int = K) -> Candidates:
    """Candidates carrying both the lexical feature and the candidate features."""
    g = torch.Generator().manual_seed(seed)
    return Candidates(f"q{seed}", [f"m{i}" for i in range(k)], torch.zeros(k), torch.randn(k, D, generator=g),
                      torch.randn(D, generator=g), lexical=torch.rand(k, generator=g),
                      features=torch.rand(k, F, generator=g), feature_names=FEATURES)


def trained(lexical: bool, features: tuple[str, ...] = (), steps: int = 3, pending: int = 1,
            config: LearnerConfig | None = None) -> Learner:
    """A learner `steps` Adam steps in (every parameter has moments and a step count), with `pending`
    rewarded selections left in its buffer."""
    cfg = config if config is not None else LearnerConfig(lr=0.05, tau=0.5, batch_size=2)
    learner = Learner(ResidualLinearReranker(D, lexical_feature=lexical, feature_names=features), cfg)
    g = torch.Generator().manual_seed(11)
    for i in range(steps * cfg.batch_size + pending):
        (sel,) = learner.select([featured(100 + i)], 2, generator=g)
        learner.record(sel, torch.tensor([1.0, -1.0]))
    assert learner.stats.step == steps and learner.pending == pending
    return learner


def save_as(learner: Learner, folder: Path, version: int) -> Path:
    """Save, then rewrite the meta as the given older format would have it (no checksum covers meta.json)."""
    learner.save(folder)
    meta = json.loads((folder / "meta.json").read_text())
    if version <= 4:
        del meta["feature_names"]
    if version <= 2:
        assert meta.pop("lexical_feature") is False
        meta["config"].pop("lexical_feature")
    meta["format_version"] = version
    (folder / "meta.json").write_text(json.dumps(meta))
    return folder


def by_name(learner: Learner) -> dict[str, dict[str, torch.Tensor]]:
    """The optimizer's per-parameter state keyed by parameter name."""
    params = dict(learner.reranker.named_parameters())
    return {name: learner.optimizer.state[p] for name, p in params.items() if p in learner.optimizer.state}


def groups(learner: Learner) -> list[tuple[list[str], dict]]:
    """The optimizer's groups: parameter names and every hyper-parameter."""
    name_of = {id(p): n for n, p in learner.reranker.named_parameters()}
    return [([name_of[id(p)] for p in g["params"]], {k: v for k, v in g.items() if k != "params"})
            for g in learner.optimizer.param_groups]


def assert_same_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for key, value in want.items():
        assert torch.equal(got[key], value), key


def assert_same_ranking(before: ResidualLinearReranker, after: ResidualLinearReranker) -> None:
    """Scores bit-equal on candidates carrying every feature, on the learner's and the serving paths."""
    batch = [featured(s) for s in range(4)]
    q = torch.stack([c.query_embedding for c in batch])
    m = torch.stack([c.embeddings for c in batch])
    lex = torch.stack([c.lexical for c in batch])
    x = torch.stack([c.features for c in batch])
    with torch.no_grad():
        assert torch.equal(after.policy_scores(q, m, lex, x), before.policy_scores(q, m, lex, x))
        assert torch.equal(after.fast_scores(q, m, lex, x), before.fast_scores(q, m, lex, x))
    for a, b in zip(after.select(batch, 3), before.select(batch, 3)):
        assert a.chosen == b.chosen and torch.equal(a.scores, b.scores)


@pytest.mark.parametrize("version", [4, 5])
def test_a_checkpoint_without_features_gains_them_at_zero_with_its_ranking_and_adam_state(
        tmp_path: Path, version: int, caplog: pytest.LogCaptureFixture) -> None:
    """Format 4, and format 5 with `feature_names: []` (what the bug saved): both gain the asked features."""
    old = trained(lexical=True)
    folder = save_as(old, tmp_path / "ckpt", version)
    if version == 5:
        assert json.loads((folder / "meta.json").read_text())["feature_names"] == []
    with caplog.at_level(logging.INFO, logger="rmm.policy.growth"):
        loaded = Learner.load(folder, lexical_feature=True, feature_names=FEATURES)
    gains = [r.getMessage() for r in caplog.records if r.name == "rmm.policy.growth"]
    assert len(gains) == 1 and "candidate feature weights" in gains[0] and "lexical" not in gains[0]
    assert loaded.reranker.feature_names == FEATURES and torch.equal(loaded.reranker.feature_weight, torch.zeros(F))
    assert float(loaded.reranker.lexical_weight.detach()) == float(old.reranker.lexical_weight.detach())
    assert_same_ranking(old.reranker, loaded.reranker)

    # Groups exactly as a fresh learner with features builds them; every saved parameter's state kept.
    fresh = Learner(ResidualLinearReranker(D, lexical_feature=True, feature_names=FEATURES), old.config)
    assert groups(loaded) == groups(fresh)
    assert groups(loaded)[1][0] == ["lexical_weight", "feature_weight"]
    assert groups(loaded)[1][1]["lr"] == pytest.approx(old.config.lr * FEATURE_LR_SCALE)
    saved_state, state = by_name(old), by_name(loaded)
    assert set(state) == {"W_q.weight", "W_m.weight", "lexical_weight"} == set(saved_state)
    for name in saved_state:
        assert_same_state(state[name], saved_state[name])

    # The buffered record (sampled without features) and new ones update normally; v learns.
    assert loaded.pending == 1
    g = torch.Generator().manual_seed(5)
    (sel,) = loaded.select([featured(50)], 2, generator=g)
    assert loaded.record(sel, torch.tensor([1.0, -1.0])) is not None
    assert loaded.stats.step == old.stats.step + 1 and loaded.reranker.feature_weight.abs().sum() > 0
    state = by_name(loaded)
    assert float(state["W_q.weight"]["step"]) == old.stats.step + 1 and float(state["feature_weight"]["step"]) == 1

    # The next save is format 5 with the names; two restarts load it as saved.
    loaded.save(folder)
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["format_version"] == FORMAT_VERSION and meta["feature_names"] == list(FEATURES)
    for _ in range(2):
        again = Learner.load(folder, lexical_feature=True, feature_names=FEATURES)
        assert torch.equal(again.reranker.feature_weight, loaded.reranker.feature_weight)
        assert_same_state(by_name(again)["feature_weight"], by_name(loaded)["feature_weight"])
        again.save(folder)


def test_saved_adam_state_follows_its_parameter_when_a_gained_weight_lands_before_it(tmp_path: Path) -> None:
    """Features without the lexical weight, then asked for it: the lexical weight goes *before* the
    feature weights in their group, so by position the feature weights' moments would land on it."""
    old = trained(lexical=False, features=FEATURES)
    folder = save_as(old, tmp_path / "ckpt", 5)
    loaded = Learner.load(folder, lexical_feature=True, feature_names=FEATURES)
    assert float(loaded.reranker.lexical_weight.detach()) == 0.0  # not LEXICAL_INIT: the ranking stays
    assert_same_ranking(old.reranker, loaded.reranker)
    assert groups(loaded)[1][0] == ["lexical_weight", "feature_weight"]
    state = by_name(loaded)
    assert "lexical_weight" not in state
    assert_same_state(state["feature_weight"], by_name(old)["feature_weight"])
    (sel,) = loaded.select([featured(60)], 2, generator=torch.Generator().manual_seed(1))
    assert loaded.record(sel, torch.tensor([-1.0, 1.0])) is not None
    assert float(loaded.reranker.lexical_weight.detach()) != 0.0  # it learns


def test_a_pre_lexical_checkpoint_gains_the_lexical_weight_at_zero_and_restarts(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    old = trained(lexical=False)
    folder = save_as(old, tmp_path / "ckpt", 2)
    with caplog.at_level(logging.INFO, logger="rmm.policy.growth"):
        loaded = Learner.load(folder, lexical_feature=True, feature_names=())
    gains = [r.getMessage() for r in caplog.records if r.name == "rmm.policy.growth"]
    assert len(gains) == 1 and "the lexical weight" in gains[0] and "feature" not in gains[0]
    assert float(loaded.reranker.lexical_weight.detach()) == 0.0 and loaded.reranker.feature_weight is None
    assert_same_ranking(old.reranker, loaded.reranker)
    assert groups(loaded) == groups(Learner(ResidualLinearReranker(D, lexical_feature=True), old.config))
    assert set(by_name(loaded)) == {"W_q.weight", "W_m.weight"}
    for name, saved in by_name(old).items():
        assert_same_state(by_name(loaded)[name], saved)
    loaded.save(folder)  # no update since loading: the gained weight learned on no feature yet, today's label
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["lexical_feature"] is True and meta["lexical_definition"] == LEXICAL_DEFINITION
    for _ in range(2):
        again = Learner.load(folder, lexical_feature=True, feature_names=())
        assert again.pending == 1 and float(again.reranker.lexical_weight.detach()) == 0.0
        again.save(folder)


def test_both_terms_gained_at_once_through_the_registry_and_two_restarts(tmp_path: Path) -> None:
    """The server's path: a format-2 checkpoint under a registry whose config asks for both terms."""
    old = trained(lexical=False)
    root = tmp_path / "reg"
    config = LearnerConfig()
    assert config.lexical_feature and config.candidate_features
    save_as(old, LearnerRegistry(D, config, root=root).path("alice"), 2)
    for restart in range(3):
        registry = LearnerRegistry(D, config, root=root)
        learner = registry.get("alice")
        assert learner.reranker.lexical_feature and learner.reranker.feature_names == FEATURES
        if restart == 0:
            assert_same_ranking(old.reranker, learner.reranker)
            assert torch.equal(learner.reranker.W_q.weight, old.reranker.W_q.weight)
        (sel,) = learner.select([featured(70 + restart)], 2, generator=torch.Generator().manual_seed(restart))
        learner.record(sel, torch.tensor([1.0, -1.0]))
        assert registry.save("alice") == 1
    meta = json.loads((registry.path("alice") / "meta.json").read_text())
    assert meta["feature_names"] == list(FEATURES) and meta["lexical_feature"] is True


def test_stored_versions_bytes_gain_the_terms_and_reload(tmp_path: Path) -> None:
    """`pg_versions`' bytes go through the same load: a format-4 row gains features; its next row loads."""
    old = trained(lexical=True)
    folder = save_as(old, tmp_path / "ckpt", 4)
    from rmm.policy.checkpoint import pack_checkpoint

    learner = learner_from_bytes(pack_checkpoint(folder), encoder_name=None, dim=D, lexical_feature=True,
                                 feature_names=FEATURES)
    assert learner.reranker.feature_names == FEATURES
    again = learner_from_bytes(learner_to_bytes(learner), encoder_name=None, dim=D, lexical_feature=True,
                               feature_names=FEATURES)
    assert torch.equal(again.reranker.W_m.weight, old.reranker.W_m.weight) and again.pending == 1


def test_stored_versions_in_postgresql_gain_the_features_and_reload(tmp_path: Path, pg_url: str) -> None:
    from rmm.memory.pg_database import PgDatabase
    from rmm.policy.checkpoint import pack_checkpoint
    from rmm.policy.pg_versions import RerankerVersions

    old = trained(lexical=True)
    data = pack_checkpoint(save_as(old, tmp_path / "ckpt", 4))
    db = PgDatabase(pg_url)
    try:
        versions = RerankerVersions(db)
        with db.tx() as cur:
            versions.write(cur, "alpha", old.stats.step, data)
        learner = LearnerRegistry(D, LearnerConfig(), versions=versions).get("alpha")
        assert learner.reranker.feature_names == FEATURES
        with db.tx() as cur:
            versions.write(cur, "alpha", old.stats.step + 1, learner_to_bytes(learner))
        again = LearnerRegistry(D, LearnerConfig(), versions=versions).get("alpha")
        assert again.reranker.feature_names == FEATURES and again.stats.step == old.stats.step
    finally:
        db.close()


def test_a_checkpoint_with_a_term_the_run_does_not_ask_for_is_still_refused(tmp_path: Path) -> None:
    """Dropping learned weights would silently change the ranking: one line, nothing written."""
    folder = trained(lexical=True, features=FEATURES).save(tmp_path / "ckpt")
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    for asked in ((), FEATURES[:3], FEATURES[::-1]):
        with pytest.raises(CheckpointError, match="weighs candidate features") as error:
            Learner.load(folder, lexical_feature=True, feature_names=asked)
        assert "\n" not in str(error.value)
    with pytest.raises(CheckpointError, match="trained with the lexical feature") as error:
        Learner.load(folder, lexical_feature=False, feature_names=FEATURES)
    assert "\n" not in str(error.value)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    as_saved = Learner.load(folder)  # nothing asked: as saved
    assert as_saved.reranker.lexical_feature and as_saved.reranker.feature_names == FEATURES


def test_a_checkpoint_missing_a_weight_its_meta_states_is_corrupt_not_grown(tmp_path: Path) -> None:
    """Growth fills only terms the meta says the checkpoint lacks; a stated weight absent from the file is refused."""
    folder = trained(lexical=True).save(tmp_path / "ckpt")
    meta = json.loads((folder / "meta.json").read_text())
    (folder / "meta.json").write_text(json.dumps({**meta, "feature_names": list(FEATURES)}))
    with pytest.raises(CheckpointError, match="feature_weight"):
        Learner.load(folder, lexical_feature=True, feature_names=FEATURES)


def test_the_server_restarts_twice_on_a_format_4_checkpoint(tmp_path: Path) -> None:
    """The reported bug's path: every existing serve bank holds format-4 checkpoints; a restart, feedback,
    a checkpoint at close, and the *second* restart must load what the first saved."""
    from test_serve_service import FACTS, item, make_service

    from rmm.serve.records import NewMemory, RetrieveResult

    service = make_service(tmp_path, learner={"batch_size": 1})
    try:
        service.add_memories("alpha", "ana", [NewMemory(text=t) for t in FACTS])
        asked = service.learner("alpha")
        path = service.learners.path("alpha")
    finally:
        service.close()
    assert asked.reranker.feature_names == FEATURES and path is not None
    old = Learner(ResidualLinearReranker(asked.dim, lexical_feature=True), asked.config,
                  encoder_name=asked.encoder_name)
    save_as(old, path, 4)
    for restart in range(3):
        service = make_service(tmp_path, learner={"batch_size": 1})
        try:
            learner = service.learner("alpha")
            assert learner.reranker.feature_names == FEATURES and learner.stats.step == restart
            (result,) = service.retrieve_batch([item("ana", "sourdough bread on Sundays", k=5, explore=True)])
            assert isinstance(result, RetrieveResult), result
            assert service.feedback("alpha", result.selection_id, cited=[0]).learned
        finally:
            service.close()  # checkpoints the learner
        meta = json.loads((path / "meta.json").read_text())
        assert meta["format_version"] == FORMAT_VERSION and meta["feature_names"] == list(FEATURES)
