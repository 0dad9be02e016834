"""A rewarded selection as the learner buffers it, and a batch of them as padded tensors.

`RewardedSelection` is what a `Selection` leaves for its update — the query and candidate
embeddings as scored, the picks, the rewards, the Gumbel noise, and what the off-policy
correction needs: the τ it was sampled at, the behaviour log-probability μ of each pick, the
weights version and the candidate mask. It is what checkpoints keep of the learner's buffer
(`to_state` / `from_state`), so a resumed learner weights those records exactly as the saved one
would have. A reranker that weighs candidate features gets each record's `[K, F]` features as they
were sampled (taken from the Selection, never recomputed: a delayed reward learns from what was scored).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from rmm.errors import DimensionMismatchError
from rmm.policy.sampling import plackett_luce_logp
from rmm.policy.stacking import align_features, stack_features, stack_lexical
from rmm.types import Selection

__all__ = ["RewardedBatch", "RewardedSelection", "behaviour_logp", "rewarded", "stack_rewarded"]

_STATE_FIELDS = ("query", "memories", "chosen", "rewards", "tau", "behaviour_logp")
_OPTIONAL_FIELDS = ("noise", "version", "mask", "lexical", "features")


@dataclass
class RewardedSelection:
    """What a selection leaves for its update: enough to recompute log π with gradients and to
    weight it by π_θ/μ, all as recorded when it was sampled."""

    query: Tensor  # [d]
    memories: Tensor  # [K, d]
    chosen: Tensor  # [M] long
    rewards: Tensor  # [M]
    noise: Tensor | None  # [K]
    tau: float
    behaviour_logp: Tensor  # [M] log μ of each pick
    version: int | None = None
    mask: Tensor | None = None  # [K] bool, True = could be picked
    lexical: Tensor | None = None  # [K] the candidates' lexical feature as scored (None: none)
    features: Tensor | None = None  # [K, F] the candidates' features as scored (None: none or not weighed)

    def to_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {k: getattr(self, k) for k in _STATE_FIELDS}
        for k in _OPTIONAL_FIELDS:
            if getattr(self, k) is not None:
                state[k] = getattr(self, k)
        return state

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> RewardedSelection:
        return cls(**{k: state[k] for k in _STATE_FIELDS},
                   **{k: state.get(k) for k in _OPTIONAL_FIELDS})


@dataclass
class RewardedBatch:
    """A batch's records as tensors, padded to a common K and M where rows differ."""

    queries: Tensor  # [B, d]
    memories: Tensor  # [B, K, d]
    chosen: Tensor  # [B, M], -1 at padding picks
    rewards: Tensor  # [B, M]
    taus: Tensor  # [B]
    behaviour_logp: Tensor  # [B, M], 0 at padding picks
    mask: Tensor | None  # [B, K] True = could be picked; None = every candidate
    pick_valid: Tensor | None  # [B, M] False at padding picks; None = no padding
    noise: Tensor | None  # [B, K] for the paper estimator
    lexical: Tensor | None = None  # [B, K] lexical features, 0 at padding; None = no record has any
    features: Tensor | None = None  # [B, K, F] candidate features, 0 at padding; None = no record has any

    def to(self, device: torch.device) -> RewardedBatch:
        parts = (self.queries, self.memories, self.chosen, self.rewards, self.taus, self.behaviour_logp,
                 self.mask, self.pick_valid, self.noise, self.lexical, self.features)
        if all(t is None or t.device == device for t in parts):  # the usual CPU learner: no-op calls
            return self
        return RewardedBatch(*(None if t is None else t.to(device) for t in parts))


def rewarded(selection: Selection, rewards: Tensor, dim: int, tau: float,
             feature_names: tuple[str, ...] = ()) -> RewardedSelection:
    """Check a selection and its rewards, and keep (on CPU) what its update needs.

    `tau` is the temperature to learn it at (the one it was sampled at); `feature_names` the
    candidate features the learner's reranker weighs (its candidates' features are kept when it
    weighs any, zero-filled when they are its leading ones; other names are a FeatureMismatchError). Malformed input — no
    embeddings, another dimension, rewards or μ of the wrong length, repeated or masked-out
    picks — is a ValueError (DimensionMismatchError for the dimension) and nothing is kept.
    """
    c = selection.candidates
    if c.embeddings is None or c.query_embedding is None:
        raise ValueError("the selection's candidates carry no embeddings; nothing to learn from")
    if c.query_embedding.shape[-1] != dim or (c.embeddings.numel() and c.embeddings.shape[-1] != dim):
        raise DimensionMismatchError(
            f"selection embeddings have dimension {c.query_embedding.shape[-1]}, learner has {dim}"
        )
    rewards = torch.as_tensor(rewards, dtype=torch.float32).detach().reshape(-1).cpu()
    if rewards.numel() != len(selection.chosen):
        raise ValueError(f"got {rewards.numel()} rewards for {len(selection.chosen)} shown memories")
    k = len(c.memory_ids)
    if any(not 0 <= i < k for i in selection.chosen) or len(set(selection.chosen)) != len(selection.chosen):
        raise ValueError(f"selection.chosen {selection.chosen} is not a set of distinct indices in [0, {k})")
    mask = None
    if selection.mask is not None:
        mask = selection.mask.detach().to(torch.bool).reshape(-1).cpu()
        if mask.numel() != k:
            raise ValueError(f"selection.mask has {mask.numel()} entries for {k} candidates")
        if not all(mask[i] for i in selection.chosen):
            raise ValueError(f"selection.chosen {selection.chosen} picks a masked-out candidate")
    chosen = torch.tensor(selection.chosen, dtype=torch.long)
    noise = None if selection.noise is None else _cpu_float(selection.noise, -1)
    lexical = None if c.lexical is None else _cpu_float(c.lexical, -1)
    if lexical is not None and lexical.numel() != k:
        raise ValueError(f"the candidates' lexical feature has {lexical.numel()} entries for {k} candidates")
    features = None
    if feature_names and c.features is not None:  # the leading features only: zeros in the rest (`align_features`)
        features = _cpu_float(align_features(c.features, c.feature_names, feature_names, "the selection's candidates"),
                              k, len(feature_names))
    return RewardedSelection(
        query=_cpu_float(c.query_embedding, dim),
        memories=_cpu_float(c.embeddings, k, dim),
        chosen=chosen,
        rewards=rewards,
        noise=noise,
        tau=tau,
        behaviour_logp=behaviour_logp(selection, chosen, tau, mask),
        version=selection.version,
        mask=mask,
        lexical=lexical,
        features=features,
    )


def _cpu_float(t: Tensor, *shape: int) -> Tensor:
    """`t.detach().float().reshape(*shape).cpu()`, skipping the conversions that would be no-ops
    (a record converts six tensors; each skipped call is a dispatcher round trip per turn)."""
    t = t.detach()
    if t.dtype != torch.float32:
        t = t.float()
    t = t.reshape(shape)
    return t if t.device.type == "cpu" else t.cpu()


def behaviour_logp(selection: Selection, chosen: Tensor, tau: float, mask: Tensor | None) -> Tensor:
    """log μ per pick: as the sampler recorded it, else from the scores it sampled with (the same
    Plackett–Luce log-probability under `scores/τ`)."""
    m = chosen.numel()
    if selection.logp is not None:
        logp = _cpu_float(selection.logp, -1)
        if logp.numel() != m:
            raise ValueError(f"selection.logp has {logp.numel()} entries for {m} picks")
    else:
        scores = _cpu_float(selection.scores, -1)
        if scores.numel() != len(selection.candidates.memory_ids):
            raise ValueError(f"selection.scores has {scores.numel()} entries for "
                             f"{len(selection.candidates.memory_ids)} candidates")
        if m == 0:
            return torch.zeros(0)
        logp = plackett_luce_logp(scores[None], chosen[None], tau, None if mask is None else mask[None])[0]
    if not bool(torch.isfinite(logp).all()):
        raise ValueError(f"the selection's behaviour log-probability is not finite: {logp.tolist()}")
    return logp


def stack_rewarded(batch: list[RewardedSelection], with_noise: bool) -> RewardedBatch:
    """Stack a batch; pad rows of different K (users with few memories: masked out) and M (fewer
    picks: -1, after the real ones, with reward and μ 0)."""
    ks = [p.memories.shape[0] for p in batch]
    ms = [p.chosen.numel() for p in batch]
    taus = torch.tensor([p.tau for p in batch], dtype=torch.float32)
    lexical = stack_lexical([p.lexical for p in batch], max(ks))
    width = next((p.features.shape[1] for p in batch if p.features is not None), 0)
    features = stack_features([p.features for p in batch], max(ks), width)
    if len(set(ks)) == 1 and len(set(ms)) == 1 and all(p.mask is None for p in batch):  # the usual case
        noise = None
        if with_noise:
            noise = torch.stack([p.noise if p.noise is not None and p.noise.numel() == ks[0] else torch.zeros(ks[0])
                                 for p in batch])
        return RewardedBatch(torch.stack([p.query for p in batch]), torch.stack([p.memories for p in batch]),
                      torch.stack([p.chosen for p in batch]), torch.stack([p.rewards for p in batch]), taus,
                      torch.stack([p.behaviour_logp for p in batch]), None, None, noise, lexical, features)
    size, dim, k_max, m_max = len(batch), batch[0].query.shape[0], max(ks), max(ms)
    memories = torch.zeros(size, k_max, dim)
    mask = torch.zeros(size, k_max, dtype=torch.bool)
    chosen = torch.full((size, m_max), -1, dtype=torch.long)  # -1: no pick (Plackett–Luce scores it 0)
    rewards = torch.zeros(size, m_max)
    mu = torch.zeros(size, m_max)
    pick_valid = torch.zeros(size, m_max, dtype=torch.bool)
    # Zeros for greedy or noiseless rows: the paper estimator then reduces to `log softmax(s/τ)`.
    noise = torch.zeros(size, k_max) if with_noise else None
    for i, p in enumerate(batch):
        k, m = ks[i], ms[i]
        memories[i, :k] = p.memories
        mask[i, :k] = True if p.mask is None else p.mask
        chosen[i, :m] = p.chosen
        rewards[i, :m] = p.rewards
        mu[i, :m] = p.behaviour_logp
        pick_valid[i, :m] = True
        if noise is not None and p.noise is not None and p.noise.numel() == k:
            noise[i, :k] = p.noise
    return RewardedBatch(torch.stack([p.query for p in batch]), memories, chosen, rewards, taus, mu, mask, pick_valid,
                         noise, lexical, features)
