"""Per-user training searches the bank as it stood at the questions' time (issue 35, item 4): a
memory of a later session changes neither which candidates a training question gets nor any of
their features (BM25's statistics, either half's ranks, the depth list's best cosine)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_online import config, hidden_feature_problem

from rmm.eval.benchmark_bank import fill
from rmm.memory.bank import MemoryBank
from rmm.memory.hybrid import HybridRetriever
from rmm.training.online import OnlineTrainer
from rmm.types import Memory


@pytest.mark.parametrize("hybrid", [True, False])
def test_a_memory_added_after_the_questions_time_cannot_change_its_candidates(tmp_path: Path, hybrid: bool) -> None:
    dataset, encoder = hidden_feature_problem(n_users=2, n_questions=8)
    with MemoryBank(tmp_path / "bank", encoder) as bank:
        fill(bank, dataset, "turn", progress=False)
        retriever = HybridRetriever(bank, candidate_features=True) if hybrid else bank
        trainer = OnlineTrainer(dataset, retriever, config(per_user=True, k=6), progress=False)
        train, visible = trainer.split.train, trainer.split.visible_sessions
        before = trainer.candidates(train, visible)
        q = train[0]
        late = dataset.sessions[q.user_id][-1]
        assert late.id not in visible[q.user_id]  # after every training question of this user
        text = f"{q.text} {q.text}"  # the question's words, twice, and its very vector
        encoder.table[text] = encoder.table[q.text]
        bank.add(q.user_id, [Memory(id="late", user_id=q.user_id, kind="turn", text=text, refs=[late.turns[0].id])])
        (now,) = retriever.search([q.text], q.user_id, 6)
        assert now.memory_ids[0] == "late"  # the whole bank's first candidate now
        after = trainer.candidates(train, visible)
        for question in train:
            b, a = before[question.id], after[question.id]
            assert a.memory_ids == b.memory_ids and len(a) == 6
            assert torch.equal(a.retriever_scores, b.retriever_scores)
            if hybrid:
                assert torch.equal(a.features, b.features) and torch.equal(a.lexical, b.lexical)
            else:
                assert a.features is None
