"""Learning without gold: questions without gold turn ids train the reranker from a real
generator's citations; the report measures them by what needs no gold (cited ratio, reward per
shown slot, the reward curve) and says that recall needs gold."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import openai
import pytest
from fake_generators import FakeOpenAIServer
from test_online_generator import tiny  # noqa: F401 - the tiny bag-of-words bank fixture

from rmm.cli import main
from rmm.data import load_dataset
from rmm.data.jsonl import dataset_records, write_jsonl
from rmm.training.online import OnlineConfig, OnlineTrainer
from rmm.types import Dataset


@pytest.fixture
def no_retry_sleep(monkeypatch):
    async def sleep(seconds: float) -> None:
        pass

    monkeypatch.setattr(openai._base_client.anyio, "sleep", sleep)


@pytest.fixture
def server():
    fake = FakeOpenAIServer(slow_s=0.01, fast_s=0.0)
    yield fake
    fake.close()


def without_gold(dataset: Dataset, keep_every: int = 0) -> Dataset:
    """The dataset with the gold of every question removed (of all but every `keep_every`-th)."""
    questions = [q if keep_every and i % keep_every == 0 else
                 dataclasses.replace(q, evidence_turns=[], evidence_sessions=[])
                 for i, q in enumerate(dataset.questions)]
    return dataclasses.replace(dataset, questions=questions)


def config(citer: str, **kw) -> OnlineConfig:
    return OnlineConfig(**{"citer": citer, "k": 8, "m": 3, "heldout_fraction": 0.34, "tau": 0.1,
                           "baseline": "mean", "lr": 1e-2, "concurrency": 4, **kw})


def test_a_real_citer_trains_on_questions_without_gold(tiny, server, no_retry_sleep):
    dataset, bank = tiny
    mixed = without_gold(dataset, keep_every=2)
    trainer = OnlineTrainer(mixed, bank, config(f"openai:{server.url}@fake-model"), progress=False)
    gold_free = [q for _, q in trainer.stream if not q.evidence_turns]
    assert gold_free and len(gold_free) < len(trainer.stream)  # both kinds train
    assert all(q.evidence_turns for q in trainer.split.heldout)  # held out = measured, and only gold measures
    report = trainer.run()
    r = report.rewards
    assert report.learner["records"] == r["rewarded"] == len(report.cited_ratio) > 0
    assert 0 < r["rewarded_without_gold"] < r["rewarded"] and r["cited_ratio_without_gold"] is not None
    assert len(r["reward_per_slot"]) == 3 and all(-1 <= v <= 1 for v in r["reward_per_slot"])
    assert len(r["reward_curve"]) == r["rewarded"] and r["mean_reward_first"] is not None
    assert r["without_gold_trained"] == len(gold_free)
    # prequential recall covers the gold questions only
    assert report.questions["train"] == len(trainer.stream) - len(gold_free)
    assert 0 < report.retriever["n"] <= report.questions["train"]  # (LoCoMo's category 5 is reported apart)
    assert "need gold" in r["recall"]


def test_the_simulated_citer_needs_gold_and_leaves_them_out(tiny):
    dataset, bank = tiny
    mixed = without_gold(dataset, keep_every=2)
    trainer = OnlineTrainer(mixed, bank, config("simulated"), progress=False)
    assert all(q.evidence_turns for _, q in trainer.stream)
    report = trainer.run()
    assert report.questions["without_gold_trained"] == 0 and report.rewards["rewarded_without_gold"] == 0


def test_reward_figures_survive_a_resume(tiny, server, no_retry_sleep, tmp_path):
    dataset, bank = tiny
    data = without_gold(dataset)
    run = tmp_path / "run"
    cfg = config(f"openai:{server.url}@fake-model", checkpoint_every=2)
    first = OnlineTrainer(data, bank, cfg, output_dir=run, progress=False)
    first.run()
    state = json.loads((run / "state.json").read_text())
    assert len(state["mean_reward"]) == len(state["rewarded_gold"]) == len(state["cited_ratio"]) > 0
    again = OnlineTrainer(data, bank, cfg, output_dir=run, progress=False)
    report = again.run()  # nothing left to ask: the figures come from state.json
    assert report.rewards["rewarded"] == len(state["mean_reward"]) and sum(state["slots"]["shown"]) > 0


def test_train_command_on_a_jsonl_file_without_gold(tiny_data_dir, tmp_path, server, no_retry_sleep, monkeypatch,
                                                    capsys):
    """`rmm train --dataset jsonl:PATH --citer openai:…` on a file whose questions have no gold."""
    monkeypatch.setenv("RMM_CACHE_DIR", str(tmp_path / "cache"))
    data = tmp_path / "logs.jsonl"
    records = [r for r in dataset_records(load_dataset("locomo", data_dir=tiny_data_dir)) if r["type"] != "question"
               or r["category"] != 5]
    for record in records:
        if record["type"] == "question":
            del record["gold_turns"], record["gold_sessions"], record["category"], record["category_name"]
    write_jsonl(records, data)
    out = tmp_path / "train.json"
    code = main(["train", "--dataset", f"jsonl:{data}", "--device", "cpu", "--citer",
                 f"openai:{server.url}@fake-model", "--k", "8", "--m", "3", "--heldout", "0.34", "--concurrency",
                 "3", "--json", str(out)])
    printed = " ".join(capsys.readouterr().out.split())
    assert code == 0, printed
    report = json.loads(out.read_text())
    r = report["rewards"]
    assert r["rewarded"] == r["rewarded_without_gold"] == report["learner"]["records"] > 0
    assert report["questions"]["scorable"] == 0 and report["questions"]["without_gold_trained"] > 0
    assert "rewards, measured without gold" in printed and "reward per shown slot" in printed
    assert "need gold turn ids" in printed and "trained from the citations alone" in printed
    assert "no recall table" in printed and "nan" not in printed
