"""Off-policy evaluation: would these reranker weights have done better on the traffic already logged?

Every selection rmm samples with `explore=true` keeps what an estimate needs: the K candidates as
scored, μ's scores and τ (so μ's probability of showing *any* candidate can be computed), the
log-probability of each pick, and the per-pick rewards from citations (+1 cited, −1 shown and not
cited). `evaluate(rows, target)` turns those into the value of a target policy π — the expected
reward per shown memory and the expected number of cited memories per retrieval — by several
estimators, each with a bootstrap interval and an effective sample size (`rmm.ope.estimators`):

| estimator | what it weights | assumes | fails when |
| --- | --- | --- | --- |
| `ips` (item-level) | each shown memory by P_π(i ∈ top M)/P_μ(i ∈ top M) | a memory's reward depends on the query and that memory only, not on its slate-mates or its position; overlap: P_μ(i ∈ top M) > 0 wherever P_π(i ∈ top M) > 0 | the generator cites one of two near-duplicates (slate-mates interact), or cites the first shown more (position bias): then it is biased; large weights (π far from μ) make it noisy |
| `snips` | the same, divided by the weights' sum (its expectation is M) | as `ips` | consistent, not unbiased: a small bias at small n, usually much less variance |
| `ips-clipped` | weights capped at `clip` | as `ips` | biased towards 0 by the mass above the cap (reported: the fraction clipped) |
| `dr` (doubly robust) | r̂ for every candidate under π, plus the weighted residual r − r̂ of the shown ones; r̂ cross-fitted (`rmm.ope.reward_model`) | as `ips`; unbiased if the propensities are right whatever r̂ is | as `ips`; its interval holds r̂ fixed |
| `slate` | the whole ordered slate by π(S)/μ(S) | overlap of ordered slates only: rewards may depend on the whole slate and its order | high variance: one ratio of M picks' probabilities; nearly useless once π differs much from μ (its ESS says so) |
| `logged` | nothing: μ's own mean | nothing | — (the figure a target must beat) |

All of them also assume the logs are what they say: μ's scores, τ and picks as sampled (checked:
`behaviour_mismatch` recomputes log μ of the picks from the stored scores), rewards that do not
depend on which policy chose the slate beyond the slate itself, and selections independent of each
other (the bootstrap resamples selections). Inclusion probabilities of the Plackett–Luce top M are
exact for small K·M and Monte Carlo beyond (`rmm.ope.inclusion`, which states its sample count and
standard error). When π's inclusion mass falls where μ could not show (zero overlap) or the
weights' effective sample size is too small, `evaluate` refuses (`OverlapError`) instead of
returning a number.

Layer 3: it scores candidates through `rmm.policy`'s reranker and sampling; reading logs from
`rmm serve`'s stores is the command's (`rmm.cli.ope`).
"""

from rmm.ope.estimators import ASSUMPTIONS, Estimate, OpeReport, OverlapError, evaluate, row_weights
from rmm.ope.inclusion import EXACT_LIMIT, exact_inclusion, inclusion, monte_carlo_inclusion
from rmm.ope.logs import (
    LoggedSelection,
    RerankerTarget,
    TargetPolicy,
    UniformTarget,
    behaviour_mismatch,
    logged_from_selection,
    retriever_target,
)

__all__ = ["ASSUMPTIONS", "EXACT_LIMIT", "Estimate", "LoggedSelection", "OpeReport", "OverlapError",
           "RerankerTarget", "TargetPolicy", "UniformTarget", "behaviour_mismatch", "evaluate", "exact_inclusion",
           "inclusion", "logged_from_selection", "monte_carlo_inclusion", "retriever_target", "row_weights"]
