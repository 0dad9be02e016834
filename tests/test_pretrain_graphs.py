"""Pretraining with CUDA graphs (`cuda_graphs: true`): length buckets, padding that changes no
embedding, the settings it refuses, and (on a GPU) graphed steps that equal eager ones."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")

from rmm.data import load_dataset
from rmm.encoders import load_encoder
from rmm.encoders.random_weights import write_random_encoder
from rmm.errors import RmmError
from rmm.training.pretrain import build, make_trainer, run_pretrain
from rmm.encoders.cuda_graphs import bucket_length
from rmm.training.pretrain.graphs import GraphedPasses
from rmm.training.pretrain_config import PretrainConfig, PretrainConfigError

TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
        "max_position_embeddings": 128, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        return write_random_encoder("minilm", tmp_path_factory.mktemp("tiny") / "model", **TINY)
    except RmmError as err:  # no MiniLM tokenizer on this machine
        pytest.skip(str(err))


def test_bucket_lengths_cover_the_text_and_are_few() -> None:
    lengths = {bucket_length(n, 256) for n in range(1, 257)}
    assert all(bucket_length(n, 256) >= n for n in range(1, 300))
    assert bucket_length(17, 256) == 32 and bucket_length(64, 256) == 64 and bucket_length(65, 256) == 96
    assert bucket_length(129, 256) == 192 and bucket_length(250, 256) == 256
    assert bucket_length(250, 240) == 250  # the limit never cuts a text; it caps the padding
    assert len(lengths) == 4 + 2 + 2  # 16..64 by 16, 96 and 128, 192 and 256


def test_padding_to_a_bucket_changes_no_embedding(tiny_folder: Path) -> None:
    encoder = load_encoder(str(tiny_folder), device="cpu")
    ids = [encoder.tokenizer(text)["input_ids"] for text in ("a short one", "a somewhat longer text than that")]
    tight, padded = encoder.collate(ids), encoder.collate(ids, length=48)
    assert tight["input_ids"].shape[1] < 48 == padded["input_ids"].shape[1]
    with torch.no_grad():
        torch.testing.assert_close(encoder.embed(tight), encoder.embed(padded), atol=1e-5, rtol=1e-5)


def test_the_data_module_pads_each_pass_to_its_bucket_only_under_cuda_graphs(tiny_folder: Path) -> None:
    dataset = load_dataset("locomo")
    for graphs in (False, True):
        cfg = PretrainConfig(encoder=str(tiny_folder), batch_size=8, max_length=64, accelerator="auto",
                             progress=False, checkpoint=False, eval_before=False, merge_passes="none",
                             cuda_graphs=graphs)  # accelerator auto: allowed; the module checks the device
        module, data = build(cfg, dataset)
        data.pretokenize()
        batch = data.collate("train", list(range(8)))
        widths = [inputs["input_ids"].shape[1] for inputs in batch["passes"]]
        longest = [int(inputs["attention_mask"].sum(1).max()) for inputs in batch["passes"]]
        if graphs:
            assert widths == [bucket_length(n, 64) for n in longest]
        else:
            assert widths == longest


@pytest.mark.parametrize("clash", [{"torch_compile": True}, {"gradient_checkpointing": True},
                                   {"precision": "16-mixed"}, {"accelerator": "cpu"}])
def test_cuda_graphs_refuses_what_it_cannot_capture(clash: dict) -> None:
    with pytest.raises(PretrainConfigError, match="cuda_graphs does not combine"):
        PretrainConfig(cuda_graphs=True, **clash)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where there is no GPU")
def test_cuda_graphs_without_a_gpu_is_a_clear_error(tiny_folder: Path, tmp_path: Path) -> None:
    with pytest.raises(RmmError, match="CUDA"):
        GraphedPasses(load_encoder(str(tiny_folder), device="cpu"), None)
    cfg = PretrainConfig(encoder=str(tiny_folder), batch_size=8, max_steps=1, progress=False, checkpoint=False,
                         eval_before=False, cuda_graphs=True, val_fraction=0.0)
    module, data = build(cfg)
    with pytest.raises(RmmError, match="CUDA device"):
        make_trainer(cfg).fit(module, datamodule=data)
    with pytest.raises(PretrainConfigError, match="cuda_graphs: true needs a CUDA device"):
        run_pretrain(dataclasses.replace(cfg, output_dir=str(tmp_path / "run")))  # before any evaluation
    assert not (tmp_path / "run" / "encoder").exists()


def _train(folder: Path, graphs: bool, precision: str, steps: int,
           fits: int = 1) -> tuple[list[float], dict[str, torch.Tensor], int]:
    """Losses, final weights and graphs captured after `fits` fits of `steps` steps each of `rmm
    pretrain`'s module and trainer (Lightning moves the weights to the CPU after each fit)."""
    import lightning as L

    cfg = PretrainConfig(encoder=str(folder), batch_size=8, max_length=64, max_steps=steps, progress=False,
                         checkpoint=False, eval_before=False, val_fraction=0.0, accelerator="gpu", devices=1,
                         precision=precision, merge_passes="candidates", hard_negatives=0, cuda_graphs=graphs)
    module, data = build(cfg)
    losses: list[float] = []
    captured: list[int] = []

    class Losses(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, *_args) -> None:
            losses.append(float(outputs["loss"]))

        def on_train_end(self, trainer, pl_module) -> None:
            captured.append(pl_module.graphed.captured if pl_module.graphed is not None else 0)

    for _ in range(fits):
        make_trainer(cfg, [Losses()]).fit(module, datamodule=data)
        assert module.graphed is None  # graphs end with their fit
    weights = {name: p.detach().float().cpu() for name, p in module.named_parameters()}
    return losses, weights, sum(captured)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("steps", "fits"), [(6, 1), (3, 2)])
def test_graphed_steps_train_as_eager_steps_do(tiny_folder: Path, steps: int, fits: int) -> None:
    """No dropout, fp32: the same batches give the same losses and weights with and without graphs
    (up to the summation order of differently padded attention). Two fits: Lightning moves the
    weights to the CPU after a fit, and a graph kept across fits would replay over freed memory
    (seen on an H200: a device-side assert in the second fit)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    eager_losses, eager_weights, _ = _train(tiny_folder, False, "32-true", steps, fits)
    graph_losses, graph_weights, captured = _train(tiny_folder, True, "32-true", steps, fits)
    assert fits <= captured <= 2 * steps * fits
    assert len(graph_losses) == len(eager_losses) == steps * fits
    torch.testing.assert_close(torch.tensor(graph_losses), torch.tensor(eager_losses), atol=1e-4, rtol=1e-4)
    for name, value in eager_weights.items():
        torch.testing.assert_close(graph_weights[name], value, atol=1e-4, rtol=1e-3, msg=name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graphed_bf16_training_runs_every_step_and_learns(tiny_folder: Path) -> None:
    losses, weights, captured = _train(tiny_folder, True, "bf16-mixed", 12)
    assert len(losses) == 12 and all(torch.isfinite(torch.tensor(losses)))
    assert captured >= 1
    initial = load_encoder(str(tiny_folder), device="cpu").model.state_dict()
    moved = [name for name, value in weights.items()
             if name.startswith("model.") and name[len("model."):] in initial
             and not torch.equal(value, initial[name[len("model."):]].float())]
    assert moved, "no transformer weight changed: the graphed backward fed no gradient to the optimizer"


def test_inference_graphs_need_a_gpu(tiny_folder: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("checks the refusal where there is no GPU")
    with pytest.raises(RmmError, match="cuda_graphs needs a CUDA device"):
        load_encoder(str(tiny_folder), device="cpu", cuda_graphs=True)


def test_row_buckets_are_powers_of_two_within_the_batch_size() -> None:
    from rmm.encoders.cuda_graphs import bucket_rows

    assert [bucket_rows(n, 64) for n in (1, 2, 3, 5, 33, 64)] == [1, 2, 4, 8, 64, 64]
    assert bucket_rows(50, 48) == 50 and bucket_rows(40, 48) == 48


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_inference_graphs_give_the_eager_embeddings(tiny_folder: Path, dtype: str) -> None:
    """Every batch size and length bucket, twice (the second call replays), in any order: the
    embeddings equal the eager encoder's, and no result aliases a graph's output buffer."""
    eager = load_encoder(str(tiny_folder), device="cuda", dtype=dtype, batch_size=16)
    graphed = load_encoder(str(tiny_folder), device="cuda", dtype=dtype, batch_size=16, cuda_graphs=True)
    texts = [" ".join(["word"] * n) + f" {n}" for n in range(1, 60, 3)]
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == "float32" else {"atol": 2e-2, "rtol": 2e-2}
    for subset in (texts, texts[:3], texts[5:6], list(reversed(texts))):
        first = graphed.encode_passages(subset)
        torch.testing.assert_close(first, eager.encode_passages(subset), **tolerance)
        graphed.encode_passages(texts[::-1])  # another replay of the same graphs
        torch.testing.assert_close(graphed.encode_passages(subset), first)
    assert 1 <= graphed.graphs.captured <= 16


def test_the_module_drops_its_graphs_when_a_fit_ends(tiny_folder: Path) -> None:
    module, _ = build(PretrainConfig(encoder=str(tiny_folder), progress=False, checkpoint=False, eval_before=False))
    module.graphed = object()  # type: ignore[assignment]  # stands in for captured graphs
    module.teardown("fit")
    assert module.graphed is None
