"""Stand-ins for real generators in training tests: a tiny random-weight chat model folder for
`hf:`, and an in-process OpenAI-compatible HTTP server for `openai:` that answers out of order,
can be killed mid-run and restarted on the same port."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from rmm.prompts import parse_shown_memories

CHAT_TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)


def build_tiny_chat_model(folder: Path, tokenizer_from: Path, context: int = 4096) -> Path:
    """A 2-layer Llama with random weights, a WordPiece tokenizer and a chat template: it answers
    gibberish quickly, which is what a parse-failure path needs."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_from))
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.model_max_length = context
    tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=None, eos_token_id=None)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def _words(text: str) -> set[str]:
    return {w for w in re.findall(r"[a-z]+", text.lower()) if len(w) > 3}


class FakeOpenAIServer:
    """`/v1/models` and `/v1/chat/completions` on 127.0.0.1, one thread per request.

    It cites the shown memories that share a word with the question (`[NO_CITE]` when none does),
    answers every `garbage_every`-th request without a citation, and holds every third request
    `slow_s` seconds (the others `fast_s`), so replies come back out of order. `die_after=N`: the
    N+1-th request kills the server — it and every request in flight get their connection closed
    without an answer, and the port refuses connections until `restart()`.
    """

    def __init__(self, *, slow_s: float = 0.06, fast_s: float = 0.005, garbage_every: int = 5,
                 die_after: int | None = None) -> None:
        self.slow_s, self.fast_s, self.garbage_every, self.die_after = slow_s, fast_s, garbage_every, die_after
        self.asked: Counter[str] = Counter()  # question → requests received
        self.answered: list[str] = []  # questions, in the order their replies were sent
        self.arrived: list[str] = []
        self.in_flight = self.peak = 0
        self.dead = threading.Event()
        self._lock = threading.Lock()
        self.port = _free_port()
        self._start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def _start(self) -> None:
        handler = type("Handler", (_Handler,), {"fake": self})
        self.httpd = ThreadingHTTPServer(("127.0.0.1", self.port), handler)
        self.httpd.daemon_threads = True
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()

    def kill(self) -> None:
        """Stop listening (connections are refused); requests in flight are dropped unanswered."""
        self.dead.set()
        threading.Thread(target=self._shutdown, daemon=True).start()

    def _shutdown(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def restart(self, die_after: int | None = None) -> None:
        self._thread.join(5)
        self.die_after = die_after
        self.dead.clear()
        self._start()

    def close(self) -> None:
        if not self.dead.is_set():
            self.dead.set()
            self._shutdown()

    def reply(self, n: int, messages: list[dict[str, str]]) -> tuple[str, str]:
        """(question, reply text) for the n-th request."""
        user = messages[-1]["content"]
        question = user.rsplit("My message: ", 1)[-1].strip().splitlines()[0]
        if self.garbage_every and n % self.garbage_every == self.garbage_every - 1:
            return question, "I am not sure what you mean."
        shown = parse_shown_memories(messages)
        cited = [i for i, text in enumerate(shown) if _words(text) & _words(question)]
        return question, "They said so. " + (f"[{', '.join(map(str, cited))}]" if cited else "[NO_CITE]")


class _Handler(BaseHTTPRequestHandler):
    fake: FakeOpenAIServer

    def log_message(self, *args: object) -> None:  # keep test output clean
        pass

    def _json(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        try:
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up on this request
            self.close_connection = True

    def do_GET(self) -> None:
        self._json({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    def do_POST(self) -> None:
        fake = self.fake
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with fake._lock:
            n = sum(fake.asked.values())
            question, text = fake.reply(n, request["messages"])
            fake.asked[question] += 1
            fake.arrived.append(question)
            fake.in_flight += 1
            fake.peak = max(fake.peak, fake.in_flight)
            dies = fake.die_after is not None and n >= fake.die_after and not fake.dead.is_set()
        if dies:
            fake.kill()
        time.sleep(fake.slow_s if n % 3 == 0 else fake.fast_s)
        with fake._lock:
            fake.in_flight -= 1
        if fake.dead.is_set():  # killed meanwhile: the connection just closes
            self.close_connection = True
            return
        with fake._lock:
            fake.answered.append(question)
        self._json({"id": f"c{n}", "object": "chat.completion", "created": 0, "model": request["model"],
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                 "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": len(request["messages"][-1]["content"].split()),
                              "completion_tokens": len(text.split()), "total_tokens": 0}})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
