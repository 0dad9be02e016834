"""Training pairs: (question, gold turn as the bank stores it), and the split by user (conversation).

Splitting whole conversations keeps every held-out conversation unseen in training, so held-out
recall measures generalisation to new users, not memorisation of their turns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rmm.errors import DataError
from rmm.training.splits import hold_out_users
from rmm.types import Dataset


@dataclass(frozen=True)
class Pair:
    """One training example: a question and one of its gold turns (texts as the bank holds them)."""

    query: str
    passage: str
    user: str
    question_id: str
    passage_id: str
    gold_passages: frozenset[str]  # texts of all the question's gold turns (never its negatives)


@dataclass
class UserSplit:
    train: list[str]
    val: list[str]
    test: list[str]

    def describe(self) -> str:
        return (f"split by user: train {len(self.train)} ({', '.join(self.train)}); val {len(self.val)} "
                f"({', '.join(self.val) or '-'}); test {len(self.test)} ({', '.join(self.test)})")


def split_users(users: Sequence[str], val_fraction: float, test_fraction: float, seed: int) -> UserSplit:
    """Seeded split of whole users (conversations): at least one user trains and one is tested.

    The test users are `rmm train`'s held-out users for the same seed and fraction (one function,
    `hold_out_users`, chooses both), so `rmm train --retriever ENCODER` with its defaults never
    reports held-out figures on a conversation the encoder was pretrained on. Validation users
    come from the rest and are not trained on.
    """
    users = list(users)
    if len(users) < 2:
        raise DataError(f"pretraining needs ≥ 2 users (conversations) to hold one out, got {len(users)}")
    test, rest = hold_out_users(users, test_fraction, seed)
    n_val = min(len(rest) - 1, round(len(users) * val_fraction))
    if val_fraction > 0 and n_val == 0 and len(rest) >= 2:
        n_val = 1
    val, train = rest[:n_val], rest[n_val:]
    order = {u: i for i, u in enumerate(users)}
    return UserSplit(sorted(train, key=order.get), sorted(val, key=order.get), sorted(test, key=order.get))


def turn_texts(dataset: Dataset, user: str) -> dict[str, str]:
    """Turn id → the text the turn bank embeds (`rmm.eval.benchmark_bank.documents`, turn granularity)."""
    from rmm.eval.benchmark_bank import documents

    return {m.id: m.text for m in documents(dataset, user, "turn")}


def build_pairs(dataset: Dataset, users: Sequence[str]) -> list[Pair]:
    """One pair per (question, gold turn) of the given users; questions without gold turns skipped."""
    wanted = set(users)
    texts = {u: turn_texts(dataset, u) for u in users}
    pairs: list[Pair] = []
    for q in dataset.questions:
        if q.user_id not in wanted or q.abstention:
            continue
        gold = [t for t in dict.fromkeys(q.evidence_turns) if t in texts[q.user_id]]
        gold_texts = frozenset(texts[q.user_id][t] for t in gold)
        for turn_id in gold:
            pairs.append(Pair(q.text, texts[q.user_id][turn_id], q.user_id, q.id, turn_id, gold_texts))
    return pairs


def restrict(dataset: Dataset, users: Sequence[str]) -> Dataset:
    """The dataset limited to some users and their questions (keeps its name: same reporting rules)."""
    keep = set(users)
    return Dataset(name=dataset.name, sessions={u: s for u, s in dataset.sessions.items() if u in keep},
                   questions=[q for q in dataset.questions if q.user_id in keep], categories=dataset.categories)
