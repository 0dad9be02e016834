"""The sync and async clients against a real uvicorn server on loopback, including a restart."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn
from fakes import BagOfWordsEncoder, loopback_server

from rmm.serve.app import create_app
from rmm.serve.client import AsyncRmmClient, Query, RmmClient, RmmServerError
from rmm.serve.config import load_config

KEY, OTHER = "client-key-123", "other-key-456"
FACTS = ["Ana hikes mountain trails every weekend", "Ana bakes sourdough bread on Sundays",
         "Ana plays cello in a community orchestra", "Ana adopted a golden retriever puppy",
         "Ana works as a nurse at the city hospital", "Ana booked a summer trip to Lisbon"]


@contextlib.contextmanager
def running_server(bank: Path, **overrides) -> Iterator[str]:
    """A real server in a thread; leaving the block shuts it down gracefully (lifespan runs)."""
    config = load_config(None, {"bank": str(bank), "auth.keys": {KEY: "acme", OTHER: "other"}, "device": "cpu",
                                "learner": {"batch_size": 2}, **overrides}, environ={})
    with loopback_server(create_app(config, encoder=BagOfWordsEncoder())) as url:
        yield url


@pytest.fixture
def server(tmp_path: Path) -> Iterator[str]:
    with running_server(tmp_path / "bank") as url:
        yield url


def test_sync_client_agent_loop(server: str) -> None:
    with RmmClient(server, KEY) as rmm:
        assert rmm.health().status == "ok"
        ids = rmm.add_memories("ana", FACTS[:5] + [{"text": FACTS[5], "kind": "topic", "id": "lisbon", "refs": ["t1"]}])
        assert len(ids) == 6 and ids[5] == "lisbon"
        assert rmm.users() == ["ana"]
        hit = rmm.retrieve_one("ana", "sourdough bread", m=3, explore=False)
        assert len(hit.memories) == 3 and "sourdough" in hit.memories[0].text and hit.selection_id
        cited = [m.index for m in hit.memories if "sourdough" in m.text]
        fb = rmm.feedback(hit.selection_id, text=f"She bakes sourdough bread. {cited}")
        assert fb.cited == cited and fb.learner_records == 0 and not fb.updated  # greedy: never learned from
        assert not fb.learned and fb.reason and "explore=false" in fb.reason
        first, second = rmm.retrieve([Query("ana", "golden retriever puppy"), Query("ana", "hiking")])  # sampled
        assert rmm.feedback(first.selection_id, cited=[0]).learner_records == 1
        assert rmm.feedback(second.selection_id, cited=[0]).updated  # batch_size 2: the reranker stepped
        lisbon = next(m for m in rmm.memories("ana") if m.id == "lisbon")
        assert lisbon.kind == "topic" and lisbon.refs == ["t1"]

        rmm.add_turns("bo", [("bo", "I restore old sailing boats in my garage"), ("assistant", "Cool!")])
        job = rmm.wait_job(rmm.end_session("bo").job_id, timeout=20)
        assert job.status == "done" and job.result["memories"]
        assert all(m.kind == "topic" for m in rmm.memories("bo"))

        trip = rmm.retrieve_one("ana", "summer trip Lisbon", k=1, m=1)
        assert trip.memories[0].id == "lisbon"
        assert rmm.delete_memory("ana", "lisbon") == 0  # selections keep the vectors they were scored with
        assert rmm.feedback(trip.selection_id, cited=[0]).cited == [0]  # still answerable after the delete
        with pytest.raises(RmmServerError) as unknown:
            rmm.retrieve_one("nobody", "hello")
        assert unknown.value.status == 404 and "nobody" in unknown.value.message
        with pytest.raises(RmmServerError) as bad:
            rmm.feedback(hit.selection_id, cited=[0], text="[0]")
        assert bad.value.status == 422 and "exactly one of" in bad.value.message
        assert rmm.delete_user("bo").memories == len(job.result["memories"])

    with RmmClient(server, OTHER) as other:
        assert other.users() == []
        with pytest.raises(RmmServerError) as hidden:
            other.memories("ana")
        assert hidden.value.status == 404
    with RmmClient(server, "not-a-key-at-all") as stranger, pytest.raises(RmmServerError) as refused:
        stranger.users()
    assert refused.value.status == 401 and refused.value.code == "invalid_api_key"


def test_async_client_concurrent_agents(server: str) -> None:
    async def main() -> None:
        async with AsyncRmmClient(server, KEY) as rmm:
            await rmm.add_memories("ana", FACTS)
            hits = await asyncio.gather(*(rmm.retrieve_one("ana", fact, m=2) for fact in FACTS))
            assert all(len(h.memories) == 2 for h in hits)
            results = await asyncio.gather(*(rmm.feedback(h.selection_id, no_cite=True) for h in hits))
            assert all(r.rewards == [-1.0, -1.0] for r in results)
            assert max(r.learner_step for r in results) == 3  # 6 rewarded selections, batches of 2
            job = await rmm.add_session("kai", [("kai", "I teach chemistry at a high school")])
            assert (await rmm.wait_job(job.job_id, timeout=20)).status == "done"
            with pytest.raises(RmmServerError) as missing:
                await rmm.job("no-such-job")
            assert missing.value.status == 404

    asyncio.run(main())


def test_unreachable_server_is_a_clear_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with RmmClient(f"http://127.0.0.1:{port}", KEY, timeout=2) as rmm, pytest.raises(RmmServerError) as error:
        rmm.health()
    assert error.value.status == 0 and "cannot reach" in error.value.message


def test_restart_keeps_memories_checkpoint_and_pending_selections(tmp_path: Path) -> None:
    bank = tmp_path / "bank"
    with running_server(bank) as url, RmmClient(url, KEY) as rmm:
        rmm.add_memories("ana", FACTS)
        for query in ("hikes trails", "cello orchestra"):
            rmm.feedback(rmm.retrieve_one("ana", query).selection_id, cited=[0])
        waiting = rmm.retrieve_one("ana", "sourdough bread").selection_id
    assert list((bank / "reranker" / "tenants").glob("acme-*/meta.json"))  # the tenant's, saved at shutdown

    with running_server(bank) as url, RmmClient(url, KEY) as rmm:
        assert [m.text for m in rmm.memories("ana")] == FACTS
        result = rmm.feedback(waiting, cited=[0])  # issued before the restart
        assert result.learner_records == 3 and result.learner_step == 1


def test_importing_the_client_does_not_load_torch() -> None:
    """Agents import the client in their own process: it must stay light (httpx only)."""
    import subprocess
    import sys

    code = "import sys, rmm.serve.client, rmm; assert 'torch' not in sys.modules, 'torch imported'; rmm.Memory"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
