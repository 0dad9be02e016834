"""The encoder as an ONNX graph: same vectors as torch, the server's int8 scheme in ONNX Runtime
(batch-invariant, close to torch's int8), exported once and cached, one-line errors."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from rmm.encoders import onnx_backend
from rmm.encoders.onnx_backend import (
    OnnxBackendError,
    OnnxRunner,
    cached_graph,
    open_graph,
)
from rmm.errors import ConfigError
from rmm.serve.config import load_config
from rmm.encoders.query.precision import Int8QueryEncoder, build_engine

pytest.importorskip("onnxruntime")  # the optional rmm[onnx] extra (in dev)
pytest.importorskip("onnx")

FACTS = ["Ana hikes mountain trails every weekend", "Ana bakes sourdough bread on Sundays",
         "Ana plays cello in a community orchestra", "Ana adopted a golden retriever puppy"]
QUESTIONS = ["Where does she hike?", "Who bakes bread?", "Which instrument does Ana play?", "Does she have a dog?"]
OTHERS = ["Hi", "What did Ana say about the orchestra rehearsal she had last Thursday evening with her friends?",
          "Dog?", "Which trail near the lake did she hike with her sister during the long weekend in May?"]


@pytest.fixture(scope="module")
def minilm(minilm_path: Path):
    from rmm.encoders import load_encoder

    return load_encoder("minilm", device="cpu")


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("rmm-cache")


def test_float32_graph_gives_torch_vectors(minilm, cache: Path) -> None:
    runner = OnnxRunner(cached_graph(minilm, "float32", cache), threads=1)
    for texts in (FACTS, QUESTIONS + OTHERS, ["x"]):
        inputs = minilm.collate(minilm.tokenize(texts))
        with torch.inference_mode():
            exact = minilm.embed(inputs)
        assert (runner(inputs) - exact).abs().max() < 1e-5  # measured ~2e-7 on LoCoMo


def test_int8_onnx_queries_match_torch_int8_and_ignore_their_batch(minilm, monkeypatch, cache: Path) -> None:
    monkeypatch.setenv("RMM_CACHE_DIR", str(cache))
    fast = build_engine(minilm, "int8-onnx")
    assert isinstance(fast, Int8QueryEncoder) and fast.engine == "onnx" and fast.fingerprint == minilm.fingerprint
    passages = minilm.encode_passages(FACTS)
    assert torch.equal(fast.encode_passages(FACTS), passages)  # what the bank stores does not change
    quick, torch_int8 = fast.encode_queries(QUESTIONS), Int8QueryEncoder(minilm).encode_queries(QUESTIONS)
    assert torch.nn.functional.cosine_similarity(quick, torch_int8).min() > 0.99
    assert torch.equal((quick @ passages.T).argmax(dim=1), torch.arange(4))
    alone = torch.cat([fast.encode_queries([q]) for q in QUESTIONS])
    for batch in (QUESTIONS + OTHERS, OTHERS[:2] + QUESTIONS[::-1] + OTHERS[2:]):
        vectors = fast.encode_queries(batch)
        rows = torch.stack([vectors[batch.index(q)] for q in QUESTIONS])
        assert (rows - alone).abs().max() < 1e-5  # float rounding at most; ORT's own int8 moved whole rankings
    assert fast.encode_queries([]).shape == (0, 384)
    assert load_config(None, {"bank": "/tmp/x", "query_precision": "int8-onnx"}, environ={}).query_precision == "int8-onnx"


def test_row_int8_graph_quantizes_every_weight_matmul(minilm, cache: Path) -> None:
    import onnx

    graph = onnx.load(str(cached_graph(minilm, "int8-rows", cache)))
    ops = [node.op_type for node in graph.graph.node]
    assert ops.count("MatMulInteger") == 6 * 6  # Q, K, V, output, FFN in and out per layer (no pooler: unused)
    assert ops.count("MatMul") == 6 * 2  # attention's QK and AV stay float32
    assert "DynamicQuantizeLinear" not in ops  # no per-tensor activation scale


def test_graph_is_exported_once_and_reused(minilm, monkeypatch, tmp_path: Path) -> None:
    exports: list[Path] = []
    export = onnx_backend.export_onnx

    def counting(encoder, path):  # type: ignore[no-untyped-def]
        exports.append(path)
        return export(encoder, path)

    monkeypatch.setattr(onnx_backend, "export_onnx", counting)
    first = cached_graph(minilm, "float32", tmp_path)
    assert cached_graph(minilm, "float32", tmp_path) == first and len(exports) == 1
    assert first.parent == tmp_path / "onnx" and minilm.fingerprint.split(":")[0] in first.name
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no scratch left behind
    first.write_bytes(b"not a graph")  # a damaged cache file is exported again, once
    runner = open_graph(minilm, "float32", tmp_path)
    assert len(exports) == 2 and runner.path == first


def test_missing_onnxruntime_is_one_clear_line(minilm, monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import fails as if not installed
    assert not onnx_backend.onnxruntime_available()
    with pytest.raises(ConfigError, match=r"int8-onnx: ONNX Runtime is not installed: pip install 'rmm\[onnx\]'"):
        build_engine(minilm, "int8-onnx")
    with pytest.raises(OnnxBackendError, match="not installed"):
        cached_graph(minilm, "float32", tmp_path)
    assert not any(tmp_path.iterdir())


def test_failed_export_is_one_line_and_leaves_no_file(minilm, monkeypatch, tmp_path: Path) -> None:
    def broken(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("unsupported operator aten::foo\nlong traceback text")

    monkeypatch.setattr(torch.onnx, "export", broken)
    with pytest.raises(OnnxBackendError, match=r"ONNX export failed: RuntimeError: unsupported operator aten::foo$"):
        cached_graph(minilm, "int8-rows", tmp_path)
    assert list((tmp_path / "onnx").iterdir()) == []
    with pytest.raises(OnnxBackendError, match="graph must be one of"):
        cached_graph(minilm, "int4", tmp_path)
