"""`rmm train` / `rmm eval --config FILE [key=value …]`: the shipped configs load through the
command's own parser, precedence is defaults < file < overrides < explicit flags, and a bad file
is one `error:` line naming the key and the file, before any work."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import yaml

import rmm.data
import rmm.llm
from rmm.cli import build_parser, main
from rmm.cli.arguments import CheckedParser
from rmm.cli.settings import add_config_options
from rmm.cli.train import quickstart_settings

REPO = Path(__file__).resolve().parents[1]
TRAIN_CONFIGS = sorted((REPO / "configs" / "train").glob("*.yaml"))
EVAL_CONFIGS = sorted((REPO / "configs" / "eval").glob("*.yaml"))
NOT_SETTINGS = {"func", "command", "config", "overrides"}


@pytest.fixture
def no_work(monkeypatch):
    """Loading a dataset or an LLM means the command started: fail loudly if it does."""

    def refuse(*args, **kwargs):
        raise AssertionError("the command started work before its settings were checked")

    monkeypatch.setattr(rmm.data, "load_dataset", refuse)
    monkeypatch.setattr(rmm.llm, "load_llm", refuse)


def settings(args: argparse.Namespace) -> dict:
    return {k: v for k, v in vars(args).items() if k not in NOT_SETTINGS}


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


# ---- the shipped configs ---------------------------------------------------------------------------
@pytest.mark.parametrize(("command", "path"), [*(("train", p) for p in TRAIN_CONFIGS),
                                               *(("eval", p) for p in EVAL_CONFIGS)], ids=lambda x: getattr(x, "stem", x))
def test_shipped_configs_load_as_the_command_loads_them(command: str, path: Path, no_work) -> None:
    args = build_parser().parse_args([command, "--config", str(path)])
    written = yaml.safe_load(path.read_text())
    assert written and set(written) <= set(settings(args))  # every key is one of the command's flags
    for key, value in written.items():
        assert getattr(args, key) == value, key
    assert args.func.__module__ == f"rmm.cli.{command}"


def test_the_gpu_recipes_are_there_and_name_their_encoder() -> None:
    recipes = {p.stem: p for p in TRAIN_CONFIGS}
    assert {"online-contriever-a100", "online-stella-a100", "online-gte-a100", "online-minilm-cpu"} <= set(recipes)
    for stem, path in recipes.items():
        args = build_parser().parse_args(["train", "--config", str(path)])
        assert args.retriever in stem and (args.k, args.m) == (20, 5)
        assert args.device == ("cpu" if stem.endswith("-cpu") else "cuda")


def test_configs_quote_no_estimates_and_point_at_the_split_cli() -> None:
    for path in [*TRAIN_CONFIGS, *EVAL_CONFIGS]:
        text = path.read_text()
        assert "estimate" not in text.lower() and "rmm/cli.py" not in text and "(yet)" not in text, path.name


def test_the_cpu_config_is_what_quickstart_runs(no_work) -> None:
    parser = build_parser()
    from_file = parser.parse_args(["train", "--config", str(REPO / "configs" / "train" / "online-minilm-cpu.yaml")])
    quickstart = quickstart_settings(parser.parse_args(["quickstart", "--device", "cpu"]))
    assert settings(from_file) == settings(quickstart)
    # and the quickstart is `rmm train`'s defaults: only where reports go (and the device) differ
    defaults = settings(parser.parse_args(["train"]))
    changed = {k for k, v in settings(quickstart).items() if defaults[k] != v}
    assert changed == {"json", "plot", "device"}


# ---- precedence ------------------------------------------------------------------------------------
def test_defaults_then_file_then_overrides_then_explicit_flags(tmp_path: Path, no_work) -> None:
    path = write(tmp_path, "k: 10\nm: 4\nepochs: 2\nseed: 3\nlr: 1e-2\nper_user: true\nbaseline: mean\n")
    args = build_parser().parse_args(["train", "--config", str(path), "epochs=5", "seed=4", "--seed", "7",
                                      "--m", "2", "tau=0.25"])
    assert (args.k, args.m, args.epochs, args.seed, args.tau) == (10, 2, 5, 7, 0.25)
    assert (args.lr, args.per_user, args.baseline) == (0.01, True, "mean")  # YAML's "1e-2" is a string: typed by --lr
    assert (args.heldout, args.recipe, args.device, args.batch_size) == (0.3, "auto", "auto", 64)  # defaults


def test_overrides_may_follow_flags_and_an_on_off_flag_wins_over_the_file(tmp_path: Path, no_work) -> None:
    path = write(tmp_path, "per_user: false\nepochs: 2\n")
    args = build_parser().parse_args(["train", "--config", str(path), "epochs=4", "--per-user", "seed=9",
                                      "--k", "30", "m=7"])
    assert (args.per_user, args.epochs, args.seed, args.k, args.m) == (True, 4, 9, 30, 7)
    assert args.overrides == ["epochs=4", "seed=9", "m=7"]


def test_eval_lists_come_from_yaml_lists_or_a_single_value(tmp_path: Path, no_work) -> None:
    path = write(tmp_path, "retriever: bm25\nk: [1, '5', 10]\ngranularity: [turn, session]\n")
    args = build_parser().parse_args(["eval", "--config", str(path), "merge_threshold=-0.5"])
    assert (args.retriever, args.k, args.granularity, args.merge_threshold) == (["bm25"], [1, 5, 10],
                                                                               ["turn", "session"], -0.5)
    args = build_parser().parse_args(["eval", "--config", str(path), "--k", "3"])
    assert args.k == [3]


def test_help_states_the_precedence(capsys) -> None:
    for command in ("train", "eval"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "built-in defaults < --config FILE < key=value overrides < flags given on the command line" in text


# ---- mistakes: one line, the key and the file, before any work --------------------------------------
BAD_FILES = [
    ("train", "kk: 3\n", "unknown setting(s) ['kk'] in {path} (did you mean k?)"),
    ("train", "per-user: true\n", "['per-user'] in {path} (did you mean per_user?)"),
    ("train", "k: 0\n", "k: expected a positive integer, got 0 (from {path})"),
    ("train", "k: ten\n", "k: expected a positive integer, got 'ten' (from {path})"),
    ("train", "k: null\n", "k: cannot be null; leave the key out for its default (20) (from {path})"),
    ("train", "heldout: 1\n", "heldout: expected a fraction strictly between 0 and 1, got 1 (from {path})"),
    ("train", "recipe: fancy\n", "recipe: expected one of auto, paper, normalized, got 'fancy' (from {path})"),
    ("train", "per_user: 3\n", "per_user: expected true or false, got 3 (from {path})"),
    ("train", "retriever: [a, b]\n", "retriever: expected a single value, got ['a', 'b'] (from {path})"),
    ("train", "device: gpu\n", "device: expected auto, cpu, mps or cuda[:N], got 'gpu' (from {path})"),
    ("train", "citer: gpt4\n", "citer: unknown LLM spec 'gpt4'"),
    ("train", "m: 30\n", "--m 30 must not exceed --k 20 (M memories are chosen from K candidates, after --config {path})"),
    ("train", "- k\n", "training config {path} must be a mapping at the top level, got list"),
    ("train", "k: [1\n", "training config {path} is not valid YAML"),
    ("eval", "k: [5, 0]\n", "k: expected a positive integer, got 0 (from {path})"),
    ("eval", "granularity: [turn, word]\n", "granularity: expected one of turn, session, topic, event, got 'word' (from {path})"),
    ("eval", "retriever: []\n", "retriever: expected at least one value, got [] (from {path})"),
]


def assert_one_error_line(argv: list[str], expected: str, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if "error:" in line]
    assert len(errors) == 1, captured.err
    assert errors[0].startswith(f"rmm {argv[0]}: error: ") and expected in errors[0], errors[0]
    assert "Traceback" not in captured.err + captured.out and captured.out == ""


@pytest.mark.parametrize(("command", "text", "expected"), BAD_FILES, ids=[f"{c}:{t.strip()}" for c, t, _ in BAD_FILES])
def test_a_bad_file_is_one_error_line_naming_the_key_and_the_file(command, text, expected, tmp_path, capsys,
                                                                 no_work) -> None:
    path = write(tmp_path, text)
    assert_one_error_line([command, "--config", str(path)], expected.format(path=path), capsys)


def test_a_missing_file_and_bad_overrides_are_one_error_line(tmp_path, capsys, no_work) -> None:
    missing = tmp_path / "nope.yaml"
    assert_one_error_line(["train", "--config", str(missing)],
                          f"cannot read training config {missing}: it does not exist", capsys)
    path = write(tmp_path, "k: 8\n")
    assert_one_error_line(["train", "--config", str(path), "lr=-1"],
                          f"lr: expected a positive number, got -1 (from {path} and the overrides)", capsys)
    assert_one_error_line(["eval", "--retriever", "bm25", "k=3"], "--retriever took 'k=3' as one of its values", capsys)


# ---- the mechanism, on a parser of its own ------------------------------------------------------------
def test_a_flag_added_to_a_command_is_a_config_key_at_once(tmp_path: Path) -> None:
    parser = CheckedParser(prog="rmm demo")
    parser.add_argument("--level", type=int, choices=(1, 2, 3), default=1)
    parser.add_argument("--names", nargs="*", default=[])
    parser.add_argument("-v", "--verbose", action="count", default=0)
    parser.add_argument("--dry-run", action="store_false")
    add_config_options(parser, label="demo config", example="demo.yaml")
    path = write(tmp_path, "level: 3\nnames: []\nverbose: 2\ndry_run: false\n")
    assert vars(parser.parse_args(["--config", str(path)])) == {
        "config": str(path), "overrides": [], "level": 3, "names": [], "verbose": 2, "dry_run": False}
    assert parser.parse_args([]).dry_run is True  # the flag's own default


def test_a_flag_the_file_cannot_hold_is_refused_when_the_command_is_built() -> None:
    parser = CheckedParser(prog="rmm demo")
    parser.add_argument("--tag", action="append")
    with pytest.raises(TypeError, match="--tag"):
        add_config_options(parser, label="demo config", example="demo.yaml")
    with pytest.raises(TypeError, match="CheckedParser"):
        add_config_options(argparse.ArgumentParser(), label="demo config", example="demo.yaml")


# ---- end to end on a tiny LoCoMo -----------------------------------------------------------------------
@pytest.fixture
def isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RMM_CACHE_DIR", str(tmp_path / "cache"))


def test_train_runs_from_a_config_with_flags_on_top(tiny_data_dir, tmp_path, isolated_cache) -> None:
    out = tmp_path / "train.json"
    path = write(tmp_path, f"k: 8\nheldout: 0.34\nrecipe: paper\nlr: 0.01\nbaseline: mean\njson: {out}\n"
                           f"device: cpu\ndata_dir: {tmp_path / 'nowhere'}\n")
    assert main(["train", "--config", str(path), "epochs=1", "--data-dir", str(tiny_data_dir)]) == 0
    cfg = json.loads(out.read_text())["config"]
    assert (cfg["k"], cfg["recipe"], cfg["lr"], cfg["baseline"], cfg["heldout_fraction"]) == (8, "paper", 0.01,
                                                                                              "mean", 0.34)


def test_eval_runs_the_shipped_cpu_config(tiny_data_dir, tmp_path, isolated_cache) -> None:
    out = tmp_path / "eval.json"
    assert main(["eval", "--config", str(REPO / "configs" / "eval" / "locomo-cpu.yaml"), f"json={out}",
                 "--data-dir", str(tiny_data_dir), "--no-download"]) == 0
    reports = json.loads(out.read_text())
    assert set(reports) == {"bm25/turn", "minilm/turn", "bm25/session", "minilm/session"}
    assert reports["bm25/turn"]["overall"]["recall@5"] > 0.8
