"""Residual-linear reranker (paper Eq. 1) and Top-M selection (Eq. 2, DESIGN.md §4).

`q' = q + W_q q`, `m'_i = m_i + W_m m_i`, `s_i = q'·m'_i`. With `W_q = W_m = 0` at start an
untrained reranker reproduces a dot-product retriever's ranking, so switching it on never makes
retrieval worse before it has learned anything.

Inference folds both transforms into the query: in the row-vector convention of `nn.Linear`
(`y = x Wᵀ`), `q' = q (I+W_q)ᵀ` and `m' = m (I+W_m)ᵀ`, hence
`s = q (I+W_q)ᵀ (I+W_m) mᵀ = (q A)·m` with `A = (I+W_q)ᵀ (I+W_m)`. One d×d product per query
instead of one per memory, and the transformed query can search the whole bank directly.
`forward` is the plain Eq. 1 form (autograd; the reference); the learner uses `policy_scores`,
the same function with the memory transform moved onto the query (B·d² instead of B·K·d²).

Exclusion (`select(..., exclude=)`, MemR³'s mask of memories already shown for a question):
excluded candidates get −∞ logits *before* the Gumbel top-M, inside the dispatched rerank step,
so they are never picked and the reported log π is the Plackett–Luce log-likelihood over the
candidates left. The Selection then holds only those candidates (`chosen` re-indexed into them):
the learner recomputes log π from `selection.candidates` alone, so carrying the excluded ones
(and a mask the learner, its pending buffer and checkpoints would all have to honour) would make
its normaliser wrong; without them its recomputation is the same distribution the sample came from.

Lexical feature (our extension of Eq. 1, not in the paper): with `lexical_feature=True` the score
is `s_i = q'·m'_i + w·f_i`, `f_i` the hybrid first stage's fused score of candidate i scaled to
[0, 1] (`Candidates.lexical`, `rmm.memory.hybrid`) and `w` one learned scalar. Eq. 1 can only
reorder by the encoder's geometry, so over hybrid candidates an untrained reranker ranks BM25's
finds by cosine and throws the fusion away; `w` lets it learn how much the first stage's own
evidence counts. It starts at `LEXICAL_INIT` (chosen on LoCoMo's training conversations,
docs/results.md), so an untrained reranker over hybrid candidates is *not* Eq. 1's: it ranks by
cosine + 0.3·f. A candidate list without the feature (dense retriever) gets f = 0, a constant that
changes no order and no probability, so the same reranker serves both.
Sampling folds the term into the dispatched kernel as one more dimension (`[q A, w]·[m, f]`).

Candidate features (our extension too, issue 14): a reranker built with `feature_names` (the
hybrid first stage's `rmm.memory.features.CANDIDATE_FEATURES`) adds `x_i·v`, `x_i` the candidate's
row of `Candidates.features` and `v` (`feature_weight`, one weight per name) starting at 0, so an
untrained reranker ranks exactly as it would without them. A list without features counts as
zeros (like the lexical feature); a list whose `feature_names` differ from the reranker's is a
`FeatureMismatchError` naming both (a weight must never meet another feature's column). A reranker
without features ignores whatever features its candidates carry. Sampling folds them with `w`:
`[q A, w, v]·[m, f, x]`.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence

import torch
from torch import Tensor, nn

from rmm.kernels.dispatch import rerank, resolve_backend
from rmm.kernels.reference import rerank_rows
from rmm.policy.stacking import (  # re-exported: where callers found them before rmm.policy.stacking
    check_feature_names,
    features_of,
    lexical_of,
    stack_candidates,
    stack_features,
    stack_lexical,
)
from rmm.types import Candidates, Selection

__all__ = ["LEXICAL_INIT", "ResidualLinearReranker", "candidate_subset", "check_feature_names",
           "stack_candidates", "stack_features", "stack_lexical"]

log = logging.getLogger(__name__)

# w at start. Chosen on LoCoMo's training conversations by `rmm train --dataset locomo --retriever hybrid`'s
# prequential recall@5 (hybrid alone 48.2): no feature 49.3, w0 = 0 49.4, 0.1 51.3, 0.3 52.9, 0.5 51.6,
# 1.0 51.9 (docs/results.md). 0 would leave an untrained reranker ordering hybrid candidates by cosine,
# below the fused order; 0.3 starts it from a blend of the encoder's score and the fused evidence.
LEXICAL_INIT = 0.3


def candidate_subset(candidates: Candidates, positions: Sequence[int]) -> Candidates:
    """The candidates at `positions`, in that order (embeddings, scores and ids alike)."""
    index = torch.as_tensor(list(positions), dtype=torch.long)
    return Candidates(
        query=candidates.query,
        memory_ids=[candidates.memory_ids[i] for i in index.tolist()],
        retriever_scores=candidates.retriever_scores[index],
        embeddings=None if candidates.embeddings is None else candidates.embeddings[index],
        query_embedding=candidates.query_embedding,
        user_id=candidates.user_id,
        lexical=None if candidates.lexical is None else candidates.lexical[index],
        features=None if candidates.features is None else candidates.features[index],
        feature_names=candidates.feature_names,
    )


def _on_cpu(t: Tensor) -> Tensor:
    """`t.cpu()` without the dispatcher round trip when it is there already (four per select)."""
    return t if t.device.type == "cpu" else t.cpu()


def _rows_path(memories: Tensor, m: int) -> bool:
    """Whether `rerank_rows` may serve this step: float32, and the backend `rerank` would pick is the
    torch reference (CPU; `RMM_KERNEL_BACKEND` is honoured, and a bad value still raises there)."""
    return (memories.dtype == torch.float32 and memories.device.type == "cpu"
            and resolve_backend("auto", memories.device, memories.shape[1], m) == "torch")


def _aligned(t: Tensor) -> Tensor:
    """`t` when contiguous and 64-byte aligned like a fresh allocation, else such a copy (a block the
    reference gathers is one; MKL's results may depend on alignment)."""
    if t.is_contiguous() and t.data_ptr() % 64 == 0:
        return t
    return torch.empty_like(t, memory_format=torch.contiguous_format).copy_(t)


def _row(t: Tensor, i: int, kept: slice | list[int] | None) -> Tensor:
    """Row `i` of `t` at `kept` (None: all of it, one indexing op instead of two)."""
    return t[i] if kept is None else t[i, kept]


def _allowed(candidates: Sequence[Candidates], padding: Tensor,
             exclude: Sequence[Collection[str]] | None) -> Tensor:
    """`[B, K]` True where a candidate is real and not excluded."""
    if exclude is None:
        return padding
    if isinstance(exclude, (str, bytes)) or len(exclude) != len(candidates):
        raise ValueError(f"exclude needs one collection of memory ids per candidate list "
                         f"({len(candidates)}), got {exclude!r:.80}")
    allowed = padding.clone()
    for row, (c, excluded) in enumerate(zip(candidates, exclude)):
        if isinstance(excluded, (str, bytes)):
            raise TypeError(f"exclude[{row}] must be a collection of memory ids, not the string {excluded!r:.40}")
        hits = [j for j, memory_id in enumerate(c.memory_ids) if memory_id in excluded]
        if hits:
            allowed[row, hits] = False
    return allowed


class ResidualLinearReranker(nn.Module):
    """Eq. 1 with zero-initialised `W_q`, `W_m` (no bias: a bias would shift every score alike),
    plus the learned lexical weight `w` when `lexical_feature` and one weight per candidate feature
    of `feature_names` (module docstring)."""

    def __init__(self, dim: int, lexical_feature: bool = False, lexical_init: float | None = None,
                 feature_names: Sequence[str] = ()) -> None:
        super().__init__()
        if dim <= 0:
            raise ValueError(f"dim must be positive, got {dim}")
        self.dim = dim
        self.W_q = nn.Linear(dim, dim, bias=False)
        self.W_m = nn.Linear(dim, dim, bias=False)
        nn.init.zeros_(self.W_q.weight)
        nn.init.zeros_(self.W_m.weight)
        self.lexical_weight: nn.Parameter | None
        if lexical_feature:
            init = LEXICAL_INIT if lexical_init is None else float(lexical_init)
            self.lexical_weight = nn.Parameter(torch.tensor(init))
        else:  # no parameter at all: the state dict (and a checkpoint) stays Eq. 1's
            self.register_parameter("lexical_weight", None)
        if isinstance(feature_names, str) or len(set(feature_names)) != len(feature_names):
            raise ValueError(f"feature_names must be distinct names, got {feature_names!r}")
        self._feature_names: tuple[str, ...] = tuple(str(n) for n in feature_names)
        self.feature_weight: nn.Parameter | None
        if self._feature_names:  # starts at 0: the features change no ranking until learned
            self.feature_weight = nn.Parameter(torch.zeros(len(self._feature_names)))
        else:  # no parameter: the state dict (and a checkpoint) stays as it was before the features
            self.register_parameter("feature_weight", None)
        self._folded: tuple[tuple, Tensor] | None = None
        self._served: tuple[tuple | None, int] = (None, 0)  # query rows served per weight version
        # The weights version stamped on every Selection: the learner that owns this reranker sets it
        # to its optimizer step count after each step, so a delayed reward knows how stale it is.
        self.version = 0

    @property
    def lexical_feature(self) -> bool:
        """Whether this reranker learns the lexical weight `w` (our extension of Eq. 1)."""
        return self.lexical_weight is not None

    @property
    def feature_names(self) -> tuple[str, ...]:
        """The candidate features this reranker weighs, in `feature_weight`'s order (() = none)."""
        return self._feature_names

    def _plus_extensions(self, scores: Tensor, lexical: Tensor | None, features: Tensor | None = None) -> Tensor:
        """`scores + w·f + x·v` for the terms that are on and given; `scores` unchanged otherwise."""
        if self.lexical_weight is not None and lexical is not None:
            if lexical.shape != scores.shape:
                raise ValueError(f"lexical features of shape {tuple(lexical.shape)} for scores {tuple(scores.shape)}")
            scores = scores + self.lexical_weight.to(scores.dtype) * lexical.to(scores.device, scores.dtype)
        if self.feature_weight is not None and features is not None:
            if features.shape != (*scores.shape, self.feature_weight.numel()):
                raise ValueError(f"candidate features of shape {tuple(features.shape)} for scores "
                                 f"{tuple(scores.shape)} and {self.feature_weight.numel()} feature weights")
            scores = scores + features.to(scores.device, scores.dtype) @ self.feature_weight.to(scores.dtype)
        return scores

    # ---- training path -------------------------------------------------------------------
    def forward(self, queries: Tensor, memories: Tensor, lexical: Tensor | None = None,
                features: Tensor | None = None) -> Tensor:
        """Scores `[B, K]` in the plain Eq. 1 form (autograd flows to `W_q`, `W_m`, `w` and `v`);
        `lexical` [B, K] and `features` [B, K, F] as `stack_lexical` / `stack_features` give them."""
        q = queries + self.W_q(queries)
        m = memories + self.W_m(memories)
        return self._plus_extensions((m @ q.unsqueeze(-1)).squeeze(-1), lexical, features)

    def policy_scores(self, queries: Tensor, memories: Tensor, lexical: Tensor | None = None,
                      features: Tensor | None = None) -> Tensor:
        """Same scores and gradients as `forward`, computed query-side (what the learner uses).

        `m'·q' = (m + m W_mᵀ)·q' = m·(q' + q' W_m)`: the memory transform moves onto the one
        query, so an update costs B·d² instead of B·K·d² multiply-adds.
        """
        q = queries + self.W_q(queries)
        u = q + q @ self.W_m.weight
        return self._plus_extensions((memories @ u.unsqueeze(-1)).squeeze(-1), lexical, features)

    # ---- inference path ------------------------------------------------------------------
    def query_matrix(self) -> Tensor:
        """The folded transform `A = (I+W_q)ᵀ (I+W_m)`, so that `scores = (q @ A)·m`."""
        eye = torch.eye(self.dim, device=self.W_q.weight.device, dtype=self.W_q.weight.dtype)
        return (eye + self.W_q.weight).T @ (eye + self.W_m.weight)

    def _cache_key(self, device: torch.device, dtype: torch.dtype) -> tuple:
        # `_version` moves with in-place writes through autograd-visible ops (load_state_dict's copy_,
        # SGD, foreach Adam) but not with torch's fused Adam kernel, which writes the weights without it:
        # `rmm.policy.optimizer.make_optimizer`'s optimizers move it after every step (a step post-hook),
        # and whoever steps a fused optimizer of their own calls `invalidate()` (as the learner does
        # after each step regardless).
        # data_ptr catches `.data` being swapped for another tensor; a registry refresh or install,
        # and a checkpoint load, build a new reranker (an empty cache).
        wq, wm = self.W_q.weight, self.W_m.weight
        return (wq._version, wm._version, wq.data_ptr(), wm.data_ptr(), device, dtype)

    def invalidate(self) -> None:
        """Drop the folded query transform: needed after writing the weights in place by any means that
        leaves their `_version` alone (a fused optimizer not made by `make_optimizer`; its optimizers
        and `load_state_dict` need not). The learner calls it after each optimizer step regardless."""
        self._folded = None
        self._served = (None, 0)

    def transform_queries(self, queries: Tensor) -> Tensor:
        """`q @ A` without gradients, `A` folded and cached once the weights hold still.

        Folding costs d³ — as much as transforming d/2 queries the unfolded way
        (`(q (I+W_q)ᵀ)(I+W_m)`, 2·d² each). While the learner updates every few turns, refolding
        after each step would dominate a turn, so `A` is only built once the current weights
        have served d/2 query rows (rent-or-buy: never more than twice the better choice).
        """
        key = self._cache_key(queries.device, queries.dtype)
        with torch.no_grad():
            if self._folded is not None and self._folded[0] == key:
                return queries @ self._folded[1]
            if self._served[0] != key:
                self._served = (key, 0)
            served = self._served[1] + queries.numel() // self.dim
            self._served = (key, served)
            if served >= max(1, self.dim // 2):
                self._folded = (key, self.query_matrix().to(queries.device, queries.dtype))
                return queries @ self._folded[1]
            wq, wm = self.W_q.weight, self.W_m.weight
            if wq.device != queries.device or wq.dtype != queries.dtype:
                wq, wm = wq.to(queries.device, queries.dtype), wm.to(queries.device, queries.dtype)
            transformed = queries + queries @ wq.T
            return transformed + transformed @ wm

    def fast_scores(self, queries: Tensor, memories: Tensor, lexical: Tensor | None = None,
                    features: Tensor | None = None) -> Tensor:
        """Scores `[B, K]` through the folded query (no gradients); equal to `forward`."""
        transformed = self.transform_queries(queries)
        with torch.no_grad():
            return self._plus_extensions((memories @ transformed.unsqueeze(-1)).squeeze(-1), lexical, features)

    @torch.no_grad()
    def select(
        self,
        candidates: Sequence[Candidates],
        m: int,
        tau: float = 0.5,
        explore: bool = False,
        generator: torch.Generator | None = None,
        exclude: Sequence[Collection[str]] | None = None,
    ) -> list[Selection]:
        """Rerank each candidate list and pick its top-M (Gumbel-sampled when `explore`).

        A list with fewer than `m` candidates yields all of them, ordered. `logp` is the detached
        Plackett–Luce log-probability of the picks under `scores/tau` — the behaviour policy μ a
        delayed update corrects for (None when not exploring: greedy picks have no sampling
        probability worth reporting). Each Selection records `tau` and the weights `version`.
        `exclude[i]` holds memory ids list i must not show: they are masked before the top-M and
        left out of the returned Selection (module docstring), which may then have fewer than `m`
        picks.
        """
        if m < 0:
            raise ValueError(f"m must be >= 0, got {m}")
        if explore and not tau > 0:
            raise ValueError(f"temperature tau must be > 0, got {tau}")
        if not candidates:
            return []
        weight = self.W_q.weight
        queries, memories, mask = stack_candidates(candidates, self.dim, weight.device, weight.dtype)
        allowed = _allowed(candidates, mask, exclude)
        # without exclusions a row's allowed candidates are its real ones: no reduction needed
        counts = [len(c) for c in candidates] if exclude is None else allowed.sum(-1).tolist()
        k_max = memories.shape[1]
        m_batch = min(m, max(counts, default=0))
        lexical = None if self.lexical_weight is None else stack_lexical(lexical_of(candidates), k_max, weight.device, weight.dtype)
        features = None if self.feature_weight is None else stack_features(
            features_of(candidates, self._feature_names), k_max, len(self._feature_names), weight.device, weight.dtype)
        if k_max == 0 or m_batch == 0:  # nothing to pick from, or nothing asked for
            scores = (self.fast_scores(queries, memories, lexical, features).cpu() if k_max
                      else torch.zeros(len(candidates), 0))
            chosen = torch.zeros(len(candidates), 0, dtype=torch.long)
            noise = torch.zeros_like(scores) if explore else None
            logp = torch.zeros(len(candidates), 0) if explore else None
        else:
            # Scoring, noise, top-M and log π in one call: on CPU with every row full and nothing
            # excluded, `rerank_rows` on the rows as they are (the torch reference's ops minus its gather,
            # bit for bit); otherwise the dispatched `rerank` — the Triton kernel on CUDA, the torch
            # reference elsewhere (on CPU the same draws from `generator` as rmm.policy.sampling), with
            # the padded [B, K, d] block as the bank and padding ids -1, so short rows' surplus picks
            # come back -1 and are cut off below.
            transformed = self.transform_queries(queries)
            if lexical is not None:  # w·f as one more dimension: [q A, w]·[m, f]
                w = self.lexical_weight.detach().to(transformed.dtype).expand(transformed.shape[0], 1)
                transformed = torch.cat([transformed, w], -1)
                memories = torch.cat([memories, lexical.unsqueeze(-1)], -1)
            if features is not None:  # x·v as F more dimensions: [q A, (w,) v]·[m, (f,) x]
                v = self.feature_weight.detach().to(transformed.dtype).expand(transformed.shape[0], -1)
                transformed = torch.cat([transformed, v], -1)
                memories = torch.cat([memories, features], -1)
            if exclude is None and min(counts) == k_max and _rows_path(memories, m_batch):
                # every row full, nothing masked, torch backend: the step on the rows as they are
                ranked = rerank_rows(transformed, _aligned(memories), m_batch, tau if explore else 1.0,
                                     explore=explore, generator=generator)
            else:
                bank = memories.reshape(-1, memories.shape[-1])
                slots = torch.arange(bank.shape[0], device=bank.device).view(memories.shape[:2])
                if min(len(c) for c in candidates) < k_max:  # short rows: their padding is id -1
                    slots = slots.masked_fill(~mask, -1)
                ranked = rerank(transformed, bank, slots, m_batch,
                                tau if explore else 1.0, explore=explore, generator=generator,
                                mask=None if exclude is None else allowed)
            scores, chosen = _on_cpu(ranked.scores), _on_cpu(ranked.indices)
            noise = None if ranked.noise is None else _on_cpu(ranked.noise)
            logp = _on_cpu(ranked.logp) if explore else None
        out: list[Selection] = []
        chosen_lists = chosen.tolist()
        for i, c in enumerate(candidates):
            m_i = min(m, counts[i])
            picks = chosen_lists[i][:m_i]
            kept: slice | list[int] | None = slice(0, len(c)) if len(c) < k_max else None  # None: the whole row
            if counts[i] < len(c):  # some were excluded: keep only the candidates the sample drew from
                kept = allowed[i, : len(c)].nonzero().flatten().tolist()
                position = {old: new for new, old in enumerate(kept)}
                c, picks = candidate_subset(c, kept), [position[j] for j in picks]
            out.append(
                Selection(
                    candidates=c,
                    chosen=picks,
                    scores=_row(scores, i, kept),
                    logp=None if logp is None else (logp[i] if m_i == logp.shape[1] else logp[i, :m_i]),
                    noise=None if noise is None else _row(noise, i, kept),
                    explore=explore,
                    tau=float(tau),
                    version=self.version,
                )
            )
        return out

