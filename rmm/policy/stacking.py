"""Candidate lists as the padded batch tensors the reranker scores: `[B, d]` queries, `[B, K, d]`
memories and mask, `[B, K]` lexical features, `[B, K, F]` candidate features.

Shared by sampling (`ResidualLinearReranker.select`, from `Candidates`) and the update (`rmm.policy.
rewarded.stack_rewarded`, from the records a Selection left), so both pad and check alike: a row
shorter than the longest is zero-padded and masked out, a list without a feature counts as zeros
(so does a list carrying only the leading features of the reranker's, e.g. the hybrid first stage's
before a front end's `LearnerConfig.extra_features`: zeros in the rest), and features under other
names than the reranker weighs are refused (`FeatureMismatchError`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from rmm.errors import DimensionMismatchError, FeatureMismatchError
from rmm.types import Candidates

__all__ = ["align_features", "check_feature_names", "features_of", "lexical_of", "stack_candidates", "stack_features", "stack_lexical"]


def stack_candidates(
    candidates: Sequence[Candidates], dim: int, device: torch.device, dtype: torch.dtype = torch.float32
) -> tuple[Tensor, Tensor, Tensor]:
    """Batch candidate lists of different lengths: `(queries[B,d], memories[B,K,d], mask[B,K])`.

    Rows shorter than the longest are zero-padded and masked out; a user with fewer memories
    than K is normal, not an error.
    """
    for i, c in enumerate(candidates):
        if c.embeddings is None or c.query_embedding is None:
            raise ValueError(
                f"candidates[{i}] (query {c.query!r}) carry no embeddings; the reranker needs a "
                "dense retriever's vectors (plain BM25 candidates cannot be reranked; use bm25:DENSE)"
            )
        if c.query_embedding.shape[-1] != dim or (c.embeddings.numel() and c.embeddings.shape[-1] != dim):
            raise DimensionMismatchError(
                f"candidates[{i}] have dimension {c.query_embedding.shape[-1]}, reranker has {dim}; "
                "use a reranker built for this encoder"
            )
        if c.embeddings.ndim != 2 or c.embeddings.shape[0] != len(c.memory_ids):
            raise ValueError(
                f"candidates[{i}].embeddings has shape {tuple(c.embeddings.shape)}, expected "
                f"[{len(c.memory_ids)}, {dim}]"
            )
    batch = len(candidates)
    k_max = max((len(c) for c in candidates), default=0)
    if batch == 1:  # a view, not a copy (nothing writes into the stacked tensors)
        queries = candidates[0].query_embedding.reshape(1, dim).to(device, dtype)
    else:
        queries = torch.stack([c.query_embedding.reshape(dim) for c in candidates]).to(device, dtype)
    if all(len(c) == k_max for c in candidates):
        memories = (candidates[0].embeddings.unsqueeze(0) if batch == 1
                    else torch.stack([c.embeddings for c in candidates])).to(device, dtype)
        mask = torch.ones(batch, k_max, dtype=torch.bool, device=device)
        return queries, memories, mask
    memories = torch.zeros(batch, k_max, dim, device=device, dtype=dtype)
    mask = torch.zeros(batch, k_max, dtype=torch.bool, device=device)
    for i, c in enumerate(candidates):
        k = len(c)
        if k:
            memories[i, :k] = c.embeddings.to(device, dtype)
            mask[i, :k] = True
    return queries, memories, mask


def stack_lexical(features: Sequence[Tensor | None], k_max: int, device: torch.device | None = None,
                  dtype: torch.dtype = torch.float32) -> Tensor | None:
    """`[B, K]` lexical features, one row per list (0 at padding and for lists without any); None
    when no list has one: `stack_features` of one column. Used at sampling time (candidates) and at
    update time (rewarded records)."""
    stacked = stack_features([None if f is None else f.reshape(-1, 1) for f in features], k_max, 1, device, dtype)
    return None if stacked is None else stacked.squeeze(-1)


def stack_features(features: Sequence[Tensor | None], k_max: int, width: int, device: torch.device | None = None,
                   dtype: torch.dtype = torch.float32) -> Tensor | None:
    """`[B, K, F]` candidate features, one block per list (0 at padding and for lists without any);
    None when no list has any. Sampling time (candidates) and update time (rewarded records) alike."""
    if width == 0 or all(f is None for f in features):
        return None
    if len(features) == 1 and features[0] is not None and features[0].shape == (k_max, width):
        return features[0].unsqueeze(0).to(device, dtype)
    out = torch.zeros(len(features), k_max, width, device=device, dtype=dtype)
    for i, f in enumerate(features):
        if f is not None:
            out[i, : f.shape[0]] = f.to(out.device, dtype)
    return out


def check_feature_names(given: Sequence[str], expected: Sequence[str], where: str) -> None:
    """A `FeatureMismatchError` naming both sets when features named `given` would meet weights named `expected`."""
    if tuple(given) != tuple(expected):
        raise FeatureMismatchError(
            f"{where} carry candidate features {list(given)}, the reranker weighs {list(expected)}; use a "
            "reranker trained on this first stage's features (or none: --no-candidate-features)")


def align_features(features: Tensor, given: Sequence[str], expected: Sequence[str], where: str) -> Tensor:
    """`features` ([K, len(given)]) in the columns of `expected`: as they are when the names match, with
    zero columns after them when `given` are the leading names of `expected` (module docstring); other
    names are a `FeatureMismatchError`."""
    given, expected = tuple(given), tuple(expected)
    if not (given and len(given) < len(expected) and expected[:len(given)] == given):
        check_feature_names(given, expected, where)
    if features.ndim != 2 or features.shape[1] != len(given):
        raise ValueError(f"{where} features have shape {tuple(features.shape)}, expected [K, {len(given)}]")
    if len(given) == len(expected):
        return features
    return torch.cat([features, features.new_zeros(features.shape[0], len(expected) - len(given))], -1)


def features_of(candidates: Sequence[Candidates], names: tuple[str, ...]) -> list[Tensor | None]:
    """Each list's features as [K, F] in the reranker's `names` (`align_features`)."""
    out: list[Tensor | None] = []
    for i, c in enumerate(candidates):
        if c.features is None:
            out.append(None)
            continue
        if c.features.shape[0:1] != (len(c),):
            raise ValueError(f"candidates[{i}].features has shape {tuple(c.features.shape)}, expected "
                             f"[{len(c)}, {len(names)}]")
        out.append(align_features(c.features, c.feature_names, names, f"candidates[{i}]"))
    return out


def lexical_of(candidates: Sequence[Candidates]) -> list[Tensor | None]:
    """Each list's lexical feature, checked to have one entry per candidate."""
    for i, c in enumerate(candidates):
        if c.lexical is not None and c.lexical.numel() != len(c):
            raise ValueError(f"candidates[{i}].lexical has {c.lexical.numel()} entries for {len(c)} candidates")
    return [c.lexical for c in candidates]
