"""Every command refuses out-of-range or unknown flag values at parse time: exit 2, one `error:`
line on stderr naming the flag, no traceback, and nothing loaded or run."""

from __future__ import annotations

import pytest

import rmm.data
import rmm.llm
from rmm.cli import build_parser, main

CHAT = ["chat", "--bank", "b", "--user", "u", "--llm", "x"]

BAD = [
    (["eval", "--k", "0"], "--k"),
    (["eval", "--k", "-3"], "--k"),
    (["eval", "--k", "5", "ten"], "--k"),
    (["eval", "--index", "annoy"], "--index"),
    (["eval", "--merge-threshold", "2"], "--merge-threshold"),
    (["eval", "--batch-size", "0"], "--batch-size"),
    (["eval", "--device", "gpu"], "--device"),
    (["eval", "--granularity", "word"], "--granularity"),
    ([*CHAT, "--k", "0"], "--k"),
    ([*CHAT, "--m", "30"], "--m 30 must not exceed --k 20"),
    ([*CHAT, "--tau", "0"], "--tau"),
    ([*CHAT, "--budget", "0"], "--budget"),
    ([*CHAT, "--d-max", "-1"], "--d-max"),
    ([*CHAT, "--llm-threads", "0"], "--llm-threads"),
    ([*CHAT, "--frontend", "sideways"], "--frontend"),
    (["eval-qa", "--llm", "x", "--limit", "0"], "--limit"),
    (["eval-qa", "--llm", "x", "--k", "8", "--m", "9"], "--m 9 must not exceed --k 8"),
    (["eval-qa", "--llm", "x", "--granularity", "word"], "--granularity"),
    (["eval-controller", "--llm", "x", "--category", "0"], "--category"),
    (["eval-controller", "--llm", "x", "--b-max", "0"], "--b-max"),
    (["eval-controller", "--llm", "x", "--k", "3", "--m", "4"], "--m 4 must not exceed --k 3"),
    (["train", "--k", "0"], "--k"),
    (["train", "--k", "4"], "--m 5 must not exceed --k 4"),
    (["train", "--citer", "gpt4"], "--citer"),
    (["train", "--precision", "0"], "--precision"),
    (["train", "--recall", "1.5"], "--recall"),
    (["train", "--heldout", "1"], "--heldout"),
    (["train", "--epochs", "0"], "--epochs"),
    (["train", "--lr", "-1e-3"], "--lr"),
    (["train", "--tau", "nan"], "--tau"),
    (["train", "--update-every", "0"], "--update-every"),
    (["train", "--seed", "-1"], "--seed"),
    (["train", "--optimizer", "rmsprop"], "--optimizer"),
    (["train", "k=0"], "k: expected a positive integer, got 0 (from the overrides)"),
    (["train", "k=4"], "--m 5 must not exceed --k 4"),
    (["train", "no_such_option=1"], "no_such_option"),
    (["train", "--config", "/nonexistent/train.yaml"], "/nonexistent/train.yaml"),
    (["eval", "granularity=[word]"], "granularity"),
    (["eval", "--retriever", "bm25", "k=3"], "--retriever took 'k=3'"),
    (["quickstart", "--epochs", "0"], "--epochs"),
    (["pretrain", "epochs=0"], "epochs"),
    (["pretrain", "no_such_option=1"], "no_such_option"),
    (["serve", "--port", "0"], "--port"),
    (["serve", "--port", "70000"], "--port"),
    (["serve", "--max-batch", "0"], "--max-batch"),
    (["serve", "--max-wait-ms", "-5"], "--max-wait-ms"),
    (["serve", "--index", "annoy"], "--index"),
    (["llm", "serve", "some-model", "--port", "0"], "--port"),
    (["llm", "serve", "some-model", "--timeout", "0"], "--timeout"),
    (["data", "download", "squad"], "name"),
]


@pytest.fixture
def no_work(monkeypatch):
    """Loading a dataset or an LLM means the command started: fail loudly if it does."""

    def refuse(*args, **kwargs):
        raise AssertionError("the command started work before its flags were checked")

    monkeypatch.setattr(rmm.data, "load_dataset", refuse)
    monkeypatch.setattr(rmm.llm, "load_llm", refuse)


@pytest.mark.parametrize(("argv", "named"), BAD, ids=[" ".join(argv) for argv, _ in BAD])
def test_bad_values_are_one_error_line_before_any_work(argv, named, capsys, no_work) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if "error:" in line]
    assert len(errors) == 1, captured.err
    assert errors[0].startswith(f"rmm {argv[0]}") and named in errors[0]
    assert "Traceback" not in captured.err + captured.out and captured.out == ""


def test_train_takes_llm_citers_and_names_bad_specs(capsys) -> None:
    for spec in ("hf:/models/qwen", "vllm:/models/qwen", "openai:http://127.0.0.1:8000/v1@qwen", "simulated"):
        assert build_parser().parse_args(["train", "--citer", spec]).citer == spec  # issue 13: real generators
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--citer", "gpt4"])
    error = capsys.readouterr().err.splitlines()[-1]
    assert "unknown LLM spec 'gpt4'" in error and "openai:URL@MODEL" in error


def test_values_at_the_edges_of_their_ranges_parse() -> None:
    parser = build_parser()
    args = parser.parse_args(["train", "--k", "5", "--m", "5", "--heldout", "0.5", "--precision", "1",
                              "--recall", "0", "--citer", "simulated", "--device", "cuda:1", "--seed", "0"])
    assert (args.k, args.m, args.heldout, args.precision, args.recall, args.device) == (5, 5, 0.5, 1.0, 0.0, "cuda:1")
    args = parser.parse_args(["eval", "--k", "1", "10", "--merge-threshold", "-1", "--index", "faiss-hnsw"])
    assert (args.k, args.merge_threshold, args.index) == ([1, 10], -1.0, "faiss-hnsw")
    args = parser.parse_args(["eval-controller", "--llm", "x", "--d-max", "0", "--k", "3", "--m", "3"])
    assert (args.d_max, args.k, args.m) == (0, 3, 3)
    args = parser.parse_args(["serve", "--port", "65535", "--max-wait-ms", "0", "-vv"])
    assert (args.port, args.max_wait_ms, args.verbose) == (65535, 0.0, 2)


def test_llm_serve_takes_its_options_after_the_model_and_passes_only_what_follows_the_double_dash() -> None:
    args = build_parser().parse_args(["llm", "serve", "some-model", "--port", "9000", "--python", "/venv/bin/python",
                                      "--", "--max-model-len", "4096", "--port", "1"])
    assert (args.model, args.port, args.python) == ("some-model", 9000, "/venv/bin/python")
    assert args.vllm_args == ["--max-model-len", "4096", "--port", "1"]
    assert build_parser().parse_args(["llm", "serve", "some-model"]).vllm_args == []
