"""Which questions train the online reranker and which are held out — without leaking.

Shared mode (one reranker for the bank) holds out whole users: nothing of a held-out user's
conversation is ever shown during training.

Per-user mode (one reranker per user) cannot hold out users, and holding out a user's *last
questions* leaks: a benchmark's questions are not in dialogue order, so a held-out question's
gold turns may have been shown — and rewarded — while training on an earlier question. Instead
each user's conversation is cut by dialogue time: training questions are those whose evidence
lies entirely in the sessions before the cut, and they retrieve only from memories of those
sessions (the bank as it stood then); held-out questions are those whose evidence lies entirely
in the later sessions. A question whose evidence spans both parts belongs to neither and is
dropped (counted). The cut is chosen per user so that the held-out share of the kept questions
is as close as possible to `heldout_fraction`. Sessions are taken in the order the dataset lists
them (dialogue order for LoCoMo and MSC).

An encoder pretrained by `rmm pretrain` records the users it trained on: a split that holds out
any of them is refused (`refuse_heldout_on_pretrained`), and pretraining chooses its held-out
users with the same function as the shared mode here (`hold_out_users`), so the defaults agree.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from rmm.encoders.encoder import Pretraining
from rmm.errors import PretrainedUsersError
from rmm.types import Dataset, Question

__all__ = ["Split", "SplitSettings", "hold_out_users", "pretraining_split_hint", "refuse_heldout_on_pretrained",
           "refuse_pretrained_users", "split_questions"]


class SplitSettings(Protocol):
    """What a split depends on (an `OnlineConfig` has these)."""

    per_user: bool
    heldout_fraction: float
    seed: int


@dataclass
class Split:
    """Which questions train and which are held out, printed so a reader can check it.

    `visible_sessions[user]` (per-user mode) names the sessions a user's training questions may
    retrieve from; users absent from it see their whole bank.
    """

    train: list[Question]
    heldout: list[Question]
    train_users: list[str]
    heldout_users: list[str]
    description: str
    dropped: list[Question] = field(default_factory=list)
    visible_sessions: dict[str, frozenset[str]] = field(default_factory=dict)


def split_questions(dataset: Dataset, questions: list[Question], settings: SplitSettings) -> Split:
    """The split of `questions` (already filtered to scorable ones) for one training run."""
    per_user, heldout_fraction, seed = settings.per_user, settings.heldout_fraction, settings.seed
    if not 0 < heldout_fraction < 1:
        raise ValueError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
    by_user: dict[str, list[Question]] = defaultdict(list)
    for q in questions:
        by_user[q.user_id].append(q)
    users = [u for u in dataset.users if by_user[u]]
    if per_user:
        return _by_dialogue_time(dataset, by_user, users, heldout_fraction)
    if len(users) < 2:
        raise ValueError("a shared reranker needs ≥ 2 users to hold one out; use per_user=True")
    held_ids, rest = hold_out_users(users, heldout_fraction, seed)
    kept = set(rest)
    held_users, train_users = sorted(held_ids), [u for u in users if u in kept]
    train = [q for u in train_users for q in by_user[u]]
    held = [q for u in held_users for q in by_user[u]]
    desc = (f"shared reranker: train on {', '.join(train_users)} ({len(train)} questions); "
            f"held out {', '.join(held_users)} ({len(held)} questions)")
    return Split(train, held, train_users, held_users, desc)


def hold_out_users(users: Sequence[str], fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """(held-out users, the rest): the one seeded choice of whole users to hold out.

    `rmm train` (shared mode) and `rmm pretrain` both call it, so an encoder pretrained with the
    same seed and fraction never trained on the users `rmm train` holds out. At least one user is
    held out and one kept. Both lists come in the seeded order; a caller that sets more users
    aside (pretraining's validation users) takes them from the front of the rest.
    """
    users = list(users)
    if len(users) < 2:
        raise ValueError(f"holding users out needs ≥ 2 users, got {len(users)}")
    shuffled = users[:]
    random.Random(seed).shuffle(shuffled)
    n_held = min(len(users) - 1, max(1, round(len(users) * fraction)))
    return shuffled[:n_held], shuffled[n_held:]


def split_users_in_order(users: Sequence[str], fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """(users trained on, users held out) by `hold_out_users`, each in the given order: what the
    benchmarks and `rmm eval-controller --users` list and score."""
    held = set(hold_out_users(users, fraction, seed)[0])
    return [u for u in users if u not in held], [u for u in users if u in held]


def refuse_pretrained_users(encoder: str, pretrained_on: Pretraining | None, dataset: str,
                            users: Sequence[str], remedy: str) -> None:
    """Raise `PretrainedUsersError` (one line naming them) when the encoder was pretrained on any of
    `users` of `dataset`: figures on them measure what it memorised, not retrieval for a new user."""
    seen = pretrained_on.seen(dataset, users) if pretrained_on is not None else []
    if seen:
        raise PretrainedUsersError(
            f"{encoder} was pretrained on {dataset} user{'s' if len(seen) > 1 else ''} {', '.join(seen)}: "
            f"figures on {'them' if len(seen) > 1 else 'it'} would not be held out; {remedy}")


def pretraining_split_hint(pretrained_on: Pretraining) -> str:
    """The flags of `rmm train` that hold out the users the encoder was pretrained without."""
    if pretrained_on.seed is None or pretrained_on.heldout_fraction is None:
        return "pick an encoder that was not pretrained on them"
    return (f"hold out the users its pretraining held out (--heldout {pretrained_on.heldout_fraction:g} "
            f"--seed {pretrained_on.seed}: {', '.join(pretrained_on.heldout)})")


def refuse_heldout_on_pretrained(encoder: object, dataset: str, split: Split, per_user: bool) -> None:
    """Refuse a split whose held-out users the encoder was pretrained on (`Encoder.pretrained_on`);
    an encoder without a record (a preset, any HF folder) passes."""
    record = getattr(encoder, "pretrained_on", None)
    if record is None:
        return
    remedy = pretraining_split_hint(record)
    if per_user:
        remedy = ("per-user mode holds out later questions of every user: train the shared reranker "
                  f"(without --per-user) and {remedy}")
    config = getattr(encoder, "config", None)
    name = str(getattr(config, "model_path", None) or getattr(encoder, "name", "the encoder"))
    refuse_pretrained_users(name, record, dataset, split.heldout_users, remedy)


def _evidence_sessions(dataset: Dataset, user: str) -> dict[str, int]:
    """Turn id → index of its session in the user's dialogue order."""
    return {t.id: i for i, s in enumerate(dataset.sessions[user]) for t in s.turns}


def _session_span(q: Question, turn_session: dict[str, int], session_index: dict[str, int]) -> tuple[int, int] | None:
    """(first, last) session index of the question's evidence, or None when none is known."""
    indices = [turn_session[t] for t in q.evidence_turns if t in turn_session]
    indices += [session_index[s] for s in q.evidence_sessions if s in session_index]
    return (min(indices), max(indices)) if indices else None


def _by_dialogue_time(dataset: Dataset, by_user: dict[str, list[Question]], users: list[str],
                      fraction: float) -> Split:
    train: list[Question] = []
    held: list[Question] = []
    dropped: list[Question] = []
    visible: dict[str, frozenset[str]] = {}
    kept_users: list[str] = []
    too_short: list[str] = []
    for user in users:
        sessions = dataset.sessions[user]
        turn_session = _evidence_sessions(dataset, user)
        session_index = {s.id: i for i, s in enumerate(sessions)}
        spans = [(q, _session_span(q, turn_session, session_index)) for q in by_user[user]]
        best: tuple[float, int, int] | None = None  # (distance to the fraction, dropped, cut)
        for cut in range(1, len(sessions)):
            n_train = sum(1 for _, s in spans if s is not None and s[1] < cut)
            n_held = sum(1 for _, s in spans if s is not None and s[0] >= cut)
            if n_train == 0 or n_held == 0:
                continue
            n_dropped = len(spans) - n_train - n_held
            candidate = (abs(n_held / (n_train + n_held) - fraction), n_dropped, cut)
            if best is None or candidate < best:
                best = candidate
        if best is None:
            too_short.append(user)
            dropped += by_user[user]
            continue
        cut = best[2]
        kept_users.append(user)
        visible[user] = frozenset(s.id for s in sessions[:cut])
        for q, span in spans:
            if span is not None and span[1] < cut:
                train.append(q)
            elif span is not None and span[0] >= cut:
                held.append(q)
            else:
                dropped.append(q)
    if not kept_users:
        raise ValueError("per-user mode needs users whose questions' evidence lies in different sessions "
                         "(a cut by dialogue time); no user has any")
    spanning = len(dropped) - sum(len(by_user[u]) for u in too_short)
    desc = (f"per-user, cut by dialogue time: a question trains when its evidence lies in a user's earlier sessions "
            f"(retrieving only from those), is held out when it lies in the later ones "
            f"(aiming at {fraction:.0%} held out): {len(train)} / {len(held)} questions, {len(kept_users)} users; "
            f"{spanning} dropped because their evidence spans both parts")
    if too_short:
        desc += f"; {len(too_short)} users without such a cut left out ({len(dropped) - spanning} questions)"
    return Split(train, held, kept_users, kept_users, desc, dropped, visible)
