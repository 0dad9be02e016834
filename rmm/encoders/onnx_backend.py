"""An encoder's forward pass (transformer → pooling → head → norm) as an ONNX graph for ONNX Runtime.

Why only as an int8 graph for queries: measured on all-MiniLM-L6-v2 at one CPU thread
(`research/bench_onnx_encoder.py`), ONNX Runtime's float32 is 1.0-1.14x torch's oneDNN path on the
topic fallback's texts — not worth a second code path for passages. The server's int8 query
scheme (one activation scale per token, see `rmm.encoders.query.precision`) as an ONNX graph keeps its
recall and batch invariance (`research/recall_onnx_query_batching.py`) and costs ~2.1x less CPU
than torch for a query alone (torch's per-module overhead dominates one short sequence), 1.1-1.2x
less in micro-batches of 32. ONNX Runtime's own dynamic quantization is not used: its one
activation scale per tensor makes a query's vector depend on the rest of its batch (68 % of
top-5 lists changed on LoCoMo).

Graphs are exported once and cached under the rmm cache folder, keyed by the encoder's
fingerprint, the torch version and this module's format; a later process only loads the file.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from rmm.encoders.pooling import EncoderError, pool
from rmm.paths import cache_dir

__all__ = ["GRAPHS", "ONNX_SUBDIR", "OnnxBackendError", "OnnxRunner", "cached_graph", "export_onnx", "graph_file",
           "onnxruntime_available", "open_graph", "row_int8_graph"]

log = logging.getLogger(__name__)

GRAPHS = ("float32", "int8-rows")
ONNX_SUBDIR = "onnx"  # the cached graphs' folder under the rmm cache directory
EXPORT_FORMAT = 1  # part of the cache key: bump when an exported graph changes meaning
OPSET = 17


class OnnxBackendError(EncoderError):
    """ONNX Runtime cannot run this encoder: onnxruntime missing, or the export or the session failed."""


def onnxruntime_available() -> bool:
    """Whether `onnxruntime` and `onnx` (which torch's exporter writes with) can be imported."""
    try:
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401
    except ImportError:
        return False
    return True


class _Forward(nn.Module):
    """What `Encoder.embed` computes, as one module with tensor inputs (what the exporter traces)."""

    def __init__(self, encoder: Any) -> None:
        super().__init__()
        self.model = copy.deepcopy(encoder.model).float()
        for module in self.model.modules():  # oneDNN's op has no ONNX form; the plain linear is the same
            if isinstance(module, nn.Linear):
                module.__class__ = nn.Linear
        self.dense = encoder.dense
        self.pooling = encoder.config.pooling
        self.normalize = encoder.config.normalize
        self.use_cache = encoder._wants_use_cache

    def forward(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor | None = None) -> Tensor:
        kwargs: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention_mask}
        if position_ids is not None:
            kwargs["position_ids"] = position_ids
        if self.use_cache:
            kwargs["use_cache"] = False
        outputs = self.model(**kwargs)
        hidden = outputs.last_hidden_state if hasattr(outputs, "last_hidden_state") else outputs[0]
        pooled = pool(hidden, attention_mask, self.pooling)
        if self.dense is not None:
            pooled = self.dense(pooled)
        if self.normalize:
            pooled = nn.functional.normalize(pooled, p=2, dim=-1)
        return pooled


def export_onnx(encoder: Any, path: Path) -> Path:
    """Export `encoder`'s float32 forward pass to `path`, batch and sequence axes dynamic."""
    if encoder.device.type != "cpu":
        raise OnnxBackendError(f"encoder {encoder.name!r} is on {encoder.device}; ONNX export here runs on the CPU")
    forward = _Forward(encoder).eval()
    sample = encoder.collate([[encoder.pad_token_id] * 4, [encoder.pad_token_id] * 6])
    names = list(sample)  # input_ids, attention_mask (+ position_ids for left-padded models)
    axes = {name: {0: "batch", 1: "sequence"} for name in names} | {"embedding": {0: "batch"}}
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            torch.onnx.export(forward, tuple(sample[name] for name in names), str(path), input_names=names,
                              output_names=["embedding"], dynamic_axes=axes, opset_version=OPSET, dynamo=False)
    except Exception as err:  # the exporter raises assorted types; one line says which model failed
        raise OnnxBackendError(f"encoder {encoder.name!r}: ONNX export failed: {type(err).__name__}: "
                               f"{str(err).splitlines()[0] if str(err) else ''}") from err
    return path


def row_int8_graph(source: Path, target: Path) -> Path:
    """`source` with the int8 scheme of `rmm.encoders.query.int8_linear.RowInt8Linear`: every MatMul by a
    weight matrix becomes per-token activation quantization (one scale per row, ±127, ONNX's
    half-to-even Round as torch's), shifted by 128 to uint8 with zero point 128 (ONNX Runtime's
    fast integer kernels are u8·s8; the products are the same integers), MatMulInteger with
    per-output-channel int8 weights, and one float rescale. No scale is shared across rows."""
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(str(source))
    graph = model.graph
    weights = {init.name: init for init in graph.initializer}
    constants = {"q_127": np.array(127.0, np.float32), "q_m127": np.array(-127.0, np.float32),
                 "q_tiny": np.array(1e-12, np.float32), "q_128": np.array(128.0, np.float32),
                 "q_zp_a": np.array(128, np.uint8), "q_zp_b": np.array(0, np.int8)}
    extra = [numpy_helper.from_array(value, name) for name, value in constants.items()]
    nodes: list[Any] = []
    replaced: set[str] = set()
    for n, node in enumerate(graph.node):
        weight_name = node.input[1] if node.op_type == "MatMul" else ""
        if weight_name not in weights or len(weights[weight_name].dims) != 2:
            nodes.append(node)
            continue
        weight = numpy_helper.to_array(weights[weight_name]).astype(np.float32)  # [in, out]
        scale = (np.maximum(np.abs(weight).max(axis=0), 1e-12) / 127.0).astype(np.float32)
        quantized = np.clip(np.round(weight / scale), -127, 127).astype(np.int8)
        extra += [numpy_helper.from_array(quantized, f"{weight_name}_q"),
                  numpy_helper.from_array(scale, f"{weight_name}_s")]
        replaced.add(weight_name)
        p, x = f"q{n}_", node.input[0]
        nodes += [helper.make_node("Abs", [x], [p + "abs"]),
                  helper.make_node("ReduceMax", [p + "abs"], [p + "max"], axes=[-1], keepdims=1),
                  helper.make_node("Max", [p + "max", "q_tiny"], [p + "max1"]),
                  helper.make_node("Div", [p + "max1", "q_127"], [p + "scale"]),
                  helper.make_node("Div", [x, p + "scale"], [p + "scaled"]),
                  helper.make_node("Round", [p + "scaled"], [p + "round"]),
                  helper.make_node("Clip", [p + "round", "q_m127", "q_127"], [p + "clip"]),
                  helper.make_node("Add", [p + "clip", "q_128"], [p + "shift"]),
                  helper.make_node("Cast", [p + "shift"], [p + "uint8"], to=onnx.TensorProto.UINT8),
                  helper.make_node("MatMulInteger", [p + "uint8", f"{weight_name}_q", "q_zp_a", "q_zp_b"],
                                   [p + "int32"]),
                  helper.make_node("Cast", [p + "int32"], [p + "float"], to=onnx.TensorProto.FLOAT),
                  helper.make_node("Mul", [p + "float", p + "scale"], [p + "rows"]),
                  helper.make_node("Mul", [p + "rows", f"{weight_name}_s"], [node.output[0]])]
    if not replaced:
        raise OnnxBackendError(f"{source}: no MatMul by a weight matrix to quantize")
    kept = [init for init in graph.initializer if init.name not in replaced]
    del graph.node[:]
    graph.node.extend(nodes)
    del graph.initializer[:]
    graph.initializer.extend(kept + extra)
    onnx.save(model, str(target))
    return target


def graph_file(encoder: Any, graph: str, cache: str | os.PathLike[str] | None = None) -> Path:
    """Where `encoder`'s `graph` is cached: one file per fingerprint, torch version and format."""
    key = hashlib.sha256(f"{encoder.fingerprint}|{torch.__version__}|{EXPORT_FORMAT}".encode()).hexdigest()[:16]
    return cache_dir(cache) / ONNX_SUBDIR / f"{encoder.fingerprint.split(':')[0]}-{key}-{graph}.onnx"


def cached_graph(encoder: Any, graph: str, cache: str | os.PathLike[str] | None = None) -> Path:
    """`encoder`'s `graph` (`float32` or `int8-rows`), exported on first use and then read from
    the cache; written to a temporary file and renamed, so a crash leaves no half graph behind."""
    if graph not in GRAPHS:
        raise OnnxBackendError(f"graph must be one of {list(GRAPHS)}, got {graph!r}")
    if not onnxruntime_available():
        raise OnnxBackendError("ONNX Runtime is not installed: pip install 'rmm[onnx]' (onnxruntime, onnx)")
    path = graph_file(encoder, graph, cache)
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        exported = export_onnx(encoder, Path(tmp) / "float32.onnx")
        built = exported if graph == "float32" else row_int8_graph(exported, Path(tmp) / f"{graph}.onnx")
        os.replace(built, path)
    log.info("encoder %s: %s graph exported to %s", encoder.name, graph, path)
    return path


class OnnxRunner:
    """An ONNX Runtime session over an exported encoder graph: `Encoder.collate`'s inputs → vectors.

    `threads` defaults to torch's intra-op thread count, so `torch_threads` settings carry over.
    """

    def __init__(self, path: Path, threads: int | None = None) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.intra_op_num_threads = threads or torch.get_num_threads()
        options.inter_op_num_threads = 1
        options.log_severity_level = 3
        try:
            self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        except Exception as err:  # onnxruntime raises its own types for an unreadable graph
            raise OnnxBackendError(f"cannot open ONNX graph {path}: {str(err).splitlines()[0]}") from err
        self.path = path
        self.input_names = [node.name for node in self.session.get_inputs()]

    def __call__(self, inputs: dict[str, Tensor]) -> Tensor:
        feed = {name: inputs[name].cpu().numpy() for name in self.input_names}
        return torch.from_numpy(self.session.run(None, feed)[0])


def open_graph(encoder: Any, graph: str, cache: str | os.PathLike[str] | None = None) -> OnnxRunner:
    """A runner over `encoder`'s cached `graph`; an unreadable cached file is exported again once."""
    path = cached_graph(encoder, graph, cache)
    try:
        return OnnxRunner(path)
    except OnnxBackendError as err:
        log.warning("%s; exporting it again", err)
        path.unlink(missing_ok=True)
        return OnnxRunner(cached_graph(encoder, graph, cache))
