"""Test doubles shared by several test files (importable because conftest puts tests/ on sys.path)."""

from __future__ import annotations

import builtins
import contextlib
import hashlib
import re
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from rmm.llm.base import LLM, Usage
from rmm.types import Memory

DIM = 64
Reply = str | Callable[[str], str]


@contextlib.contextmanager
def loopback_server(app: Any, **config: Any) -> Iterator[str]:
    """`app` under a real uvicorn server on a free loopback port, in a thread (lifespan on); yields
    its URL; leaving the block shuts it down gracefully. `config`: more `uvicorn.Config` settings."""
    import socket
    import threading
    import time

    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", **config))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


class FakeClock:
    """A clock that moves only when told (`now += seconds`): timings a test decides."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class BagOfWordsEncoder:
    """Hashes words longer than three letters into DIM buckets: shared words → similar vectors."""

    name, dim, fingerprint = "bow", DIM, "bow-v1"

    def encode_queries(self, texts: list[str]) -> torch.Tensor:
        out = torch.zeros(len(texts), DIM)
        for i, text in enumerate(texts):
            for word in re.findall(r"[a-z]+", text.lower()):
                if len(word) > 3:
                    out[i, int(hashlib.md5(word.encode()).hexdigest(), 16) % DIM] += 1.0
        return torch.nn.functional.normalize(out + 1e-4, dim=-1)

    encode_passages = encode_queries


def drive(monkeypatch, lines: list[str]) -> None:
    """Feed `lines` to `input()` (a terminal session), then EOF."""
    feed = iter(lines)

    def fake_input(prompt: str = "") -> str:
        try:
            return next(feed)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr(builtins, "input", fake_input)


class ScriptedGoalLLM(LLM):
    """Replies per prompt kind from a script; the last reply of a kind repeats once the script runs out.

    A reply is a string or a function of the prompt; `kind` reads the goal front end's system
    prompts (a subclass reads another front end's)."""

    def __init__(self, **script: list[Reply]) -> None:
        super().__init__("scripted-goal")
        self.script = {kind: list(replies) for kind, replies in script.items()}
        self.kinds: list[str] = []
        self.prompts: list[str] = []

    @staticmethod
    def kind(system: str) -> str:
        if system.startswith("You plan"):
            return "decompose"
        if "verifiable unification" in system:
            return "unify"
        if system.startswith("You refine"):
            return "refine"
        return "answer"

    def _generate(self, batch, *, json_schema=None, max_tokens=512, temperature=0.0):
        out = []
        for conversation in batch:
            kind, prompt = self.kind(conversation[0]["content"]), conversation[-1]["content"]
            replies = self.script.get(kind) or ["(nothing scripted)"]
            reply = replies.pop(0) if len(replies) > 1 else replies[0]
            self.kinds.append(kind)
            self.prompts.append(prompt)
            out.append(reply(prompt) if callable(reply) else reply)
        self._record(Usage(calls=len(batch), prompt_tokens=100, completion_tokens=20))
        return out


class ScriptedMemR3LLM(ScriptedGoalLLM):
    """Replies per call kind (generate | answer) from a script; records each call's system prompt and schema."""

    def __init__(self, **script: list[Reply]) -> None:
        super().__init__(**script)
        self.systems: list[str] = []
        self.schemas: list[dict | None] = []

    @staticmethod
    def kind(system: str) -> str:
        return "generate" if system.startswith("You are a memory agent") else "answer"

    def _generate(self, batch, *, json_schema=None, max_tokens=512, temperature=0.0):
        self.systems += [conversation[0]["content"] for conversation in batch]
        self.schemas += [json_schema] * len(batch)
        return super()._generate(batch, json_schema=json_schema, max_tokens=max_tokens, temperature=temperature)


# A user's memories for the front-end tests: facts a question can need, then unrelated errands.
FACTS = {
    "pet": "Ana adopted a golden retriever puppy named Biscuit",
    "sister": "Ana's sister Clara is getting married in June",
    "porto": "Clara moved to Porto in 2019 for her studies",
    "cello": "Ana plays cello in a community orchestra",
    "bread": "Ana bakes sourdough bread on Sundays",
    "hike": "Ana hikes mountain trails every weekend",
    "nurse": "Ana works as a nurse at the city hospital",
    "novel": "Ana reads detective novels set in Tokyo",
}
FILLER = [f"Ana noted errand {word} today" for word in
          ("apples", "plumber", "garage", "tickets", "passport", "laundry", "printer", "dentist", "library",
           "curtains", "battery", "ceiling", "umbrella", "bicycle", "kitchen", "stamps", "blanket", "carpet",
           "violin", "pillow", "marble", "lantern", "compass", "saddle", "trumpet", "anchor", "helmet", "rocket",
           "feather", "mirror", "basket", "pencil", "candle", "jacket", "wallet", "bottle", "ladder", "hammer")]


def add_story(bank, user: str = "ana", *, refs: bool = True) -> None:
    """FACTS (dated 1 May 2023, each citing turn `t:<key>` unless `refs=False`) then FILLER as `user`'s
    topic memories: the bank the front-end tests search."""
    bank.add(user, [Memory(id=key, user_id=user, kind="topic", text=text, refs=[f"t:{key}"] if refs else [],
                           time_span=("1 May 2023", "1 May 2023")) for key, text in FACTS.items()])
    bank.add(user, [Memory(id=f"e{i}", user_id=user, kind="topic", text=t) for i, t in enumerate(FILLER)])


def write_tiny_bert(folder: Path, tokenizer_from: Path, *, seed: int = 0, heads: int = 2) -> Path:
    """A 2-layer random BERT (hidden 32) with the tokenizer files of `tokenizer_from` (MiniLM's):
    a real transformer encoder that loads in a second and runs in milliseconds."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    BertModel(BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=heads,
                         intermediate_size=64, max_position_embeddings=64)).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        if (tokenizer_from / name).is_file():
            shutil.copy(tokenizer_from / name, folder / name)
    return folder


def run_in_threads(work: Callable[[int], None], n: int) -> list[BaseException]:
    """Run `work(0)` … `work(n - 1)` on n threads at once; what they raised (writers racing a store)."""
    errors: list[BaseException] = []

    def guarded(i: int) -> None:
        try:
            work(i)
        except BaseException as exc:  # noqa: BLE001 - returned to the test
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors
