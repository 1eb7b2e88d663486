"""The Devices tab: every device with its memory (a live chart), utilisation where the backend reports it, and the
host's RAM, from :func:`torchport.memory`, :func:`torchport.devices` and :func:`torchport.info`."""

from __future__ import annotations

import collections
import functools
import time
from typing import Any

import torch

from .._bytes import format_bytes
from ..backends import get_backend
from ..bench.timing import is_simulated
from ..device import devices
from ..info import info
from ..memory import memory

__all__ = ["HISTORY_S", "REFRESH_S", "MemoryHistory", "device_rows", "format_bytes", "host_summary", "table_rows",
           "machine", "tab", "utilization"]

#: Seconds between two samples of the live chart, and how much of the past it shows.
REFRESH_S = 1.0
HISTORY_S = 120.0
GIB = 2**30


@functools.lru_cache(maxsize=None)
def _name(device: str) -> str:
    dev = torch.device(device)
    backend = get_backend(dev.type)
    name = backend.device_name(dev.index or 0)
    return f"{name} (simulated)" if is_simulated(backend) else name


def machine() -> dict[str, Any]:
    """:func:`torchport.info` without the dtype probes, or ``{"error": ...}`` where it fails (a ``TORCHPORT_DEVICE``
    naming an absent device: the Doctor tab's settings check says what to do).

    Example:
        >>> machine()["torch"]["version"]
        '2.13.0+cpu'
    """
    try:
        return info(probe=False)
    except (ValueError, RuntimeError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def utilization(device: torch.device) -> float | None:
    """Percent of the last sample period in which ``device`` ran work, None where its backend does not report it.

    Example:
        >>> utilization(torch.device("cpu")) is None
        True
    """
    return get_backend(device.type).utilization(device.index or 0)


def device_rows(snapshot: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """One row per device of :func:`torchport.devices`: memory in use on the whole device (total - free, so other
    processes count), its total, what this process's tensors hold, and the utilisation.

    ``snapshot`` is a :func:`torchport.memory` result (default: a new one). The CPU's memory is the host's RAM.

    Example:
        >>> [row["device"] for row in device_rows()]
        ['npu:0', 'cpu']
    """
    snapshot = memory() if snapshot is None else snapshot
    rows = []
    for dev in devices():
        entry = snapshot["devices"].get(str(dev), {})
        free, total = entry.get("free"), entry.get("total")
        used = None if free is None or total is None else total - free
        rows.append({
            "device": str(dev),
            "type": dev.type,
            "name": _name(str(dev)),
            "used": used,
            "total": total,
            "used_pct": None if used is None or not total else 100 * used / total,
            "allocated": entry.get("allocated"),
            "reserved": entry.get("reserved"),
            "peak_allocated": entry.get("peak_allocated"),
            "utilization": utilization(dev),
        })
    return rows


TABLE_HEADERS = ["device", "name", "memory used", "total", "used %", "held by this process's tensors",
                 "utilisation"]


def table_rows(rows: list[dict[str, Any]]) -> list[list[str]]:
    """:func:`device_rows` as the table's text cells (columns :data:`TABLE_HEADERS`).

    Example:
        >>> table_rows(device_rows())[-1][:2]
        ['cpu', 'Intel(R) Xeon(R) ...']
    """
    cells = []
    for row in rows:
        held = "not counted" if row["allocated"] is None else (
            f"{format_bytes(row['allocated'])} (reserved {format_bytes(row['reserved'])}, "
            f"peak {format_bytes(row['peak_allocated'])})")
        cells.append([
            row["device"], row["name"], format_bytes(row["used"]), format_bytes(row["total"]),
            "-" if row["used_pct"] is None else f"{row['used_pct']:.1f}",
            held,
            "not reported" if row["utilization"] is None else f"{row['utilization']:.0f} %",
        ])
    return cells


def host_summary(snapshot: dict[str, Any] | None = None) -> str:
    """Host RAM in use and this process's resident set, as one Markdown line.

    Example:
        >>> host_summary()
        '**Host RAM**: 12.40 GiB used of 31.25 GiB (39.7 %), 18.85 GiB available · **this dashboard**: ...'
    """
    host = (memory() if snapshot is None else snapshot)["host"]
    total, available = host.get("total"), host.get("available")
    if total is None or available is None:
        ram = "**Host RAM**: not readable on this system"
    else:
        ram = (f"**Host RAM**: {format_bytes(total - available)} used of {format_bytes(total)} "
               f"({100 * (total - available) / total:.1f} %), {format_bytes(available)} available")
    return (f"{ram} · **this dashboard's process**: {format_bytes(host.get('process_rss'))} resident "
            f"(peak {format_bytes(host.get('process_peak_rss'))})")


class MemoryHistory:
    """The last :data:`HISTORY_S` seconds of device memory in use and utilisation, one sample per refresh.

    Example:
        >>> history = MemoryHistory()
        >>> history.add(device_rows())
        >>> history.memory_frame().columns.tolist()
        ['seconds', 'device', '% in use', 'GiB in use']
    """

    def __init__(self, span_s: float = HISTORY_S) -> None:
        self.span_s = span_s
        self.samples: collections.deque[tuple[float, list[dict[str, Any]]]] = collections.deque()

    def add(self, rows: list[dict[str, Any]], now: float | None = None) -> None:
        """Add one sample (:func:`device_rows`) taken at ``now`` (default: the monotonic clock); forget older ones."""
        now = time.monotonic() if now is None else now
        self.samples.append((now, rows))
        while self.samples and self.samples[0][0] < now - self.span_s:
            self.samples.popleft()

    def _frame(self, columns: dict[str, tuple[str, float]]) -> Any:
        import pandas as pd

        now = self.samples[-1][0] if self.samples else 0.0
        first = next(iter(columns.values()))[0]
        records = [
            {"seconds": round(t - now, 1), "device": row["device"],
             **{column: row[key] / scale for column, (key, scale) in columns.items()}}
            for t, rows in self.samples for row in rows if row[first] is not None
        ]
        return pd.DataFrame(records, columns=["seconds", "device", *columns])

    def memory_frame(self) -> Any:
        """Memory in use per device, in percent of its total and in GiB, against seconds before the last sample
        (a pandas DataFrame)."""
        return self._frame({"% in use": ("used_pct", 1.0), "GiB in use": ("used", GIB)})

    def utilization_frame(self) -> Any:
        """Utilisation per device (percent) where reported, against seconds before the last sample."""
        return self._frame({"utilisation %": ("utilization", 1.0)})


def tab() -> None:
    """Build the Devices tab inside the current ``gr.Blocks`` (a timer refreshes it every :data:`REFRESH_S`).

    Example:
        >>> with gr.Blocks() as app:
        ...     tab()
    """
    import gradio as gr

    first = device_rows()
    reporting = [row["device"] for row in first if row["utilization"] is not None]
    gr.Markdown(f"Memory in use on each device, refreshed every {REFRESH_S:g} s; the CPU's memory is the host's "
                "RAM. *Held by this process's tensors* is what the dashboard itself holds (verifications and "
                "benchmarks run in it).")
    table = gr.Dataframe(headers=TABLE_HEADERS, value=table_rows(first), interactive=False, wrap=True,
                         elem_id="devices-table", label="devices")
    with gr.Row():
        # no title and no fixed height: with both, gradio 6 cuts the legend off
        # percent of each device's total: an accelerator's line is not flattened by the host's far larger RAM
        memory_plot = gr.LinePlot(x="seconds", y="% in use", color="device", x_lim=[-HISTORY_S, 0], y_lim=[0, 100],
                                  x_title="seconds ago", y_title="% of the device's memory",
                                  tooltip=["device", "% in use", "GiB in use", "seconds"],
                                  label="memory in use", elem_id="devices-memory")
        util_plot = gr.LinePlot(x="seconds", y="utilisation %", color="device", x_lim=[-HISTORY_S, 0],
                                y_lim=[0, 100], x_title="seconds ago", label="utilisation",
                                visible=bool(reporting), elem_id="devices-utilisation")
    if not reporting:
        gr.Markdown("*Utilisation*: no device here reports it (torchport reads it where the device's software "
                    "does, e.g. NVML through pynvml for NVIDIA GPUs, torch_npu for Ascend NPUs).")
    host = gr.Markdown(host_summary(), elem_id="devices-host")
    with gr.Accordion("Everything torchport knows about this machine (torchport.info)", open=False):
        gr.JSON(value=machine, label="torchport.info(probe=False)")
    history = gr.State(MemoryHistory)

    def refresh(past: MemoryHistory) -> tuple[Any, ...]:
        snapshot = memory()
        rows = device_rows(snapshot)
        past.add(rows)
        return table_rows(rows), past.memory_frame(), past.utilization_frame(), host_summary(snapshot), past

    timer = gr.Timer(REFRESH_S)
    outputs = [table, memory_plot, util_plot, host, history]
    timer.tick(refresh, inputs=history, outputs=outputs, show_progress="hidden", concurrency_limit=None,
               queue=False)
