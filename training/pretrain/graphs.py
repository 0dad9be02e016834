"""CUDA graphs for the pretraining step's transformer passes (`cuda_graphs: true`).

At batch 32 a BERT-base step dispatches ~2,000 operations (`python -m rmm.bench.pretrain
--count-ops`), each a kernel launch with its Python and dispatcher cost: on one H100 the step ran
at 1.0 CPU-second per second while the GPU waited (161 pairs/s). A CUDA graph replays a pass's
forward and its backward as one launch each, so the host cost of a step no longer grows with the
model's depth.

A graph is fixed to its input shapes, so each pass is padded to a length bucket (the data
module, with `rmm.encoders.cuda_graphs.bucket_length`, as the encoder's inference graphs do) and one
graph is captured per (pass position, shape) the first time it is seen — padding changes nothing
but compute, since pooling and attention mask it out. Graphs of the same
pass position share a memory pool (they never run at once); passes of one step use different
pools, because the first pass's saved activations must survive the second's replay until the
backward reaches them. `torch.cuda.make_graphed_callables` does the warm-up, capture and replay;
its warm-up computes gradients with `autograd.grad`, so it changes no weight and no `.grad`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import Tensor, nn

from rmm.encoders import Encoder
from rmm.encoders.cuda_graphs import MAX_GRAPHS
from rmm.errors import RmmError

log = logging.getLogger(__name__)


class _EmbedPass(nn.Module):
    """One embedding pass as a module of positional tensors, make_graphed_callables' contract.

    A fresh one per captured shape (capture replaces its `forward`); it holds the encoder's
    transformer and dense head as its children, so its parameters are theirs."""

    def __init__(self, encoder: Encoder, names: tuple[str, ...]) -> None:
        super().__init__()
        self.model = encoder.model
        self.dense = encoder.dense
        self._embed: Callable[[dict[str, Tensor]], Tensor] = encoder.embed
        self.names = names

    def forward(self, *tensors: Tensor) -> Tensor:
        return self._embed(dict(zip(self.names, tensors)))


class GraphedPasses:
    """`passes(position, inputs)` → the encoder's embeddings of `inputs`, replayed from a CUDA graph
    captured for that pass position and shape (captured on first sight)."""

    def __init__(self, encoder: Encoder, autocast_dtype: torch.dtype | None, max_graphs: int = MAX_GRAPHS) -> None:
        if not torch.cuda.is_available():
            raise RmmError("cuda_graphs: true needs a CUDA device (torch sees none)")
        self.encoder = encoder
        self.autocast_dtype = autocast_dtype
        self.max_graphs = max_graphs
        self._graphs: dict[tuple, nn.Module] = {}
        self._pools: dict[int, tuple[int, int]] = {}
        self._warned = False
        self._addresses = self._parameter_addresses()
        # make_graphed_callables warms up on a side stream, so torch (>= 2.9) warns at backward that the
        # weights' gradient accumulators were made on another stream: expected here, and the graphed
        # steps equal eager ones (tests/test_pretrain_graphs.py); a dependency's notice kept off the screen
        quiet = getattr(torch.autograd.graph, "set_warn_on_accumulate_grad_stream_mismatch", None)
        if quiet is not None:
            quiet(False)

    def _parameter_addresses(self) -> tuple[int, ...]:
        parts = [self.encoder.model] + ([self.encoder.dense] if self.encoder.dense is not None else [])
        return tuple(p.data_ptr() for part in parts for p in part.parameters())

    @property
    def captured(self) -> int:
        """Graphs captured so far (one per pass position and shape)."""
        return len(self._graphs)

    def __call__(self, position: int, inputs: dict[str, Tensor]) -> Tensor:
        names = tuple(inputs)
        tensors = tuple(inputs[name] for name in names)
        if any(t.device.type != "cuda" for t in tensors):
            raise RmmError("cuda_graphs: the batch is not on a CUDA device")
        if self._parameter_addresses() != self._addresses:  # the weights moved (`.to`, `.cpu()`): graphs are stale
            log.info("cuda_graphs: the weights moved since %d graphs were captured; capturing again", len(self._graphs))
            self._graphs.clear()
            self._pools.clear()
            self._addresses = self._parameter_addresses()
        key = (position, names, tuple(tuple(t.shape) for t in tensors))
        graphed = self._graphs.get(key)
        if graphed is None:
            if len(self._graphs) >= self.max_graphs:
                if not self._warned:
                    log.warning("cuda_graphs: %d shapes captured; new shapes run without a graph", self.max_graphs)
                    self._warned = True
                return self.encoder.embed(inputs)
            graphed = self._capture(position, names, tensors)
            self._graphs[key] = graphed
        return graphed(*tensors)

    def _capture(self, position: int, names: tuple[str, ...], tensors: tuple[Tensor, ...]) -> nn.Module:
        pool = self._pools.setdefault(position, torch.cuda.graph_pool_handle())
        samples = tuple(t.clone() for t in tensors)  # the graph's own input buffers: replays copy into them
        # autocast's weight-cast cache cannot live across a capture; the casts are recorded in the graph instead
        with torch.autocast("cuda", dtype=self.autocast_dtype or torch.bfloat16,
                            enabled=self.autocast_dtype is not None, cache_enabled=False):
            graphed = torch.cuda.make_graphed_callables(_EmbedPass(self.encoder, names), samples, pool=pool,
                                                        allow_unused_input=True)  # e.g. a frozen head
        log.debug("cuda_graphs: captured pass %d at %s", position, [tuple(t.shape) for t in tensors])
        return graphed
