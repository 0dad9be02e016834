"""Device names from flags and configs: a missing GPU is a one-line user error."""

from __future__ import annotations

import pytest
import torch

from rmm.device import resolve_device
from rmm.errors import DeviceUnavailableError, RmmError


def test_auto_and_cpu_resolve() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_without_a_gpu_is_a_typed_user_error() -> None:
    with pytest.raises(RmmError, match="CUDA is not available"):
        resolve_device("cuda:0")


def test_a_malformed_device_name_is_a_typed_user_error() -> None:
    with pytest.raises(DeviceUnavailableError, match="unknown device 'gpu0'"):
        resolve_device("gpu0")


def test_eval_with_a_missing_gpu_exits_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    from rmm.cli import main

    assert main(["eval", "--dataset", "locomo", "--retriever", "minilm", "--device", "cuda"]) == 2
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err
    assert "CUDA is not available" in out.out + out.err
