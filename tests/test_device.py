"""Device selection and the torch_npu loading trap (no Ascend hardware here).

The stand-in torch_npu below only fails to import, the way torch_npu does on a
host without CANN; it tests the wiring and claims nothing about NPU numerics.
"""

import os
import subprocess
import sys

import pytest

from torchtitan_npu.distributed import (
    DEVICE_ENV,
    TorchNpuLoadError,
    backend_for,
    load_torch_npu,
    select_device_type,
)
from torchtitan_npu.distributed.device import torch_npu_installed
from torchtitan_npu.errors import DeviceError


@pytest.fixture
def broken_torch_npu(tmp_path, monkeypatch):
    if "torch_npu" in sys.modules:
        pytest.skip("the real torch_npu is loaded in this process (an NPU host)")
    package = tmp_path / "torch_npu"
    package.mkdir()
    (package / "__init__.py").write_text(
        "raise ImportError('libhccl.so: cannot open shared object file')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_broken_torch_npu_is_a_clear_error(broken_torch_npu, monkeypatch):
    monkeypatch.delenv(DEVICE_ENV, raising=False)
    monkeypatch.delenv("TORCH_DEVICE_BACKEND_AUTOLOAD", raising=False)
    with pytest.raises(TorchNpuLoadError) as info:
        load_torch_npu()
    message = str(info.value)
    assert "libhccl.so" in message and "\n" not in message
    assert "--device cpu" in message
    assert "CANN" in message


@pytest.mark.parametrize(
    "env", [{DEVICE_ENV: "cpu"}, {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}]
)
def test_escape_hatch_keeps_torch_npu_out(broken_torch_npu, monkeypatch, env):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert load_torch_npu() is None  # the broken torch_npu is never imported
    assert "torch_npu" not in sys.modules


def test_doctor_reports_broken_torch_npu_plainly(broken_torch_npu):
    env = dict(os.environ, PYTHONPATH=str(broken_torch_npu))
    for name in ("TITAN_NPU_NO_BOOTSTRAP", DEVICE_ENV, "TORCH_DEVICE_BACKEND_AUTOLOAD"):
        env.pop(name, None)
    result = subprocess.run(
        [sys.executable, "-m", "torchtitan_npu.cli", "doctor"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 1
    assert "NOT ACTIVE: TorchNpuLoadError" in result.stdout
    assert "--device cpu" in result.stdout


@pytest.mark.skipif(torch_npu_installed(), reason="torch_npu is installed here")
def test_without_torch_npu_nothing_is_loaded():
    assert load_torch_npu() is None


def test_device_selection_and_backends(monkeypatch):
    monkeypatch.delenv(DEVICE_ENV, raising=False)
    import torch

    npu = hasattr(torch, "npu") and torch.npu.is_available()
    expected = "npu" if npu else "cuda" if torch.cuda.is_available() else "cpu"
    assert select_device_type() == expected
    assert select_device_type("cpu") == "cpu"
    monkeypatch.setenv(DEVICE_ENV, "cpu")
    assert select_device_type() == "cpu"
    assert [backend_for(d) for d in ("npu", "cuda", "cpu")] == ["hccl", "nccl", "gloo"]
    with pytest.raises(DeviceError, match="unknown device type 'tpu'"):
        select_device_type("tpu")
    if not hasattr(torch, "npu"):
        with pytest.raises(
            DeviceError,
            match=f"'npu' was requested but is absent .* --device {expected}",
        ):
            select_device_type("npu")
