"""GOAL-MEM end to end with a real small model (SmolLM2-135M-Instruct through hf:) on one LoCoMo question.

Quality is not judged: the question must run through decomposition, retrieval, unification and
the answer without crashing, whatever the model writes, within the paper's call bound.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pytest

from rmm.eval.benchmark_bank import documents
from rmm.frontends.agent import Agent
from rmm.frontends.goal import GoalConfig, GoalFrontend
from rmm.frontends.trace import GoalTrace
from rmm.memory.bank import MemoryBank
from rmm.types import Question

pytestmark = pytest.mark.slow


@contextmanager
def smollm2_agent(tmp_path: Path, data_root: Path, smollm2_gguf: Path, *,
                  dedup: bool = False) -> Iterator[tuple[Agent, Question]]:
    """An agent answering with SmolLM2 over the first three sessions of the first multi-hop
    question's conversation, as turn memories (CPU time), and that question."""
    from rmm.data import load_locomo
    from rmm.encoders import load_encoder
    from rmm.llm.hf import HFLLM

    llm = HFLLM(smollm2_gguf, device="cpu", threads=1)
    dataset = load_locomo(data_root / "locomo" / "locomo10.json", dedup=dedup)
    question = next(q for q in dataset.questions if q.category == 1)
    user = question.user_id
    small = replace(dataset, sessions={user: dataset.sessions[user][:3]})
    with MemoryBank(tmp_path / "bank", load_encoder("minilm", device="cpu"), device="cpu") as bank:
        bank.add(user, documents(small, user, "turn"))
        yield Agent(bank, llm, k=10, m=3, checkpoint_every=0), question


def test_smollm2_answers_a_multi_hop_locomo_question(tmp_path: Path, data_root: Path, minilm_path: Path,
                                                     smollm2_gguf: Path) -> None:
    config = GoalConfig(b_max=1, d_max=1, budget=12, max_subgoals=3)
    with smollm2_agent(tmp_path, data_root, smollm2_gguf) as (agent, question):
        user = question.user_id
        response = GoalFrontend(agent, config).respond(user, question.text, remember=False)
        learner = agent.learner(user)
        assert learner.stats.records + learner.stats.skipped_no_citation == len(response.selections)
    trace = response.trace
    assert isinstance(response.answer, str) and response.answer
    assert 2 <= trace.usage.calls <= config.max_calls and trace.usage.completion_tokens > 0
    assert len(trace.retrieved) <= config.budget
    assert GoalTrace.from_json(trace.to_json()) == trace
    print(f"SmolLM2 GOAL-MEM on {question.id}: {trace.outcome}, usage {trace.usage}")
