"""What every backend answers, checked on every device this machine can test."""

import gc
import json
import sys
import types

import pytest
import torch

import torchport.testing
from torchport.backends import get_backend
from torchport.backends.dtype_probe import PROBED_DTYPES, probe


def _backend(device: torch.device):
    return get_backend(device.type), device.index or 0


def test_presence_and_description(device: torch.device) -> None:
    b, i = _backend(device)
    assert b.is_available() and b.device_count() >= 1
    assert b.device(i) == device
    assert isinstance(b.device_name(i), str) and b.device_name(i)
    props = b.properties(i)
    assert props and json.dumps(props)  # plain data only
    assert all(isinstance(v, (str, type(None))) for v in b.versions().values())


def test_memory_info(device: torch.device) -> None:
    b, i = _backend(device)
    free, total = b.mem_get_info(i)
    assert 0 <= free <= total and total > 2**20
    stats = b.memory_stats(i)
    assert {"allocated", "reserved", "peak_allocated", "peak_reserved"} <= set(stats)


def test_allocation_is_counted_and_released(device: torch.device) -> None:
    b, i = _backend(device)
    if b.memory_stats(i)["allocated"] is None:
        pytest.skip(f"{device} does not count tensor bytes")
    gc.collect()
    b.synchronize(i)
    before = b.memory_stats(i)["allocated"]
    x = torch.empty(4 * 2**20, dtype=torch.uint8, device=device)
    assert b.memory_stats(i)["allocated"] - before >= x.numel()
    assert b.memory_stats(i)["peak_allocated"] >= before + x.numel()
    del x
    gc.collect()
    assert b.memory_stats(i)["allocated"] == before
    b.empty_cache()
    assert b.memory_stats(i)["reserved"] >= b.memory_stats(i)["allocated"]
    b.reset_peak_memory_stats(i)
    assert b.memory_stats(i)["peak_allocated"] == b.memory_stats(i)["allocated"]


def test_generators_reproduce_and_seeding_reaches_the_device(device: torch.device) -> None:
    b, i = _backend(device)
    draw = lambda g: torch.randn(64, device=device, generator=g).cpu()  # noqa: E731
    assert torch.equal(draw(b.generator(7, i)), draw(b.generator(7, i)))
    assert not torch.equal(draw(b.generator(7, i)), draw(b.generator(8, i)))
    b.manual_seed_all(3)
    first = torch.randn(64, device=device).cpu()
    b.manual_seed_all(3)
    assert torch.equal(first, torch.randn(64, device=device).cpu())


def test_events_time_device_work(device: torch.device) -> None:
    b, i = _backend(device)
    start, end = b.event(enable_timing=True), b.event(enable_timing=True)
    if start is None:
        pytest.skip(f"{device} has no device events (host clock is used)")
    x = torch.randn(256, 256, device=device)
    start.record()
    for _ in range(3):
        x = x @ x / 16
    end.record()
    end.synchronize()
    assert start.elapsed_time(end) >= 0


def test_streams(device: torch.device) -> None:
    b, i = _backend(device)
    s = b.stream(i)
    if s is None:
        pytest.skip(f"{device} has no streams")
    assert b.current_stream(i) is not None
    s.synchronize()


def test_dtype_probes(device: torch.device) -> None:
    b, i = _backend(device)
    probes = b.dtype_probes(i)
    assert list(probes) == list(PROBED_DTYPES)
    assert probes[torch.float32].works and probes[torch.float32].max_error < 1e-3
    assert probes is b.dtype_probes(i)  # cached
    for p in probes.values():
        assert p.works == (p.error is None)
        json.dumps(p.to_dict())
    assert b.preferred_dtype(i) in (torch.bfloat16, torch.float16, torch.float32)


def test_probe_inside_a_default_device_block(device: torch.device) -> None:
    b, i = _backend(device)
    with torch.device(device):  # models are often built this way; the probe makes its inputs on the host
        assert probe(b, torch.float32, i).works


def test_a_broken_dtype_fails_its_probe(device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    b, i = _backend(device)
    real_softmax = torch.softmax

    def saturating_softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
        out = real_softmax(x, dim=dim)
        return out.round() if x.dtype == torch.float16 else out  # a device that "computes" fp16 wrongly

    monkeypatch.setattr(torch, "softmax", saturating_softmax)
    result = probe(b, torch.float16, i)
    assert not result.works and "exceeds" in result.error


def test_probing_off_trusts_the_vendor(device: torch.device) -> None:
    import torchport

    b, i = _backend(device)
    with torchport.settings.override(probe=False):
        assert b.dtype_works(torch.float32, i)
        assert b.dtype_works(torch.bfloat16, i) == b.claims_dtype(torch.bfloat16, i)


def test_inductor_compiles_for_the_devices_it_generates_code_for(device: torch.device,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Whether torch.compile's default backend generates code for the device: CPU and CUDA yes; the simulated NPU
    no (no torch_npu), a chip whose torch_npu has NPU Inductor yes (its ``register_inductor_npu``), an older one no."""
    backend = get_backend(device.type)
    if device.type != "npu":
        assert backend.inductor_compiles() is True
        return
    if torchport.testing.is_simulating():
        assert backend.inductor_compiles() is False
    for has_inductor in (True, False):
        dynamo = types.ModuleType("torch_npu.utils._dynamo")
        if has_inductor:
            dynamo.register_inductor_npu = lambda: None
        monkeypatch.setitem(sys.modules, "torch_npu.utils._dynamo", dynamo)
        assert backend.inductor_compiles() is has_inductor
