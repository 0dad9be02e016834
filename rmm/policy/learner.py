"""REINFORCE on citation rewards (paper Eq. 3, App. A.1, DESIGN.md §4).

Each shown memory gets +1 if the generator cited it and −1 otherwise; with baseline b the loss of
a batch is `−mean_queries Σ_j (r_j − b)·log π_j`, π_j the probability of the j-th pick. Rewards
arrive after the selection was made (maybe much later, from another process), so the learner
keeps only what it needs to recompute log π *with gradients under the current weights*: the query
and candidate embeddings, the picks, and the Gumbel noise (for the paper-literal estimator).

Hyper-parameters and their recipes live in `rmm.policy.recipes`, the checkpoint folder format in
`rmm.policy.checkpoint`; both are re-exported here for callers.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from rmm.device import resolve_device
from rmm.errors import CheckpointError, DimensionMismatchError
from rmm.policy.checkpoint import FORMAT_VERSION, read_checkpoint, write_checkpoint
from rmm.policy.recipes import (
    RECIPES,
    LearnerConfig,
    is_normalized_encoder,
    recipe_config,
    recipe_for,
)
from rmm.policy.reranker import ResidualLinearReranker
from rmm.policy.sampling import paper_literal_logp, plackett_luce_logp
from rmm.types import Selection

__all__ = [
    "FORMAT_VERSION",
    "RECIPES",
    "Learner",
    "LearnerConfig",
    "LearnerStats",
    "is_normalized_encoder",
    "recipe_config",
    "recipe_for",
    "rewards_from_citations",
]

log = logging.getLogger(__name__)


@dataclass
class LearnerStats:
    """Counters. `updates` counts batches processed (applied or skipped as non-finite);
    `step` counts optimizer steps actually applied."""

    records: int = 0
    updates: int = 0
    skipped_no_citation: int = 0
    skipped_nonfinite: int = 0
    step: int = 0
    last_loss: float | None = None
    reward_sum: float = 0.0
    reward_count: int = 0


def rewards_from_citations(n_shown: int, cited: list[int] | None, no_cite: bool = False) -> Tensor | None:
    """Per shown memory (in shown order): +1 cited, −1 shown but not cited.

    `[NO_CITE]` → all −1 (nothing shown helped). `cited=None` (no parseable citation) → None, which
    the learner counts as a skip: an unreadable reply says nothing about the memories.
    """
    if isinstance(n_shown, bool) or not isinstance(n_shown, int) or n_shown < 0:
        raise ValueError(f"n_shown must be a non-negative int, got {n_shown!r}")
    rewards = torch.full((n_shown,), -1.0)
    if no_cite:
        return rewards
    if cited is None:
        return None
    for index in cited:
        if 0 <= index < n_shown:
            rewards[index] = 1.0
        else:
            log.warning("ignoring cited index %s outside [0, %d)", index, n_shown)
    return rewards


@dataclass
class _Pending:
    """What a selection leaves for its update: enough to recompute log π with gradients."""

    query: Tensor  # [d]
    memories: Tensor  # [K, d]
    chosen: Tensor  # [M] long
    rewards: Tensor  # [M]
    noise: Tensor | None  # [K]

    def to_state(self) -> dict[str, Any]:
        state = {k: getattr(self, k) for k in ("query", "memories", "chosen", "rewards")}
        if self.noise is not None:
            state["noise"] = self.noise
        return state

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> _Pending:
        return cls(state["query"], state["memories"], state["chosen"], state["rewards"], state.get("noise"))


class Learner:
    """Turns rewarded selections into reranker updates, `batch_size` queries at a time."""

    def __init__(
        self,
        reranker: ResidualLinearReranker,
        config: LearnerConfig | None = None,
        encoder_name: str = "",
        device: str | torch.device = "cpu",
    ) -> None:
        self.config = config if config is not None else LearnerConfig()
        self.device = resolve_device(device)
        self.reranker = reranker.to(self.device)
        self.encoder_name = encoder_name
        self.stats = LearnerStats()
        self._buffer: list[_Pending] = []
        self.optimizer = _make_optimizer(self.config, list(self.reranker.parameters()))

    @property
    def dim(self) -> int:
        return self.reranker.dim

    @property
    def pending(self) -> int:
        """Rewarded selections waiting for the next update."""
        return len(self._buffer)

    # ---- recording -----------------------------------------------------------------------
    def record(self, selection: Selection, rewards: Tensor | None) -> float | None:
        """Store one rewarded selection; update when the batch is full.

        Returns the loss of the update this record triggered, else None (also when the update
        was skipped as non-finite). `rewards=None` (no parseable citation) is counted and dropped.
        """
        if rewards is None:
            self.stats.skipped_no_citation += 1
            log.info("no parseable citation for selection %s; skipped", selection.id)
            return None
        self._buffer.append(self._pending_from(selection, rewards))
        self.stats.records += 1
        if len(self._buffer) >= self.config.batch_size:
            return self._update()
        return None

    def _pending_from(self, selection: Selection, rewards: Tensor) -> _Pending:
        c = selection.candidates
        if c.embeddings is None or c.query_embedding is None:
            raise ValueError("the selection's candidates carry no embeddings; nothing to learn from")
        if c.query_embedding.shape[-1] != self.dim or (c.embeddings.numel() and c.embeddings.shape[-1] != self.dim):
            raise DimensionMismatchError(
                f"selection embeddings have dimension {c.query_embedding.shape[-1]}, learner has {self.dim}"
            )
        rewards = torch.as_tensor(rewards, dtype=torch.float32).detach().reshape(-1).cpu()
        if rewards.numel() != len(selection.chosen):
            raise ValueError(f"got {rewards.numel()} rewards for {len(selection.chosen)} shown memories")
        k = len(c.memory_ids)
        if any(not 0 <= i < k for i in selection.chosen) or len(set(selection.chosen)) != len(selection.chosen):
            raise ValueError(f"selection.chosen {selection.chosen} is not a set of distinct indices in [0, {k})")
        noise = None if selection.noise is None else selection.noise.detach().float().reshape(-1).cpu()
        return _Pending(
            query=c.query_embedding.detach().float().reshape(self.dim).cpu(),
            memories=c.embeddings.detach().float().reshape(k, self.dim).cpu(),
            chosen=torch.tensor(selection.chosen, dtype=torch.long),
            rewards=rewards,
            noise=noise,
        )

    def flush(self) -> float | None:
        """Update with whatever is buffered (end of a run); None when the buffer is empty."""
        return self._update() if self._buffer else None

    # ---- the update ----------------------------------------------------------------------
    def baseline(self) -> float:
        """The paper's constant b, or with `baseline="mean"` the mean reward seen before this batch.

        A constant b far above the typical reward (b = 0.5 when most shown memories go uncited,
        r = −1) makes nearly every term push probability *away* from what was shown: unbiased, but
        so noisy that Adam's per-weight steps mostly random-walk W. The running mean is the
        textbook variance-reducing choice and leaves the estimator unbiased all the same.
        """
        if self.config.baseline != "mean":
            return float(self.config.baseline)
        return self.stats.reward_sum / self.stats.reward_count if self.stats.reward_count else 0.0

    def loss(self, batch: list[_Pending]) -> Tensor:
        """`−mean_b Σ_j (r_j − b)·log π_j`, log π recomputed with gradients under current weights."""
        dev = self.device
        ks = [p.memories.shape[0] for p in batch]
        ms = [p.chosen.numel() for p in batch]
        if max(ks) == 0 or max(ms) == 0:
            return (self.reranker.W_q.weight.sum() + self.reranker.W_m.weight.sum()) * 0.0
        queries = torch.stack([p.query for p in batch]).to(dev)
        paper = self.config.estimator == "paper"
        if len(set(ks)) == 1 and len(set(ms)) == 1:  # the usual case: no padding needed
            memories = torch.stack([p.memories for p in batch]).to(dev)
            chosen = torch.stack([p.chosen for p in batch]).to(dev)
            rewards = torch.stack([p.rewards for p in batch]).to(dev)
            mask = pick_valid = None
            noise = _stack_noise(batch, ks[0]).to(dev) if paper else None
        else:
            memories, mask, chosen, rewards, pick_valid, noise = _pad_batch(batch, max(ks), max(ms), paper)
            memories, mask, chosen, rewards, pick_valid = (
                t.to(dev) for t in (memories, mask, chosen, rewards, pick_valid)
            )
            noise = None if noise is None else noise.to(dev)
        b = self.baseline()
        scores = self.reranker.policy_scores(queries, memories)
        if paper:
            logp = paper_literal_logp(scores, noise, chosen, self.config.tau, mask)
        else:
            logp = plackett_luce_logp(scores, chosen, self.config.tau, mask)
        if pick_valid is not None:
            # Padding picks may be -inf; select them away before multiplying (0·inf = NaN).
            logp = torch.where(pick_valid, logp, torch.zeros_like(logp))
            advantage = torch.where(pick_valid, rewards - b, torch.zeros_like(rewards))
        else:
            advantage = rewards - b
        return -(advantage * logp).sum(-1).mean()

    def _update(self) -> float | None:
        batch, self._buffer = self._buffer, []
        self.stats.updates += 1
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss(batch)
        self.stats.reward_sum += float(sum(p.rewards.sum() for p in batch))
        self.stats.reward_count += sum(p.rewards.numel() for p in batch)
        value = float(loss.detach())
        if not math.isfinite(value):
            return self._skip_nonfinite(f"loss is {value}")
        loss.backward()
        grads = [p.grad for p in self.reranker.parameters() if p.grad is not None]
        # One reduction instead of an elementwise isfinite per d×d gradient: a sum is NaN/inf
        # whenever any element is (or when finite values overflow — worth skipping as well).
        if grads and not bool(torch.isfinite(torch.stack([g.sum() for g in grads]).sum())):
            return self._skip_nonfinite("gradients are not finite")
        if self.config.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.reranker.parameters(), self.config.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.reranker.invalidate()
        self.stats.step += 1
        self.stats.last_loss = value
        return value

    def _skip_nonfinite(self, why: str) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.stats.skipped_nonfinite += 1
        log.warning("reranker update skipped (%s); parameters unchanged", why)

    # ---- checkpoints ---------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """Write the checkpoint folder atomically (temp sibling, then swap); returns its path."""
        target = write_checkpoint(
            path,
            weights=self.reranker.state_dict(),
            training={"optimizer": self.optimizer.state_dict(), "pending": [p.to_state() for p in self._buffer]},
            meta={"dim": self.dim, "encoder_name": self.encoder_name, "step": self.stats.step,
                  "stats": asdict(self.stats), "config": asdict(self.config)},
        )
        log.info("saved reranker checkpoint %s (step %d)", target, self.stats.step)
        return target

    @classmethod
    def load(
        cls,
        path: str | Path,
        encoder_name: str | None = None,
        dim: int | None = None,
        device: str | torch.device = "cpu",
    ) -> Learner:
        """Resume from `save`'s folder; refuses another encoder or dimension than expected."""
        saved = read_checkpoint(path, encoder_name=encoder_name, dim=dim)
        meta = saved.meta
        try:
            config = LearnerConfig(**{f.name: meta["config"][f.name] for f in fields(LearnerConfig)
                                      if f.name in meta["config"]})
            reranker = ResidualLinearReranker(int(meta["dim"]))
            reranker.load_state_dict(saved.weights)
            learner = cls(reranker, config, encoder_name=meta["encoder_name"], device=device)
            learner.optimizer.load_state_dict(saved.training["optimizer"])
            learner._buffer = [_Pending.from_state(s) for s in saved.training["pending"]]
            learner.stats = LearnerStats(**meta["stats"])
        except Exception as exc:  # shape, key and value errors all mean the same to a user
            raise CheckpointError(f"cannot load reranker checkpoint {saved.folder}: {exc}") from exc
        return learner


def _stack_noise(batch: list[_Pending], k: int) -> Tensor:
    """The stored Gumbel noise; zeros for greedy selections (the paper estimator then reduces to
    `log softmax(s/τ)`)."""
    return torch.stack([p.noise if p.noise is not None and p.noise.numel() == k else torch.zeros(k) for p in batch])


def _pad_batch(
    batch: list[_Pending], k_max: int, m_max: int, with_noise: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor | None]:
    """Pad rows of different K (users with few memories) and M (fewer picks than M)."""
    size, dim = len(batch), batch[0].query.shape[0]
    memories = torch.zeros(size, k_max, dim)
    mask = torch.zeros(size, k_max, dtype=torch.bool)
    chosen = torch.zeros(size, m_max, dtype=torch.long)
    rewards = torch.zeros(size, m_max)
    pick_valid = torch.zeros(size, m_max, dtype=torch.bool)
    noise = torch.zeros(size, k_max) if with_noise else None
    for i, p in enumerate(batch):
        k, m = p.memories.shape[0], p.chosen.numel()
        memories[i, :k] = p.memories
        mask[i, :k] = True
        chosen[i, :m] = p.chosen
        rewards[i, :m] = p.rewards
        pick_valid[i, :m] = True
        if noise is not None and p.noise is not None and p.noise.numel() == k:
            noise[i, :k] = p.noise
    return memories, mask, chosen, rewards, pick_valid, noise


def _make_optimizer(config: LearnerConfig, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """Adam (fused where torch supports it: one pass over the d×d states, ~10× faster on CPU
    at d=768 than the per-tensor loop) or plain SGD."""
    if config.optimizer == "sgd":
        return torch.optim.SGD(params, lr=config.lr)
    try:
        return torch.optim.Adam(params, lr=config.lr, fused=True)
    except (RuntimeError, ValueError, TypeError):  # a device without a fused kernel
        return torch.optim.Adam(params, lr=config.lr)
