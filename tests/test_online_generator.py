"""Online training with a real generator's replies: many in flight, out of order, failures and resume;
and the simulated citer's reward delay."""

from __future__ import annotations

import json

import openai
import pytest
from fake_generators import FakeOpenAIServer
from fakes import BagOfWordsEncoder
from test_online import config, crash_then_resume, hidden_feature_problem

from rmm.data import load_dataset
from rmm.errors import LLMError
from rmm.eval.benchmark_bank import fill
from rmm.memory.bank import MemoryBank
from rmm.training.online import OnlineConfig, OnlineTrainer


@pytest.fixture
def tiny(tiny_data_dir, tmp_path):
    """The tiny LoCoMo-schema benchmark in a bag-of-words bank (fast, and words decide citations)."""
    dataset = load_dataset("locomo", data_dir=tiny_data_dir)
    bank = MemoryBank(tmp_path / "bank", BagOfWordsEncoder())
    fill(bank, dataset, "turn", progress=False)
    yield dataset, bank
    bank.close()


@pytest.fixture
def problem(tmp_path):
    dataset, encoder = hidden_feature_problem()
    bank = MemoryBank(tmp_path / "bank", encoder)
    fill(bank, dataset, "turn", progress=False)
    yield dataset, bank
    bank.close()


@pytest.fixture
def no_retry_sleep(monkeypatch):
    """The OpenAI client's backoff between retries returns at once (the retries still happen)."""
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    monkeypatch.setattr(openai._base_client.anyio, "sleep", sleep)
    return slept


def openai_config(server: FakeOpenAIServer, **kw) -> OnlineConfig:
    return OnlineConfig(**{"citer": f"openai:{server.url}@fake-model", "k": 8, "m": 3, "heldout_fraction": 0.34,
                           "tau": 0.1, "baseline": "mean", "lr": 1e-2, "concurrency": 4, "checkpoint_every": 3,
                           **kw})


def test_openai_generator_many_in_flight_out_of_order(tiny, no_retry_sleep):
    dataset, bank = tiny
    server = FakeOpenAIServer()
    try:
        trainer = OnlineTrainer(dataset, bank, openai_config(server), progress=False)
        report = trainer.run()
    finally:
        server.close()
    n = len(trainer.stream)
    assert n == len(trainer.split.train) > 8
    assert server.peak == 4  # `concurrency` requests in flight at once
    assert server.answered != server.arrived  # replies came back in another order than asked
    assert sorted(server.answered) == sorted(q.text for _, q in trainer.stream)  # each asked once
    gen = report.generation
    assert (gen["kind"], gen["model"], gen["concurrency"]) == ("openai", "fake-model", 4)
    assert gen["replies"] == gen["llm_calls"] == n
    assert gen["unusable"] == sum(1 for i in range(n) if i % 5 == 4) > 0  # every 5th reply has no citation
    assert gen["parse_failure_rate"] == pytest.approx(gen["unusable"] / n)
    assert gen["completion_tokens"] > 0 and gen["prompt_tokens"] > gen["completion_tokens"]
    assert gen["questions_per_second"] > 0 and gen["seconds_per_question"] > 0
    learner = report.learner
    assert learner["records"] + learner["skipped_no_citation"] == n
    assert learner["skipped_no_citation"] == gen["unusable"]
    assert len(report.cited_ratio) == learner["records"]
    assert report.citer == f"openai:{server.url}@fake-model"
    # The fake cites memories sharing a word with the question, i.e. mostly the gold turn: it is learned.
    assert report.reranker_prequential["n"] == report.retriever["n"] > 0


def test_server_killed_mid_run_stops_cleanly_and_a_restart_resumes(tiny, tmp_path, no_retry_sleep):
    """Retries, then one error line and a checkpoint; the resumed run re-asks what was in flight and
    rewards every training question exactly once."""
    dataset, bank = tiny
    server = FakeOpenAIServer(die_after=7)
    out = tmp_path / "run"
    try:
        with pytest.raises(LLMError) as failed:
            OnlineTrainer(dataset, bank, openai_config(server), output_dir=out, progress=False).run()
        message = str(failed.value)
        assert "\n" not in message and "failed after 6 tries" in message
        assert "stopped after" in message and f"checkpoint in {out}" in message
        assert len(no_retry_sleep) >= 5  # the client's retries ran
        state = json.loads((out / "state.json").read_text())
        done_before = state["done"]["below"] + len(state["done"]["beyond"])
        assert 0 < done_before < 18

        asked_before = sum(server.asked.values())
        assert asked_before > done_before  # some requests were in flight when the server died
        server.restart()
        trainer = OnlineTrainer(dataset, bank, openai_config(server), output_dir=out, progress=False)
        report = trainer.run()
    finally:
        server.close()
    n = len(trainer.stream)
    assert len(trainer.done) == n
    learner = report.learner
    assert learner["records"] + learner["skipped_no_citation"] == n  # none lost, none twice
    assert report.generation["replies"] == n
    # The restarted run asked exactly the questions not yet rewarded: those in flight, and the rest.
    assert sum(server.asked.values()) - asked_before == n - done_before
    assert report.retriever["n"] == len({q.id for _, q in trainer.stream if q.category != 5})


def test_reward_delay_holds_rewards_for_that_many_updates(problem):
    dataset, bank = problem
    on_time = OnlineTrainer(dataset, bank, config(epochs=1), progress=False).run()
    late = OnlineTrainer(dataset, bank, config(epochs=1, delay=3), progress=False).run()
    assert on_time.staleness["mean_steps"] == 0 and on_time.staleness["delay"] == 0
    assert 2.5 <= late.staleness["mean_steps"] <= 3 and late.staleness["max_steps"] == 3
    assert late.learner["records"] == on_time.learner["records"] == len(late.cited_ratio)


def test_delayed_rewards_in_the_queue_are_asked_again_after_a_crash(problem, tmp_path, monkeypatch):
    dataset, bank = problem
    cfg = config(epochs=1, delay=2, checkpoint_every=5)
    resumed = crash_then_resume(dataset, bank, cfg, tmp_path / "run", monkeypatch, after=33)
    report = resumed.run()
    n = len(resumed.stream)
    assert len(resumed.done) == n
    assert report.learner["records"] + report.learner["skipped_no_citation"] == n


def test_unknown_citer_kinds_are_refused():
    with pytest.raises(ValueError, match="citer"):
        OnlineConfig(citer="gpt")
    with pytest.raises(ValueError, match="concurrency"):
        OnlineConfig(citer="openai:http://x/v1@m", concurrency=0)
    assert OnlineConfig(citer="hf:/models/tiny").citer == "hf:/models/tiny"


def test_ctrl_c_with_requests_in_flight_checkpoints_and_the_resumed_run_reasks_them(tiny, tmp_path, no_retry_sleep,
                                                                                    monkeypatch):
    dataset, bank = tiny
    server = FakeOpenAIServer()
    out = tmp_path / "run"
    try:
        interrupted = OnlineTrainer(dataset, bank, openai_config(server, checkpoint_every=100), output_dir=out,
                                    progress=False)
        real_answer, answered = interrupted.answer, []

        def ctrl_c_after_six(asked, reply):
            if len(answered) == 6:
                raise KeyboardInterrupt
            answered.append(asked.index)
            real_answer(asked, reply)

        monkeypatch.setattr(interrupted, "answer", ctrl_c_after_six)
        with pytest.raises(KeyboardInterrupt):
            interrupted.run()
        state = json.loads((out / "state.json").read_text())  # written on the way out, not by the schedule
        assert state["done"]["below"] + len(state["done"]["beyond"]) == 6
        asked_before = sum(server.asked.values())
        assert asked_before > 6  # others were in flight

        resumed = OnlineTrainer(dataset, bank, openai_config(server, checkpoint_every=100), output_dir=out,
                                progress=False)
        report = resumed.run()
    finally:
        server.close()
    n = len(resumed.stream)
    assert sum(server.asked.values()) - asked_before == n - 6
    assert report.learner["records"] + report.learner["skipped_no_citation"] == n
