"""`precision: auto` resolves from what torch reports about the device; a slow explicit choice warns."""

import logging

import pytest
import torch

from dipaco import device as device_mod
from dipaco.device import autocast, resolve_precision

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.fixture(autouse=True)
def fresh_cache():
    device_mod._resolve.cache_clear()
    device_mod._LOGGED.clear()
    yield
    device_mod._resolve.cache_clear()
    device_mod._LOGGED.clear()


def fake_cpu(monkeypatch, **caps):
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx2": True, **caps})


def test_auto_is_fp32_on_a_cpu_without_native_bf16(monkeypatch, caplog):
    fake_cpu(monkeypatch, avx512_bf16=False, amx_bf16=False)
    with caplog.at_level(logging.INFO, logger="dipaco.device"):
        assert resolve_precision("auto", CPU) == "fp32"
        assert resolve_precision("auto", CPU) == "fp32"
    assert len([r for r in caplog.records if "precision auto" in r.message]) == 1  # logged once, with the reason
    assert "no native bf16" in caplog.text


@pytest.mark.parametrize("flag", ["avx512_bf16", "amx_bf16"])
def test_auto_is_bf16_on_a_cpu_with_native_bf16(monkeypatch, flag):
    fake_cpu(monkeypatch, **{flag: True})
    assert resolve_precision("auto", CPU) == "bf16"


def test_an_explicit_bf16_on_a_cpu_without_it_is_kept_but_warns(monkeypatch, caplog):
    fake_cpu(monkeypatch, avx512_bf16=False, amx_bf16=False)
    with caplog.at_level(logging.INFO, logger="dipaco.device"):
        assert resolve_precision("bf16", CPU) == "bf16"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "slower than fp32" in warnings[0].message


def test_fp32_and_native_bf16_do_not_warn(monkeypatch, caplog):
    fake_cpu(monkeypatch, avx512_bf16=True)
    with caplog.at_level(logging.INFO, logger="dipaco.device"):
        assert resolve_precision("bf16", CPU) == "bf16"
        assert resolve_precision("fp32", CPU) == "fp32"
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_when_torch_cannot_say_a_timed_matmul_decides(monkeypatch):
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: (_ for _ in ()).throw(RuntimeError("old build")))
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")  # AVX512 without saying BF16
    monkeypatch.setattr(device_mod, "bf16_matmul_is_faster", lambda: True)
    assert resolve_precision("auto", CPU) == "bf16"
    device_mod._resolve.cache_clear()
    monkeypatch.setattr(device_mod, "bf16_matmul_is_faster", lambda: False)
    assert resolve_precision("auto", CPU) == "fp32"


def test_the_timed_matmul_runs_here():
    assert isinstance(device_mod.bf16_matmul_is_faster(size=32, repeats=1), bool)


@pytest.mark.parametrize(("supported", "expected"), [(True, "bf16"), (False, "fp32")])
def test_auto_on_cuda_follows_the_gpus_bf16_support(monkeypatch, supported, expected):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: supported)
    assert resolve_precision("auto", CUDA) == expected


def test_autocast_is_a_no_op_where_auto_means_fp32(monkeypatch):
    fake_cpu(monkeypatch, avx512_bf16=False)
    with autocast(CPU, "auto"):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
    with autocast(CPU, "bf16"):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
