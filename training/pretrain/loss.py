"""InfoNCE over in-batch and hard negatives, with the cross-device gather that makes it exact under DDP.

Each rank embeds its shard, embeddings are all-gathered with a differentiable gather (its backward
sums the gradients of every rank's loss into the shard that produced them), each rank's loss is the
mean over its own queries against all gathered passages, and DDP averages the parameter gradients
over ranks — which together is exactly the gradient of the mean loss over the global batch (see
`contrastive_loss` and its fake-world and two-process tests).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def gather_embeddings(tensor: Tensor) -> tuple[Tensor, int]:
    """All ranks' rows concatenated in rank order, and this rank's index.

    The gather is differentiable (`torch.distributed.nn.functional.all_gather`): its backward
    sums, into each rank's shard, the gradients that every rank's loss sends to that shard.
    Single process: the tensor itself, rank 0.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return tensor, 0
    from torch.distributed.nn.functional import all_gather

    return torch.cat(all_gather(tensor.contiguous()), dim=0), dist.get_rank()


def contrastive_logits(queries: Tensor, positives_all: Tensor, negatives_all: Tensor | None, rank: int,
                       scale: Tensor | float) -> tuple[Tensor, Tensor]:
    """Logits of this rank's queries [B, d] against every gathered passage, and their labels.

    Columns: all ranks' positives (rank-major, B each) then all ranks' hard negatives; query i of
    rank r has its positive at column r·B + i.
    """
    columns = positives_all if negatives_all is None or negatives_all.numel() == 0 else torch.cat(
        [positives_all, negatives_all], dim=0)
    logits = (queries @ columns.T) * scale
    labels = torch.arange(queries.shape[0], device=queries.device) + rank * queries.shape[0]
    return logits, labels


def contrastive_loss(queries: Tensor, positives: Tensor, negatives: Tensor | None,
                     scale: Tensor | float) -> Tensor:
    """InfoNCE of this rank's queries; mean over its queries (DDP's gradient averaging completes
    the global mean — no rescaling by the world size, since the gather's backward sums)."""
    positives_all, rank = gather_embeddings(positives)
    negatives_all = gather_embeddings(negatives)[0] if negatives is not None and negatives.numel() else None
    logits, labels = contrastive_logits(queries, positives_all, negatives_all, rank, scale)
    return nn.functional.cross_entropy(logits.float(), labels)
