"""Server settings: YAML + overrides, key sources, and clear errors for every kind of mistake."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from rmm.serve.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[1]


def test_the_documented_yaml_loads_with_overrides() -> None:
    config = load_config(REPO / "configs" / "serve.yaml", {"bank": "/tmp/b", "port": 9001, "batching.max_batch": 8,
                                                           "batching.enabled": None}, environ={})
    assert config.bank == "/tmp/b" and config.port == 9001
    assert config.batching.max_batch == 8 and config.batching.enabled  # None leaves the file's value
    assert config.learner_config().batch_size == 4 and config.k == 20 and config.m == 5


def test_the_learner_recipe_follows_the_encoder_and_explicit_settings_win() -> None:
    config = load_config(REPO / "configs" / "serve.yaml", {"bank": "b"}, environ={})
    cosine, dot = config.learner_config(normalized_encoder=True), config.learner_config(normalized_encoder=False)
    assert (cosine.tau, cosine.baseline, cosine.lr) == (0.05, "mean", 3e-4)
    assert (dot.tau, dot.baseline, dot.lr) == (0.5, 0.5, 1e-3)
    pinned = load_config(None, {"bank": "b", "tau": 0.2, "learner": {"lr": 1e-4}}, environ={})
    assert (pinned.learner_config(True).tau, pinned.learner_config(True).lr) == (0.2, 1e-4)
    with pytest.raises(ConfigError, match="unknown recipe"):
        load_config(None, {"bank": "b", "recipe": "fast"}, environ={})


def test_api_keys_from_yaml_env_and_key_file(tmp_path: Path) -> None:
    key_file = tmp_path / "keys.txt"
    key_file.write_text("# tenant keys\nfile-key-0001 filetenant\n\nfile-key-0002   other  # trailing comment\n")
    config = load_config(None, {"bank": "b", "auth.keys": {"yaml-key-0001": "yamltenant"}, "auth.key_file": str(key_file)},
                         environ={"RMM_API_KEYS": "env-key-0001=envtenant, env-key-0002=envtenant"})
    keys = config.auth.resolve({"RMM_API_KEYS": "env-key-0001=envtenant, env-key-0002=envtenant"})
    assert keys == {"yaml-key-0001": "yamltenant", "env-key-0001": "envtenant", "env-key-0002": "envtenant",
                    "file-key-0001": "filetenant", "file-key-0002": "other"}


@pytest.mark.parametrize("overrides, environ, message", [
    ({}, {}, "bank: a bank folder is required"),
    ({"bank": "b", "colour": "red"}, {}, "unknown setting(s) ['colour']"),
    ({"bank": "b", "batching.max_btach": 3}, {}, "unknown setting(s) ['batching.max_btach']"),
    ({"bank": "b", "port": "eighty"}, {}, "port must be an integer"),
    ({"bank": "b", "explore": "maybe"}, {}, "explore must be true or false"),
    ({"bank": "b", "m": 30}, {}, "need 1 <= m <= k"),
    ({"bank": "b", "scope": "world"}, {}, "scope must be one of"),
    ({"bank": "b", "scope": "bank", "retriever": "bm25"}, {}, "retriever: bm25 (a text ranking) cannot use"),
    ({"bank": "b", "index_backend": "annoy"}, {}, "index_backend 'annoy' is not one of"),
    ({"bank": "b", "index_precision": "int2"}, {}, "index_precision 'int2' is not one of"),
    ({"bank": "b", "index_precision": "bfloat16", "index_backend": "faiss-flat"}, {},
     "index_precision 'bfloat16' is for the torch index of a bank folder"),
    ({"bank": "b", "batching.max_batch": 0}, {}, "batching.max_batch must be >= 1"),
    ({"bank": "b", "learner": {"lr": -1}}, {}, "learner: lr must be > 0"),
    ({"bank": "b", "learner": {"speed": 1}}, {}, "learner: unknown key(s) ['speed']"),
    ({"bank": "b", "selection_ttl_s": 0}, {}, "selection_ttl_s must be > 0"),
    ({"bank": "b", "port": 70000}, {}, "port must be <= 65535, got 70000"),
    ({"bank": "b", "limits.max_k": 0}, {}, "limits.max_k must be >= 1, got 0"),
    ({"bank": "b", "batching.max_wait_ms": -1}, {}, "batching.max_wait_ms must be >= 0"),
    ({"bank": "b", "torch_threads": 0}, {}, "torch_threads must be >= 1"),
    ({"bank": "b", "tau": 0}, {}, "tau must be > 0"),
    ({"bank": "b", "m": 0}, {}, "m must be >= 1"),
    ({"bank": "b", "checkpoint_interval_s": -1}, {}, "checkpoint_interval_s must be >= 0"),
    ({"bank": "b", "reload_interval_s": 3}, {}, "reload_interval_s must be <= 2, got 3"),
    ({"bank": "b", "job_lease_s": 0}, {}, "job_lease_s must be > 0"),
    ({"bank": "b", "query_process": "sometimes"}, {}, "query_process must be one of 'auto', 'on' or 'off'"),
    ({"bank": "b", "reranker_per": "team"}, {}, "reranker_per must be one of 'bank', 'tenant' or 'user'"),
    ({"bank": "b", "database": {"ef_search": 200}}, {}, "database: settings for a postgresql:// store"),
    ({"bank": "b", "store": "postgresql://u@h/db", "database": {"ef": 200}}, {}, "database: unknown key(s) ['ef']"),
    ({"bank": "b", "auth.keys": {"short": "t"}}, {}, "at least 8 characters"),
    ({"bank": "b", "auth.keys": {"long-enough-key": "bad:tenant"}}, {}, "tenant 'bad:tenant' must be"),
    ({"bank": "b"}, {"RMM_API_KEYS": "no-equals-sign"}, "$RMM_API_KEYS entry 1 is not KEY=TENANT"),
    ({"bank": "b", "auth.key_file": "/nonexistent/keys"}, {}, "auth.key_file /nonexistent/keys cannot be read"),
])
def test_mistakes_are_config_errors_naming_the_setting(overrides: dict, environ: dict, message: str) -> None:
    with pytest.raises(ConfigError) as error:
        load_config(None, overrides, environ=environ)
    assert message in str(error.value)


def test_a_bad_yaml_file_is_a_clear_error(tmp_path: Path) -> None:
    broken = tmp_path / "serve.yaml"
    broken.write_text("port: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(broken, {"bank": "b"}, environ={})
    listing = tmp_path / "list.yaml"
    listing.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must be a mapping at the top level"):
        load_config(listing, {"bank": "b"}, environ={})
    with pytest.raises(ConfigError, match="cannot read server config"):
        load_config(tmp_path / "missing.yaml", {"bank": "b"}, environ={})


def test_rmm_serve_is_registered_and_refuses_to_run_without_keys(tmp_path: Path, monkeypatch) -> None:
    from rmm.cli import build_parser
    from rmm.cli.serve import run

    monkeypatch.delenv("RMM_API_KEYS", raising=False)
    args = build_parser().parse_args(["serve", "--bank", str(tmp_path / "bank"), "--max-batch", "16", "--no-batching"])
    assert args.func is run and args.max_batch == 16 and args.no_batching
    with pytest.raises(ConfigError, match="no API keys configured"):
        run(argparse.Namespace(**{**vars(args), "dev_key": False}))


def test_rmm_serve_retriever_flag_reaches_the_config_and_refuses_unknown_kinds(tmp_path: Path, monkeypatch) -> None:
    from rmm.cli import build_parser
    from rmm.cli import serve as serve_cli

    seen: dict[str, object] = {}

    def capture(path, overrides):  # stop right after the config is resolved: no server is started
        seen["retriever"] = load_config(path, overrides, environ={}).retriever
        raise ConfigError("stop")

    monkeypatch.setattr("rmm.serve.config.load_config", capture)
    args = build_parser().parse_args(["serve", "--bank", str(tmp_path / "bank"), "--retriever", "hybrid"])
    with pytest.raises(ConfigError, match="stop"):
        serve_cli.run(args)
    assert seen["retriever"] == "hybrid"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--retriever", "sparse"])


def test_database_settings_reach_a_postgresql_bank_and_only_it() -> None:
    pg = load_config(None, {"bank": "b", "store": "postgresql://u@h/db", "database": {"ef_search": 200, "exact_limit": 5}},
                     environ={})
    assert pg.index_options == {"ef_search": 200, "exact_limit": 5}
    folder = load_config(None, {"bank": "b", "index_precision": "bfloat16"}, environ={})
    assert folder.index_options == {"precision": "bfloat16"}


def test_serve_retriever_names_come_from_the_one_mapping() -> None:
    """`retriever:`'s type, the server's mapping and eval's `NAME:DENSE` prefixes agree (one source)."""
    import typing

    from rmm.eval.benchmark_bank import OVER_DENSE as eval_names
    from rmm.memory.hybrid import OVER_DENSE
    from rmm.serve.config import RETRIEVER_FUSIONS, ServeConfig

    assert eval_names is OVER_DENSE
    assert RETRIEVER_FUSIONS == {"dense": None, **OVER_DENSE}
    literal = typing.get_type_hints(ServeConfig)["retriever"]
    assert set(typing.get_args(literal)) == set(RETRIEVER_FUSIONS)
    assert load_config(None, {"bank": "b", "retriever": "bm25"}, environ={}).first_stage_fusion == "lexical"


def test_rmm_serve_retriever_flag_names_the_known_retrievers_and_help_stays_light() -> None:
    """A bad --retriever names every known one; building the parser (`rmm --help`) loads no torch."""
    import subprocess
    import sys

    code = ("import sys, contextlib, io\n"
            "from rmm.cli import build_parser\n"
            "err = io.StringIO()\n"
            "with contextlib.redirect_stderr(err), contextlib.suppress(SystemExit):\n"
            "    build_parser().parse_args(['serve', '--help'])\n"
            "assert 'torch' not in sys.modules, 'torch imported by the parser'\n"
            "with contextlib.redirect_stderr(err), contextlib.suppress(SystemExit):\n"
            "    build_parser().parse_args(['serve', '--retriever', 'sparse'])\n"
            "print(err.getvalue())\n")
    out = subprocess.run([sys.executable, "-c", code], check=True, timeout=120, capture_output=True, text=True)
    assert "unknown retriever 'sparse'; use one of dense, hybrid, bm25" in out.stdout
