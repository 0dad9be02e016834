"""The cross-device gather under a real process group: 2 CPU processes (gloo) + DistributedDataParallel.

Each rank embeds its shard with a DDP-wrapped tower, `contrastive_loss` all-gathers positives and
hard negatives, and DDP averages the gradients; the mean of the ranks' losses and the averaged
gradients must equal the single-process loss and gradients on the concatenated batch. The
workers run as plain subprocesses (not `mp.spawn`): pytest's importlib mode leaves this module
unimportable by name in a child.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")

from rmm.training.pretrain import contrastive_loss

WORLD, LOCAL, DIM_IN, DIM = 2, 3, 10, 6
SCALE = 20.0

WORKER = textwrap.dedent('''
    import os, sys
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from rmm.training.pretrain import contrastive_loss

    rank, world, folder = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), sys.argv[1]
    dist.init_process_group("gloo", rank=rank, world_size=world)
    inputs = torch.load(os.path.join(folder, "inputs.pt"))
    tower = torch.nn.Linear(inputs["q"].shape[1], inputs["dim"])
    tower.load_state_dict(inputs["state"])

    class Towers(torch.nn.Module):  # one DDP forward embeds all three columns, as training_step does
        def __init__(self, tower):
            super().__init__()
            self.tower = tower

        def forward(self, q, p, n):
            return [torch.nn.functional.normalize(self.tower(x), dim=-1) for x in (q, p, n)]

    model = DistributedDataParallel(Towers(tower))
    local = inputs["q"].shape[0] // world
    rows = slice(rank * local, (rank + 1) * local)
    q, p, n = model(inputs["q"][rows], inputs["p"][rows], inputs["n"][rows])
    loss = contrastive_loss(q, p, n, inputs["scale"])
    loss.backward()
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)
    mean_loss /= world
    with torch.no_grad():  # what a rank would compute without the gather: its own shard only
        from rmm.training.pretrain import contrastive_logits
        logits, labels = contrastive_logits(q, p, n, 0, inputs["scale"])
        local_only = torch.nn.functional.cross_entropy(logits, labels)
    torch.save({"mean_loss": mean_loss, "local_only": local_only, "weight": tower.weight.grad,
                "bias": tower.bias.grad}, os.path.join(folder, f"rank{rank}.pt"))
    dist.destroy_process_group()
''')


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _single_process(inputs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    tower = torch.nn.Linear(DIM_IN, DIM)
    tower.load_state_dict(inputs["state"])
    q, p, n = (torch.nn.functional.normalize(tower(inputs[k]), dim=-1) for k in ("q", "p", "n"))
    loss = contrastive_loss(q, p, n, SCALE)  # no process group: the whole batch in one place
    loss.backward()
    return loss.detach(), tower.weight.grad, tower.bias.grad


@pytest.mark.slow  # two fresh interpreters importing torch + Lightning: ~15-35 s on 2 cores
def test_two_gloo_ranks_give_the_single_process_loss_and_gradients(tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(0)
    tower = torch.nn.Linear(DIM_IN, DIM)
    inputs = {key: torch.randn(WORLD * LOCAL, DIM_IN, generator=generator) for key in ("q", "p", "n")}
    inputs.update(state=tower.state_dict(), dim=DIM, scale=SCALE)
    torch.save(inputs, tmp_path / "inputs.pt")
    (tmp_path / "worker.py").write_text(WORKER)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": str(WORLD),
           "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
    workers = [subprocess.Popen([sys.executable, str(tmp_path / "worker.py"), str(tmp_path)],
                                env={**env, "RANK": str(rank)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True) for rank in range(WORLD)]
    for worker in workers:
        output, _ = worker.communicate(timeout=120)
        assert worker.returncode == 0, output
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    loss, weight_grad, bias_grad = _single_process(inputs)
    for result in ranks:
        assert torch.allclose(result["mean_loss"], loss, atol=1e-6)
        # DDP's averaged gradient (with the gather's summing backward) is the global batch's gradient
        assert torch.allclose(result["weight"], weight_grad, atol=1e-6)
        assert torch.allclose(result["bias"], bias_grad, atol=1e-6)
    # and the gather mattered: a rank alone sees fewer negatives, hence a different loss
    local_mean = torch.stack([r["local_only"] for r in ranks]).mean()
    assert not torch.allclose(local_mean, loss, atol=1e-3)


def _tiny_encoder(folder: Path, minilm_path: Path) -> Path:
    """A 1-layer random BERT with MiniLM's tokenizer, as an rmm encoder folder (with BERT's pooler)."""
    import json
    import shutil

    from transformers import BertConfig, BertModel

    folder.mkdir()
    for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (minilm_path / name).is_file():
            shutil.copy(minilm_path / name, folder / name)
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=128)).save_pretrained(folder)
    (folder / "rmm_encoder.json").write_text(json.dumps({"format": 1, "name": "tiny", "pooling": "mean",
                                                         "normalize": True, "dense": False, "max_length": 64}))
    return folder


@pytest.mark.slow  # Lightning relaunches the command as a second process; ~40 s on 2 cores
def test_rmm_pretrain_runs_under_lightning_ddp_on_two_cpu_processes(tmp_path: Path, tiny_data_dir: Path,
                                                                     minilm_path: Path) -> None:
    """The user's path: `rmm pretrain strategy=ddp devices=2` (gloo). It exercises the sampler's
    sharding, the gather inside training_step, and DDP's check that every trainable parameter gets
    a gradient (BERT's unused pooler used to fail it on the second step)."""
    import json

    rmm = Path(sys.executable).parent / "rmm"
    if not rmm.is_file():
        pytest.skip("the `rmm` console script is not installed beside this interpreter")
    encoder = _tiny_encoder(tmp_path / "tiny", minilm_path)
    report_file = tmp_path / "report.json"
    command = [str(rmm), "pretrain", f"encoder={encoder}", f"data_dir={tiny_data_dir}",
               f"output_dir={tmp_path / 'out'}", "epochs=2", "batch_size=4", "lr=1e-3", "max_length=32",
               "accelerator=cpu", "devices=2", "strategy=ddp", "precision=32-true", "checkpoint=false",
               "progress=false", "val_fraction=0", "test_fraction=0.34", "eval_ks=[5]", "--json", str(report_file)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_PORT": str(_free_port())}
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("encoder folder:") == 1  # only the launching rank reports
    report = json.loads(report_file.read_text())
    # 2 training conversations × 9 pairs = 18; global batches of 4 × 2 ranks → 3 steps per epoch
    assert report["n_pairs"]["train"] == 18 and report["steps"] == 6
    assert report["after"]["n"] == report["before"]["n"] > 0
    assert Path(report["output"], "rmm_encoder.json").is_file()
