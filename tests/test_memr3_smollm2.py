"""MemR³ end to end with a real small model (SmolLM2-135M-Instruct through hf:) on one LoCoMo question.

Quality is not judged: whatever the model writes, the question must run through retrieval, the
generate calls and the answer without crashing, within n_max + 1 calls, never showing a memory
twice and never crediting a memory that was not retrieved.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_goal_smollm2 import smollm2_agent

from rmm.frontends.memr3 import MemR3Config, MemR3Frontend
from rmm.frontends.memr3_trace import MemR3Trace

pytestmark = pytest.mark.slow


def test_smollm2_runs_the_memr3_loop_on_a_locomo_question(tmp_path: Path, data_root: Path, minilm_path: Path,
                                                          smollm2_gguf: Path) -> None:
    config = MemR3Config(n_max=2, n_chk=3, generate_tokens=200)
    with smollm2_agent(tmp_path, data_root, smollm2_gguf, dedup=True) as (agent, question):
        user = question.user_id
        response = MemR3Frontend(agent, config).respond(user, question.text, remember=False)
        learner = agent.learner(user)
        assert learner.stats.records + learner.stats.skipped_no_citation == len(response.selections)
    trace = response.trace
    assert isinstance(response.answer, str) and response.answer
    assert 2 <= trace.usage.calls <= config.max_calls and trace.usage.completion_tokens > 0
    assert len(trace.retrieved) == len(set(trace.retrieved)) <= config.n_max * config.n_chk
    assert {i for e in trace.evidence for i in e.memories} <= set(trace.retrieved)
    assert set(trace.cited) <= set(trace.retrieved)
    assert MemR3Trace.from_json(trace.to_json()) == trace
