"""CUDA graphs for the encoder's inference passes (`load_encoder(..., cuda_graphs=True)`).

On a GPU a BERT-base batch is ~200 kernel launches whose host cost (Python, dispatcher, launch)
exceeds the GPU's work for the short texts a memory bank holds: encoding is bound by the host.
A graph replays the whole forward as one launch. Graphs are fixed to their shapes, so a batch is
padded to a length bucket (`bucket_length`) and its rows to a power of two (with copies of its
first text, whose outputs are dropped): a few shapes, each captured once, on first sight.

Replays of different shapes share one memory pool (they run one at a time, under a lock) and
each result is copied out of the graph's output buffer before the lock is released.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

log = logging.getLogger(__name__)

MAX_GRAPHS = 64  # beyond this many shapes, new shapes run without a graph (each graph holds GPU memory)


def bucket_length(longest: int, limit: int) -> int:
    """The padded length of a batch whose longest text has `longest` tokens: a multiple of 16 up
    to 64 tokens, of 32 up to 128, of 64 beyond — never past `limit`, never below `longest`."""
    step = 16 if longest <= 64 else 32 if longest <= 128 else 64
    return max(longest, min(limit, -(-longest // step) * step))


def bucket_rows(rows: int, limit: int) -> int:
    """The padded row count of a batch: the next power of two, at most `limit` (the batch size)."""
    return max(rows, min(limit, 1 << max(0, rows - 1).bit_length()))


class InferenceGraphs:
    """`graphs(sequences)` → embeddings of those token-id lists, replayed from a CUDA graph per shape.

    `collate(sequences, length)` pads to model inputs on the GPU and `embed(inputs)` runs the
    model (the encoder's own methods); `max_rows` and `max_length` bound the buckets."""

    def __init__(self, collate: Callable[..., dict[str, Tensor]], embed: Callable[[dict[str, Tensor]], Tensor],
                 max_rows: int, max_length: int, max_graphs: int = MAX_GRAPHS) -> None:
        self.collate, self.embed = collate, embed
        self.max_rows, self.max_length, self.max_graphs = max_rows, max_length, max_graphs
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, dict[str, Tensor], Tensor]] = {}
        self._pool = torch.cuda.graph_pool_handle()
        self._lock = threading.Lock()

    @property
    def captured(self) -> int:
        return len(self._graphs)

    def __call__(self, sequences: Sequence[Sequence[int]]) -> Tensor:
        rows = len(sequences)
        padded_rows = bucket_rows(rows, max(self.max_rows, rows))
        length = bucket_length(max(len(s) for s in sequences), self.max_length)
        inputs = self.collate(list(sequences) + [sequences[0]] * (padded_rows - rows), length=length)
        key = tuple((name, tuple(value.shape)) for name, value in inputs.items())
        with self._lock:
            entry = self._graphs.get(key)
            if entry is None:
                if len(self._graphs) >= self.max_graphs:
                    return self.embed(inputs)[:rows]
                entry = self._capture(inputs)
                self._graphs[key] = entry
            graph, static_inputs, static_output = entry
            for name, value in inputs.items():
                static_inputs[name].copy_(value, non_blocking=True)
            graph.replay()
            return static_output[:rows].clone()

    def _capture(self, inputs: dict[str, Tensor]) -> tuple[torch.cuda.CUDAGraph, dict[str, Tensor], Tensor]:
        static_inputs = {name: value.clone() for name, value in inputs.items()}
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # lazy initialisation (cuBLAS workspaces, kernels) happens outside the capture
            self.embed(static_inputs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a server's other threads may use CUDA while this one captures
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            static_output = self.embed(static_inputs)
        log.debug("cuda_graphs: captured an inference pass at %s",
                  {name: tuple(v.shape) for name, v in static_inputs.items()})
        return graph, static_inputs, static_output
