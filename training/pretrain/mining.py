"""Hard negatives: the top-ranked turns of the same user that are not gold for the question."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from rmm.encoders import Encoder
from rmm.training.pretrain.data import Pair, turn_texts
from rmm.types import Dataset


def mine_hard_negatives(encoder: Encoder, dataset: Dataset, pairs: Sequence[Pair], k: int,
                        skip: int = 0) -> dict[int, list[str]]:
    """Pair index → texts of the top-ranked turns of the same user that are not gold for its question."""
    by_user: dict[str, list[int]] = defaultdict(list)
    for i, pair in enumerate(pairs):
        by_user[pair.user].append(i)
    negatives: dict[int, list[str]] = {}
    for user, indices in by_user.items():
        turns = list(dict.fromkeys(turn_texts(dataset, user).values()))
        passages = encoder.encode_passages(turns)
        questions = list(dict.fromkeys(pairs[i].query for i in indices))
        scores = encoder.encode_queries(questions) @ passages.T
        ranked = {q: scores[row].argsort(descending=True).tolist() for row, q in enumerate(questions)}
        for i in indices:
            gold = pairs[i].gold_passages
            candidates = [turns[j] for j in ranked[pairs[i].query] if turns[j] not in gold]
            negatives[i] = candidates[skip:skip + k]
    return negatives
