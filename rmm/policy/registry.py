"""Which learner serves which key, how it is made, and where it is checkpointed — in one place.

Every caller that learns (the agent, the goal front end, `rmm serve`, `rmm train`) needs the same
bookkeeping: one reranker + learner per key (a user, a tenant, or `""` for the whole bank),
loaded from its checkpoint folder when one was saved and created fresh otherwise, saved
atomically when it has learned something since the last save. The key policy (per user, per
tenant, shared) stays with the caller, which knows what isolation it promises.

Checkpoint layout under `root`: the shared learner (`""`) at `root` itself, every other key at
`root/<subdir>/<readable prefix>-<sha1 prefix>` (the hash keeps distinct keys apart after the
readable part is sanitised). Saving the shared learner keeps the folders nested in `root`
(`rmm.policy.checkpoint` carries them over), so a bank's shared, per-user and per-tenant
rerankers can live side by side.

Where the bank is a PostgreSQL database, checkpoints are reranker *versions* in its
`reranker_versions` table instead (`versions=`, `rmm.policy.pg_versions.RerankerVersions`): a
learner is loaded from its key's newest version, `save` writes nothing (the one learner among the
replicas writes versions as it steps), and `install` swaps in a newer version a poller found.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import re
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import torch

from rmm.errors import DimensionMismatchError
from rmm.memory.features import CANDIDATE_FEATURES
from rmm.policy.checkpoint import backup_of, checkpoint_exists, finish_interrupted_swap
from rmm.policy.learner import Learner, LearnerConfig
from rmm.policy.reranker import ResidualLinearReranker

__all__ = ["SHARED", "LearnerRegistry", "StoredVersions", "adopt_weights", "checkpoint_exists"]

log = logging.getLogger(__name__)

SHARED = ""  # the key of a learner shared by every user of the bank


class StoredVersions(Protocol):
    """Reranker versions kept outside checkpoint folders (`rmm.policy.pg_versions.RerankerVersions`)."""

    def latest(self) -> dict[str, int]: ...

    def read(self, key: str) -> tuple[int, bytes] | None: ...

    def delete(self, key: str) -> int: ...


class LearnerRegistry:
    """Learners by key, created or loaded on first use; thread-safe; checkpoints on demand."""

    def __init__(self, dim: int, config: LearnerConfig, *, encoder_name: str = "",
                 device: str | torch.device = "cpu", root: str | Path | None = None, subdir: str = "users",
                 checkpoint_every: int = 0, versions: StoredVersions | None = None) -> None:
        self.dim, self.config, self.encoder_name, self.device = dim, config, encoder_name, device
        self.versions = versions
        self._version: dict[str, int] = {}  # key -> the stored version its learner was loaded from
        self.root = Path(root) if root is not None else None
        self.subdir = subdir
        self.checkpoint_every = checkpoint_every
        self._learners: dict[str, Learner] = {}
        self._saved: dict[str, tuple[int, int]] = {}
        self._lock = threading.RLock()
        if self.root is not None:
            finish_interrupted_swap(self.root)  # the shared folder holds every key's checkpoint

    @property
    def feature_names(self) -> tuple[str, ...]:
        """The candidate features the rerankers it builds weigh, in order: `CANDIDATE_FEATURES` with
        `config.candidate_features`, then `config.extra_features` (those not already among them)."""
        base = CANDIDATE_FEATURES if self.config.candidate_features else ()
        return base + tuple(n for n in self.config.extra_features if n not in base)

    def request_features(self, names: tuple[str, ...]) -> list[str]:
        """Have the rerankers built or loaded from now on also weigh `names` (appended to
        `config.extra_features`, weights from 0; a checkpoint saved without them gains them at 0). A front
        end that hands the reranker a feature of its own calls this before its first `get`. Returns the keys
        already loaded whose rerankers lack one of them (given with `put`, or loaded earlier): those keep
        their terms, and the caller says that the feature is not learned there."""
        with self._lock:
            new = tuple(n for n in names if n not in self.feature_names)
            if new:
                self.config = dataclasses.replace(self.config, extra_features=self.config.extra_features + new)
            return [k for k, learner in sorted(self._learners.items())
                    if not set(names) <= set(learner.reranker.feature_names)]

    @property
    def lock(self) -> threading.RLock:
        """Held by `get`, `save` and `drop`; hold it too while a learner's weights are read or stepped
        from several threads, so that a checkpoint never captures half an optimizer step."""
        return self._lock

    # ---- lookup ---------------------------------------------------------------------------
    def get(self, key: str = SHARED) -> Learner:
        """The learner of `key`: loaded from its checkpoint when one was saved, else a fresh one."""
        with self._lock:
            if key not in self._learners:
                path = self.path(key)
                stored = self.versions.read(key) if self.versions is not None else None
                if stored is not None:
                    learner = self._from_version(key, *stored)
                    self._version[key] = stored[0]
                elif path is not None and checkpoint_exists(path):
                    learner = Learner.load(path, encoder_name=self.encoder_name, dim=self.dim, device=self.device,
                                          lexical_feature=self.config.lexical_feature,
                                          feature_names=self.feature_names)
                    log.info("loaded reranker checkpoint %s (step %d)", path, learner.stats.step)
                else:
                    reranker = ResidualLinearReranker(self.dim, self.config.lexical_feature,
                                                      lexical_init=self.config.lexical_init,
                                                      feature_names=self.feature_names)
                    learner = Learner(reranker, self.config, encoder_name=self.encoder_name, device=self.device)
                self._learners[key] = learner
                self._saved[key] = _progress(learner)
                self._version.setdefault(key, 0)
            return self._learners[key]

    def _from_version(self, key: str, version: int, data: bytes) -> Learner:
        from rmm.policy.pg_versions import learner_from_bytes

        learner = learner_from_bytes(data, encoder_name=self.encoder_name, dim=self.dim, device=self.device,
                                     lexical_feature=self.config.lexical_feature,
                                     feature_names=self.feature_names)
        log.info("loaded reranker %r version %d (step %d)", key, version, learner.stats.step)
        return learner

    # ---- stored versions (a PostgreSQL bank) ---------------------------------------------------
    def version_of(self, key: str) -> int | None:
        """The stored version the loaded learner of `key` was loaded from or saved as (0: none yet);
        None when `key` is not loaded."""
        with self._lock:
            return self._version.get(key) if key in self._learners else None

    def install(self, key: str, learner: Learner, version: int) -> None:
        """Serve `learner` (stored `version`) for `key` from now on, replacing the loaded one."""
        with self._lock:
            self.put(key, learner)
            self._version[key] = version

    def refresh(self, latest: dict[str, int]) -> list[str]:
        """Load the newest stored version of every loaded key that is behind `latest`; returns the
        keys reloaded. Keys not loaded yet are left alone (`get` loads their newest on first use)."""
        if self.versions is None:
            return []
        reloaded = []
        for key, version in latest.items():
            current = self.version_of(key)
            if current is None or current >= version:
                continue
            stored = self.versions.read(key)
            if stored is None:
                continue
            learner = self._from_version(key, *stored)
            with self._lock:
                if key in self._learners and self._version.get(key, 0) < stored[0]:
                    self.install(key, learner, stored[0])
                    reloaded.append(key)
        return reloaded

    def put(self, key: str, learner: Learner) -> None:
        """Register a learner built by the caller (e.g. one given to the agent)."""
        if learner.dim != self.dim:
            raise DimensionMismatchError(f"learner for {key!r} has dimension {learner.dim}, the registry {self.dim}")
        with self._lock:
            self._learners[key] = learner
            self._saved[key] = _progress(learner)

    def __contains__(self, key: str) -> bool:
        return key in self._learners

    def __len__(self) -> int:
        return len(self._learners)

    def __iter__(self) -> Iterator[str]:
        """The keys loaded so far, in key order (a snapshot)."""
        with self._lock:
            return iter(sorted(self._learners))

    def items(self) -> Iterator[tuple[str, Learner]]:
        """(key, learner) pairs loaded so far, in key order (a snapshot: safe while others learn)."""
        with self._lock:
            return iter(sorted(self._learners.items()))

    def path(self, key: str) -> Path | None:
        """The checkpoint folder of `key`, or None when this registry keeps nothing on disk."""
        if self.root is None:
            return None
        if key == SHARED:
            return self.root
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", key)[:48]
        return self.root / self.subdir / f"{safe}-{hashlib.sha1(key.encode()).hexdigest()[:10]}"

    # ---- checkpoints ------------------------------------------------------------------------
    def save(self, key: str | None = None, *, only_changed: bool = True) -> int:
        """Checkpoint `key` (or every loaded learner) atomically; returns how many were written.

        A key that was never loaded has nothing to write (0).
        """
        if self.root is None or self.versions is not None:
            return 0  # with stored versions the learner writes them as it steps
        saved = 0
        with self._lock:
            keys = list(self._learners) if key is None else [key] if key in self._learners else []
            for k in keys:
                learner = self._learners[k]
                if only_changed and _progress(learner) == self._saved.get(k):
                    continue
                learner.save(self.path(k))  # type: ignore[arg-type]
                self._saved[k] = _progress(learner)
                saved += 1
        return saved

    def maybe_save(self, key: str) -> bool:
        """Save `key` once `checkpoint_every` rewarded selections arrived since its last save."""
        if not self.checkpoint_every or self.root is None:
            return False
        with self._lock:
            if key not in self._learners:
                return False
            done = _progress(self._learners[key])[0]
            if done - self._saved.get(key, (0, 0))[0] < self.checkpoint_every:
                return False
            return self.save(key, only_changed=False) == 1

    def drop(self, key: str, *, delete_checkpoint: bool = False) -> None:
        """Forget `key`'s learner (and its checkpoint, e.g. when the user is deleted).

        The shared checkpoint is never deleted here: its folder holds every other key's as well.
        """
        with self._lock:
            self._learners.pop(key, None)
            self._saved.pop(key, None)
            self._version.pop(key, None)
            if delete_checkpoint and self.versions is not None and key != SHARED:
                self.versions.delete(key)
            path = self.path(key)
            if delete_checkpoint and path is not None and key != SHARED:
                # the backup too: an interrupted save's leftover would otherwise bring the learner back
                for folder in (path, backup_of(path)):
                    shutil.rmtree(folder, ignore_errors=True)


def adopt_weights(learner: Learner, weights: dict[str, torch.Tensor]) -> int:
    """Load promoted `weights` (`rmm.serve.shadow`) into `learner` as its next weights version
    (`stats.step` + 1, stamped on what it samples from now on); its optimizer moments are reset, since
    they belong to the replaced weights, and it keeps learning from these. Returns the new version."""
    learner.reranker.load_state_dict(weights)
    learner.reranker.invalidate()
    learner.optimizer.state.clear()
    learner.stats.step += 1
    learner.reranker.version = learner.stats.step
    return learner.stats.step


def _progress(learner: Learner) -> tuple[int, int]:
    """What changes whenever a learner has something new to save: (rewarded + skipped, buffered)."""
    return learner.stats.records + learner.stats.skipped_no_citation, learner.pending
