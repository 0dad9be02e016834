"""`from rmm import Memory`: the server's verbs in-process, over the same `RetrievalService`."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
from fakes import BagOfWordsEncoder

from rmm import AsyncMemory, Memory
from rmm.errors import ConfigError, UnknownMemoryError, UnknownUserError
from rmm.serve.errors import (
    BadRequestError,
    NoOpenSessionError,
    SelectionUsedError,
    UnknownSelectionError,
)
from rmm.serve.records import FeedbackResult, RetrieveResult
from rmm.serve.service import RetrievalService

FACTS = ["Ana hikes mountain trails every weekend", "Ana bakes sourdough bread on Sundays",
         "Ana plays cello in a community orchestra", "Ana adopted a golden retriever puppy",
         "Ana works as a nurse at the city hospital", "Ana booked a summer trip to Lisbon"]


def open_memory(folder: Path, **settings) -> Memory:
    return Memory.open(folder, encoder=BagOfWordsEncoder(), device="cpu", **settings)


@pytest.fixture
def memory(tmp_path: Path):
    with open_memory(tmp_path / "bank", learner={"batch_size": 2}) as m:
        m.add_memories("ana", FACTS)
        yield m


def test_import_rmm_stays_light_and_exposes_memory() -> None:
    code = ("import sys, rmm; assert 'torch' not in sys.modules, 'torch imported'; "
            "from rmm import Memory, AsyncMemory; import rmm.embedded as e; "
            "assert Memory is e.Memory and AsyncMemory is e.AsyncMemory")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_memory_is_the_servers_service(memory: Memory) -> None:
    assert isinstance(memory.service, RetrievalService)
    assert memory.service.query_process is None  # no child process unless configured
    assert memory.users() == ["ana"]


def test_retrieve_feedback_loop_teaches_the_reranker(memory: Memory) -> None:
    hit = memory.retrieve_one("ana", "where does Ana hike on weekends?", k=6, m=3, explore=True)
    assert isinstance(hit, RetrieveResult) and hit.selection_id and len(hit.memories) == 3
    assert [m.index for m in hit.memories] == [0, 1, 2]
    result = memory.feedback(hit.selection_id, text=f"She hikes trails [{hit.memories[0].index}].")
    assert isinstance(result, FeedbackResult) and result.cited == [0] and result.learned
    second = memory.retrieve_one("ana", "what does Ana bake?", k=6, m=3, explore=True)
    update = memory.feedback(second.selection_id, cited=[1])
    assert update.updated and update.learner_step == 1  # batch_size 2: the second feedback steps
    with pytest.raises(SelectionUsedError):
        memory.feedback(second.selection_id, no_cite=True)
    with pytest.raises(UnknownSelectionError):
        memory.feedback("no-such-selection", cited=[0])
    with pytest.raises(BadRequestError):
        memory.feedback(hit.selection_id, cited=[0], no_cite=True)


def test_retrieve_many_reports_each_failure_like_the_server(memory: Memory) -> None:
    ok, failed = memory.retrieve([("ana", "cello orchestra"), {"user": "nobody", "query": "x"}])
    assert ok.error is None and ok.memories
    assert failed.error is not None and failed.error.status == 404 and not failed.memories
    with pytest.raises(UnknownUserError):
        memory.retrieve([("nobody", "x")])
    with pytest.raises(UnknownUserError):
        memory.retrieve_one("nobody", "x")
    with pytest.raises(BadRequestError):
        memory.retrieve_one("ana", "x", k=2, m=3)
    with pytest.raises(BadRequestError):
        memory.retrieve([{"user": "ana", "query": "x", "kk": 3}])
    assert memory.retrieve([]) == []


def test_memories_and_deletes(memory: Memory) -> None:
    ids = memory.add_memories("ana", [{"text": "Ana speaks Portuguese", "id": "lang", "kind": "topic",
                                       "refs": ["t1"]}])
    assert ids == ["lang"]
    stored = {m.id: m for m in memory.memories("ana")}
    assert stored["lang"].kind == "topic" and stored["lang"].refs == ["t1"] and stored["lang"].user_id == "ana"
    assert memory.delete_memory("ana", "lang") == 0
    assert "lang" not in {m.id for m in memory.memories("ana")}
    with pytest.raises(UnknownMemoryError):
        memory.delete_memory("ana", "lang")
    with pytest.raises(BadRequestError):
        memory.add_memories("ana", [{"text": "x", "kind": "nonsense"}])
    with pytest.raises(BadRequestError):
        memory.add_memories("ana", [{"text": "x", "colour": "red"}])
    counts = memory.delete_user("ana")
    assert counts["memories"] == len(FACTS)
    with pytest.raises(UnknownUserError):
        memory.memories("ana")
    with pytest.raises(UnknownUserError):
        memory.delete_user("ana")


def test_sessions_reflect_into_memories(memory: Memory) -> None:
    turn_ids = memory.add_turns("bo", [("bo", "I started learning the violin last month"),
                                       {"speaker": "assistant", "text": "How is it going?"}])
    assert len(turn_ids) == 2 and turn_ids[0].startswith("bo:")
    job = memory.end_session("bo", wait=True)
    assert job.status == "done" and job.user_id == "bo" and job.result["memories"]
    assert any("violin" in m.text for m in memory.memories("bo"))
    with pytest.raises(NoOpenSessionError):
        memory.end_session("bo")
    with pytest.raises(BadRequestError):
        memory.add_turns("bo", [{"speaker": "bo", "text": "x", "id": "mine"}])
    job = memory.add_session("cy", [{"id": "c1", "speaker": "cy", "text": "My sister lives in Oslo"},
                                    ("cy", "and I visit her every winter")], session_id="cy-s1",
                             time="2024-01-02", store_turns=True)
    done = memory.wait_job(job.id)
    assert done.status == "done" and done.result["turn_memories"] == ["c1", "cy-s1:1"]


def test_open_reads_the_server_config_file(tmp_path: Path) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text("k: 4\nm: 2\nexplore: false\n")
    with Memory.open(tmp_path / "bank", config=config, encoder=BagOfWordsEncoder(), device="cpu") as memory:
        memory.add_memories("ana", FACTS)
        hit = memory.retrieve_one("ana", "hiking")
        assert len(hit.memories) == 2 and hit.explore is False
        assert memory.service.config.k == 4 and memory.service.config.query_process == "off"
    with pytest.raises(ConfigError):
        Memory.open(tmp_path / "bank", config=config, encoder=BagOfWordsEncoder(), device="cpu", k=1, m=2)
    config.write_text("query_process: auto\n")  # the config's choice is kept (here: no child, the encoder is given)
    with Memory.open(tmp_path / "bank", config=config, encoder=BagOfWordsEncoder(), device="cpu") as memory:
        assert memory.service.config.query_process == "auto"
    with pytest.raises(ConfigError):
        Memory.open("postgresql://localhost/x", encoder=BagOfWordsEncoder())  # no folder for open sessions
    with pytest.raises(ConfigError):
        Memory.open(tmp_path / "bank", encoder=BagOfWordsEncoder(), folder=tmp_path / "x")
    with pytest.raises(ConfigError):
        Memory.open(tmp_path / "bank", encoder=BagOfWordsEncoder(), device="cpu", tenant="bad:tenant")


def test_a_bank_is_shared_with_the_server_tenant(tmp_path: Path) -> None:
    """Another tenant's users are another scope; reopening keeps everything."""
    with open_memory(tmp_path / "bank", tenant="alpha") as alpha:
        alpha.add_memories("ana", FACTS[:2])
    with open_memory(tmp_path / "bank", tenant="beta") as beta:
        assert beta.users() == []
        with pytest.raises(UnknownUserError):
            beta.memories("ana")
    with open_memory(tmp_path / "bank", tenant="alpha") as alpha:
        assert len(alpha.memories("ana")) == 2


def test_async_memory_runs_the_same_verbs(tmp_path: Path) -> None:
    async def main() -> None:
        async with await AsyncMemory.open(tmp_path / "bank", encoder=BagOfWordsEncoder(), device="cpu") as memory:
            await memory.add_memories("ana", FACTS)
            hits = await asyncio.gather(*(memory.retrieve_one("ana", q, explore=True)
                                          for q in ("hiking trails", "sourdough bread")))
            assert all(h.selection_id for h in hits)
            result = await memory.feedback(hits[0].selection_id, cited=[0])
            assert result.cited == [0]
            assert len(await memory.memories("ana")) == len(FACTS)
            await memory.add_turns("ana", [("ana", "I love hiking")])
            job = await memory.end_session("ana", wait=True)
            assert job.status == "done"
            with pytest.raises(UnknownUserError):
                await memory.retrieve_one("nobody", "x")
            assert (await memory.export_user("ana", tmp_path / "out"))["counts"]["memories"] >= len(FACTS)
            assert (await memory.delete_user("ana"))["memories"] >= len(FACTS)
            assert (await memory.import_user(tmp_path / "out"))["memories"] >= len(FACTS)
            assert await memory.users() == ["ana"]

    asyncio.run(main())
