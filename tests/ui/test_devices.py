"""The Devices tab's functions: device rows from torchport.memory(), the host line, the live history, and the
utilisation each backend reports."""

from __future__ import annotations

import re

import pytest
import torch

import torchport
from torchport.backends import get_backend
from torchport.backends.base import Backend
from torchport.backends.cuda import CudaBackend
from torchport.ui import devices


def test_format_bytes() -> None:
    assert devices.format_bytes(None) == "-"
    assert devices.format_bytes(512) == "512 B"
    assert devices.format_bytes(3 * 2**20) == "3.00 MiB"
    assert devices.format_bytes(int(1.5 * 2**30)) == "1.50 GiB"


def test_rows_list_every_device_with_memory_in_use(npu: torch.device) -> None:
    snapshot = torchport.memory()
    rows = devices.device_rows(snapshot)
    assert [row["device"] for row in rows] == [str(d) for d in torchport.devices()]
    by_name = {row["device"]: row for row in rows}
    assert {"npu:0", "cpu"} <= set(by_name)
    for row in rows:
        entry = snapshot["devices"][row["device"]]
        assert row["total"] == entry["total"] and row["used"] == entry["total"] - entry["free"]
        assert 0 <= row["used_pct"] <= 100
    assert by_name["npu:0"]["name"] == get_backend("npu").device_name(0) + " (simulated)"
    assert by_name["cpu"]["allocated"] is None  # PyTorch counts no CPU tensor bytes


def test_rows_follow_what_this_process_holds(npu: torch.device) -> None:
    before = {row["device"]: row for row in devices.device_rows()}["npu:0"]
    held = torch.empty(8 * 2**20, dtype=torch.uint8, device=npu)
    during = {row["device"]: row for row in devices.device_rows()}["npu:0"]
    assert during["allocated"] - before["allocated"] == held.numel()
    assert during["used"] > before["used"]


def test_table_cells_say_what_is_not_reported(npu: torch.device) -> None:
    cells = {row[0]: row for row in devices.table_rows(devices.device_rows())}
    assert len(cells["cpu"]) == len(devices.TABLE_HEADERS)
    assert cells["cpu"][5] == "not counted" and cells["cpu"][6] == "not reported"
    assert cells["npu:0"][6] == "0 %"  # the simulated NPU reports an idle device, as torch_npu's API does
    assert cells["npu:0"][3].endswith("GiB")


def test_host_summary_names_ram_and_this_process() -> None:
    text = devices.host_summary()
    assert text.startswith("**Host RAM**:") and re.search(r"[0-9.]+ [KMGT]iB used of [0-9.]+ [KMGT]iB", text), text
    assert "this dashboard's process" in text and "resident" in text
    unreadable = {"devices": {}, "host": {"total": None, "available": None, "process_rss": 5 * 2**20,
                                          "process_peak_rss": None}}
    assert "not readable" in devices.host_summary(unreadable) and "5.00 MiB resident" in devices.host_summary(unreadable)


def test_history_keeps_the_last_span_and_makes_plot_frames() -> None:
    pytest.importorskip("pandas")
    history = devices.MemoryHistory(span_s=10)

    def row(name: str, used: int, util: float | None) -> dict:
        return {"device": name, "used": used, "used_pct": 100 * used / 2**36, "utilization": util}

    for t in range(15):
        history.add([row("npu:0", t * 2**30, 50.0), row("cpu", 2**30, None)], now=100.0 + t)
    memory = history.memory_frame()
    assert memory.columns.tolist() == ["seconds", "device", "% in use", "GiB in use"]
    assert memory["seconds"].min() == -10 and memory["seconds"].max() == 0  # 11 samples: 104..114
    assert len(memory) == 2 * 11
    last = memory[(memory["seconds"] == 0) & (memory["device"] == "npu:0")]["GiB in use"].item()
    assert last == 14
    assert memory[(memory["seconds"] == 0) & (memory["device"] == "npu:0")]["% in use"].item() == 100 * 14 / 64
    util = history.utilization_frame()
    assert set(util["device"]) == {"npu:0"}  # the CPU reports none
    assert devices.MemoryHistory().memory_frame().empty


def test_machine_reports_an_error_instead_of_failing() -> None:
    assert devices.machine()["torch"]["version"] == torch.__version__
    with torchport.settings.override(device="npu:9"):
        broken = devices.machine()
    assert set(broken) == {"error"} and "npu:9" in broken["error"]


# -- utilisation, as each backend reports it ---------------------------------------------------------------------
def test_utilisation_is_none_where_a_backend_does_not_report_it() -> None:
    assert devices.utilization(torch.device("cpu")) is None
    assert Backend.utilization(get_backend("cpu"), 0) is None


def test_npu_utilisation_comes_from_the_device_module(npu: torch.device) -> None:
    assert devices.utilization(npu) == 0.0


def test_cuda_utilisation_without_nvml_is_not_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def no_nvml(device: int) -> int:
        calls.append(device)
        raise ModuleNotFoundError("pynvml does not seem to be installed or it can't be imported.")

    monkeypatch.setattr(torch.cuda, "utilization", no_nvml)
    backend = CudaBackend()
    assert backend.utilization(0) is None and backend.utilization(0) is None
    assert calls == [0]  # a failure is remembered: the dashboard asks every second
    monkeypatch.setattr(torch.cuda, "utilization", lambda device: 37)
    assert CudaBackend().utilization(1) == 37.0
