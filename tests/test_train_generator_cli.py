"""`rmm train --citer <a real generator>` end to end: a tiny random-weight hf: model (every reply
gibberish, counted and skipped), and an openai: server that dies mid-run and is restarted."""

from __future__ import annotations

import json

import openai
import pytest
from fake_generators import FakeOpenAIServer, build_tiny_chat_model

from rmm.cli import main
from rmm.cli.train import CREDIT_FORMS
from rmm.policy.credit import CREDITS


@pytest.fixture(autouse=True, scope="module")
def isolated_cache(tmp_path_factory):
    """One cache for the module: the tiny benchmark's bank is built once, not per test."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RMM_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        yield


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory, minilm_path):
    return build_tiny_chat_model(tmp_path_factory.mktemp("tiny-llama"), minilm_path)


def test_train_with_a_tiny_hf_model_counts_unusable_replies(tiny_data_dir, tiny_chat_model, tmp_path, capsys):
    out, png = tmp_path / "train.json", tmp_path / "curves.png"
    code = main(["train", "--data-dir", str(tiny_data_dir), "--citer", f"hf:{tiny_chat_model}", "--k", "8",
                 "--heldout", "0.34", "--llm-batch", "6", "--max-tokens", "6", "--llm-threads", "1", "--structured",
                 "--device", "cpu", "--json", str(out), "--plot", str(png)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    report = json.loads(out.read_text())
    gen = report["generation"]
    assert (gen["kind"], gen["model"], gen["questions_per_call"], gen["concurrency"]) == ("hf", str(tiny_chat_model),
                                                                                          6, 6)
    n = report["learner"]["records"] + report["learner"]["skipped_no_citation"]
    assert gen["replies"] == gen["llm_calls"] == n > 0
    assert gen["unusable"] == report["learner"]["skipped_no_citation"]  # gibberish is skipped, never guessed
    assert 0 <= gen["parse_failure_rate"] <= 1 and gen["completion_tokens"] > 0 and gen["prompt_tokens"] > 0
    assert report["citer"] == f"hf:{tiny_chat_model} (structured)" and gen["structured"]
    assert "recall@5" in report["reranker_heldout"] and png.read_bytes()[:4] == b"\x89PNG"
    assert "generator hf" in printed and "unusable" in printed and "questions/s" in printed


def test_train_against_a_dying_openai_server_stops_cleanly_and_resumes(tiny_data_dir, tmp_path, capsys,
                                                                      monkeypatch):
    async def no_sleep(seconds: float) -> None:  # the client's backoff between retries
        pass

    monkeypatch.setattr(openai._base_client.anyio, "sleep", no_sleep)
    server = FakeOpenAIServer(die_after=5)
    run = tmp_path / "run"
    argv = ["train", "--data-dir", str(tiny_data_dir), "--citer", f"openai:{server.url}@fake-model", "--k", "8",
            "--heldout", "0.34", "--concurrency", "3", "--output", str(run), "--json", str(tmp_path / "r.json")]
    try:
        assert main(argv) == 2
        printed = capsys.readouterr().out
        error_lines = [line for line in printed.splitlines() if line.startswith("error:")]
        assert len(error_lines) == 1 and "Traceback" not in printed
        flat = " ".join(printed.split())  # the console wraps the one error line at its width
        assert "failed after 6 tries" in flat and "run the same command to resume" in flat
        assert (run / "state.json").exists()
        server.restart()
        assert main(argv) == 0, capsys.readouterr().out
    finally:
        server.close()
    report = json.loads((tmp_path / "r.json").read_text())
    learner, gen = report["learner"], report["generation"]
    assert learner["records"] + learner["skipped_no_citation"] == gen["replies"]
    assert gen["replies"] == sum(c["n"] for c in report["retriever"]["by_category"].values())  # every question once
    assert gen["concurrency"] == 3 and gen["kind"] == "openai"


def test_generator_flags_are_config_keys_and_credit_forms_match_the_learner(tiny_data_dir, tmp_path):
    assert CREDIT_FORMS == CREDITS
    config = tmp_path / "train.yaml"
    config.write_text("delay: 2\nno_is: true\ncredit: sequence\nis_clip: 2.0\nlimit: 6\nconcurrency: 2\n")
    out = tmp_path / "train.json"
    assert main(["train", "--config", str(config), "--data-dir", str(tiny_data_dir), "--k", "8", "--heldout", "0.34",
                 "--json", str(out)]) == 0
    cfg = json.loads(out.read_text())["config"]
    assert (cfg["delay"], cfg["importance"], cfg["credit"], cfg["is_clip"], cfg["limit"], cfg["concurrency"]) == (
        2, False, "sequence", 2.0, 6, 2)
    assert json.loads(out.read_text())["learner"]["records"] == 6
