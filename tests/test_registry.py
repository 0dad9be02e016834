"""The learner registry: one learner per key, loaded or fresh, saved when changed, kept apart on disk."""

from __future__ import annotations

import hashlib
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch

import rmm.policy.registry as registry_module
from rmm.errors import DimensionMismatchError, EncoderMismatchError
from rmm.policy.learner import Learner, LearnerConfig
from rmm.policy.registry import SHARED, LearnerRegistry
from rmm.policy.reranker import LEXICAL_INIT, ResidualLinearReranker
from rmm.types import Candidates

D, K, M = 8, 6, 2
CONFIG = LearnerConfig(batch_size=2, lr=0.05)


def registry(root: Path | None, **kw: object) -> LearnerRegistry:
    return LearnerRegistry(D, CONFIG, encoder_name="toy-enc", root=root, **kw)  # type: ignore[arg-type]


def teach(learner: Learner, n: int, seed: int = 0) -> None:
    """`n` rewarded selections: the first shown memory cited, the others not."""
    g = torch.Generator().manual_seed(seed)
    for i in range(n):
        q, mem = torch.randn(D, generator=g), torch.randn(K, D, generator=g)
        cand = Candidates(f"q{i}", [f"m{j}" for j in range(K)], mem @ q, mem, q)
        sel = learner.reranker.select([cand], M, tau=CONFIG.tau, explore=True, generator=g)[0]
        learner.record(sel, torch.tensor([1.0] + [-1.0] * (M - 1)))


def weights(learner: Learner) -> list[torch.Tensor]:
    return [p.detach().clone() for p in learner.reranker.parameters()]


def untrained(learner: Learner) -> bool:
    """The residual maps are zero (Eq. 1 starts at the retriever's order) and the lexical weight, if
    any, is at its starting value."""
    reranker = learner.reranker
    residual_zero = all(not p.any() for name, p in reranker.named_parameters() if name != "lexical_weight")
    lexical = reranker.lexical_weight
    return residual_zero and (lexical is None or torch.equal(lexical.detach(), torch.tensor(LEXICAL_INIT)))


def user_folder(root: Path, key: str, subdir: str = "users") -> Path:
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in key)[:48]
    return root / subdir / f"{safe}-{hashlib.sha1(key.encode()).hexdigest()[:10]}"


# ---- fresh, loaded, isolated -------------------------------------------------------------------
def test_fresh_learner_then_the_saved_one_is_loaded(tmp_path: Path) -> None:
    first = registry(tmp_path / "ck")
    fresh = first.get("alice")
    assert fresh.stats.records == 0 and fresh.encoder_name == "toy-enc" and fresh.config == CONFIG
    assert untrained(fresh)  # zero-initialised residual: the retriever's order
    teach(fresh, 5)  # two updates, one record pending
    assert first.save() == 1

    second = registry(tmp_path / "ck")
    loaded = second.get("alice")
    assert loaded is not fresh
    assert loaded.stats == fresh.stats and loaded.pending == 1
    assert all(torch.equal(a, b) for a, b in zip(weights(fresh), weights(loaded)))
    assert second.get("bob").stats.records == 0  # no checkpoint: fresh


def test_keys_are_isolated(tmp_path: Path) -> None:
    reg = registry(tmp_path / "ck")
    a, b = reg.get("a"), reg.get("b")
    assert a is reg.get("a") and a is not b and a.reranker is not b.reranker
    teach(a, 4)
    assert a.stats.step == 2
    assert b.stats.records == 0 and untrained(b)
    assert list(reg) == ["a", "b"] and len(reg) == 2 and "a" in reg and "c" not in reg


def test_loading_refuses_another_encoder(tmp_path: Path) -> None:
    reg = registry(tmp_path / "ck")
    teach(reg.get("a"), 2)
    reg.save()
    other = LearnerRegistry(D, CONFIG, encoder_name="other-enc", root=tmp_path / "ck")
    with pytest.raises(EncoderMismatchError):
        other.get("a")
    with pytest.raises(DimensionMismatchError):
        other.put("x", Learner(ResidualLinearReranker(D + 1)))


# ---- saving -------------------------------------------------------------------------------------
def test_save_only_changed_writes_only_learners_that_learned(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    reg = registry(root)
    a, b = reg.get("a"), reg.get("b")
    assert reg.save() == 0  # nothing learned yet: nothing written
    assert not root.exists()

    teach(a, 3)
    assert reg.save() == 1
    assert (user_folder(root, "a") / "meta.json").exists() and not user_folder(root, "b").exists()
    written = (user_folder(root, "a") / "meta.json").stat().st_mtime_ns
    assert reg.save() == 0  # unchanged since
    assert (user_folder(root, "a") / "meta.json").stat().st_mtime_ns == written

    teach(b, 1)  # buffered only (batch 2): still something to save
    assert reg.save() == 1 and (user_folder(root, "b") / "meta.json").exists()
    assert reg.save(only_changed=False) == 2
    assert reg.save("nobody") == 0  # never loaded: nothing to write


def test_maybe_save_every_n_records(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    reg = registry(root, checkpoint_every=3)
    learner = reg.get("a")
    folder = user_folder(root, "a")
    saves = []
    for i in range(7):
        teach(learner, 1, seed=i)
        saves.append(reg.maybe_save("a"))
    assert saves == [False, False, True, False, False, True, False]
    assert registry(root).get("a").stats.records == 6  # the checkpoint of the 6th record
    assert folder.is_dir()
    assert not reg.maybe_save("nobody")
    assert not registry(root).maybe_save("a")  # checkpoint_every 0: never
    assert not registry(None, checkpoint_every=1).maybe_save("a")


def test_no_root_keeps_nothing_on_disk(tmp_path: Path) -> None:
    reg = registry(None)
    teach(reg.get(), 3)
    assert reg.path(SHARED) is None and reg.path("a") is None
    assert reg.save() == 0


def test_drop_forgets_and_deletes_the_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    reg = registry(root)
    teach(reg.get("a"), 3)
    teach(reg.get("b"), 3)
    teach(reg.get(SHARED), 3)
    reg.save()

    reg.drop("b")  # forget only: the checkpoint stays and is loaded again
    assert "b" not in reg and reg.get("b").stats.records == 3

    backup = user_folder(root, "a").with_name(f".{user_folder(root, 'a').name}.old")
    shutil.copytree(user_folder(root, "a"), backup)  # what an interrupted save leaves behind
    reg.drop("a", delete_checkpoint=True)
    assert not user_folder(root, "a").exists() and not backup.exists()
    assert reg.get("a").stats.records == 0  # a deleted user starts afresh

    reg.drop(SHARED, delete_checkpoint=True)  # the root holds every key's checkpoint: kept
    assert (root / "meta.json").exists() and user_folder(root, "b").exists()


# ---- layout -------------------------------------------------------------------------------------
def test_path_layout(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    reg = registry(root, subdir="tenants")
    assert reg.path(SHARED) == root
    assert reg.path("alice") == root / "tenants" / f"alice-{hashlib.sha1(b'alice').hexdigest()[:10]}"
    alike = ["a/b", "a b", "a:b", "a\\b"]  # all sanitise to a_b
    folders = [reg.path(k) for k in alike]
    assert all(f.name.startswith("a_b-") and f.parent == root / "tenants" for f in folders)  # type: ignore[union-attr]
    assert len(set(folders)) == len(alike)
    assert reg.path("../../etc").parent == root / "tenants"  # type: ignore[union-attr]
    long = reg.path("x" * 200)
    assert long.name == "x" * 48 + "-" + hashlib.sha1(b"x" * 200).hexdigest()[:10]  # type: ignore[union-attr]

    for key in alike:
        teach(reg.get(key), 2, seed=len(key) + ord(key[1]))
    assert reg.save() == len(alike)
    reloaded = registry(root, subdir="tenants")
    for key in alike:
        assert all(torch.equal(a, b) for a, b in zip(weights(reg.get(key)), weights(reloaded.get(key))))


def test_saving_the_shared_learner_keeps_the_others(tmp_path: Path) -> None:
    """The shared checkpoint is the root folder, which also holds the per-key ones: swapping a new
    shared checkpoint in must not throw them away."""
    root = tmp_path / "ck"
    reg = registry(root)
    teach(reg.get("a"), 3)
    reg.save()
    for n in (3, 2):  # the first shared save creates the root's files, the second replaces them
        teach(reg.get(SHARED), n)
        reg.save(SHARED)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    again = registry(root)
    assert again.get("a").stats.records == 3 and again.get(SHARED).stats.records == 5


def test_a_crash_mid_swap_is_finished_before_any_key_is_looked_up(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    reg = registry(root)
    teach(reg.get("a"), 3)
    teach(reg.get(SHARED), 3)
    reg.save()
    backup = tmp_path / ".ck.old"

    root.rename(backup)  # crash after the old folder moved aside, before the new one moved in
    again = registry(root)
    assert root.is_dir() and not backup.exists()
    assert again.get("a").stats.records == 3 and again.get(SHARED).stats.records == 3

    root.rename(backup)  # crash after the new checkpoint moved in, before the nested ones followed
    shutil.copytree(backup, root, ignore=shutil.ignore_patterns("users"))
    again = registry(root)
    assert not backup.exists() and again.get("a").stats.records == 3


# ---- threads ------------------------------------------------------------------------------------
def test_concurrent_first_use_makes_one_learner_per_key(monkeypatch: pytest.MonkeyPatch) -> None:
    made = []

    class SlowReranker(ResidualLinearReranker):
        def __init__(self, dim: int, *options: object, **named: object) -> None:
            made.append(dim)
            time.sleep(0.02)  # widen the window in which an unguarded `get` would build twice
            super().__init__(dim, *options, **named)

    monkeypatch.setattr(registry_module, "ResidualLinearReranker", SlowReranker)
    reg = registry(None)
    start = threading.Barrier(8)
    got: list[Learner] = []

    def first_use(key: str) -> None:
        start.wait()
        got.append(reg.get(key))

    threads = [threading.Thread(target=first_use, args=("k" if i < 6 else f"other{i}",)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 8
    assert sum(g is reg.get("k") for g in got) == 6  # every thread asking for "k" got the same learner
    assert len(made) == 3 and len(reg) == 3  # one reranker built per key, none thrown away


def test_the_lexical_weight_starts_where_the_config_says() -> None:
    """`lexical_init` is a learner setting (ablations set it per run, nothing patches a module constant)."""
    from rmm.training.online import OnlineConfig

    default = LearnerRegistry(4, LearnerConfig(lexical_feature=True)).get(SHARED).reranker
    assert float(default.lexical_weight) == pytest.approx(LEXICAL_INIT)
    chosen = LearnerRegistry(4, OnlineConfig(lexical_init=1.5).learner_config()).get(SHARED).reranker
    assert float(chosen.lexical_weight) == pytest.approx(1.5)
