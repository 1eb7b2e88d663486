"""Output of ``bench_kernels.py``: a table per op (rich when installed, else Markdown), a PNG chart, JSON without
NaN, and what the run was (commit, versions, device)."""

from __future__ import annotations

import contextlib
import math
import os
import platform
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
PEERS = ("eager", "compile", "liger", "cce")  # the contenders the targets compare torchport with


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table_rows(result: dict) -> list[list[str]]:
    out = []
    for r in result["rows"]:
        target = ""
        if "speedup" in r:
            target = f"≥{result['target_speedup']:.1f}×: {r['time_target']}"
            if "gpu_speedup" in r:
                target += f" (GPU time {r['gpu_speedup']:.2f}×)"
            if "memory_target" in r:
                target += f"; ≤{r['lowest_peer_mib']:.0f} MiB: {r['memory_target']}"
        out.append([r["label"], _fmt(r.get("median_ms"), ".3f"), _fmt(r.get("gpu_ms"), ".3f"), _fmt(r.get("gbps"), ".0f"),
                    _fmt(r.get("pct_ceiling"), ".1f"), _fmt(r.get("peak_mib"), ".1f"),
                    _fmt(r.get("beyond_grads_mib"), ".1f"), _fmt(r.get("rel_err"), ".1e"),
                    r["status"], _fmt(r.get("speedup"), ".2f"), target])
    return out


HEADERS = ["contender", "median ms", "GPU ms (graph)", "GB/s", "% ceiling", "peak MiB", "beyond grads MiB", "rel err",
           "status", "speedup", "target"]


def print_table(result: dict) -> None:
    title = (f"{result['title']} — fwd+bwd, {result['bytes_moved'] / 1e6:.1f} MB at the least, "
             f"{result['ideal_ms']:.4f} ms at the copy ceiling")
    errors = [f"  {r['label']}: {r['error']}" for r in result["rows"] if r["status"] == "error"]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(f"\n{title}\n| " + " | ".join(HEADERS) + " |\n|" + "---|" * len(HEADERS))
        for cells in table_rows(result):
            print("| " + " | ".join(cells) + " |")
        print("\n".join(errors))
        return
    table = Table(title=title, title_justify="left")
    for i, header in enumerate(HEADERS):
        table.add_column(header, justify="right" if 0 < i < 7 or i == 8 else "left")
    for row, cells in zip(result["rows"], table_rows(result)):
        table.add_row(*cells, style="bold" if row["contender"].startswith("torchport") else None)
    console = Console(width=160)
    console.print(table)
    if errors:
        console.print("\n".join(errors), highlight=False, markup=False)


def plot(results: list[dict], path: str, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no chart")
        return
    results = [r for r in results if any(row.get("median_ms") for row in r["rows"])]
    if not results:
        print("nothing timed: no chart")
        return
    fig, axes = plt.subplots(len(results), 1, figsize=(8, 1.0 + 1.6 * len(results)), squeeze=False)
    for ax, result in zip(axes[:, 0], results):
        rows = [r for r in result["rows"] if r.get("median_ms")]
        labels = [r["label"] + (" (FAIL)" if r["status"] == "FAIL" else "") for r in rows]
        values = [r["median_ms"] for r in rows]
        colors = ["tab:orange" if r["contender"].startswith("torchport") else "tab:gray" for r in rows]
        ax.barh(labels, values, color=colors)
        for y, v in enumerate(values):
            ax.text(v, y, f" {v:.3f}", va="center", fontsize=8)
        ax.axvline(result["ideal_ms"], color="tab:blue", linestyle="--", linewidth=1, label="copy ceiling")
        ax.invert_yaxis()
        ax.set_title(result["title"], fontsize=9, loc="left")
        ax.set_xlabel("median ms, forward + backward", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.set_xlim(0, max(values + [result["ideal_ms"]]) * 1.2)
    axes[0, 0].legend(fontsize=8, loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def _finite(value: Any) -> Any:
    """JSON without NaN/Infinity: non-finite floats become strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def git_commit() -> str | None:
    import subprocess

    try:
        def run(*cmd: str) -> str:
            return subprocess.run(cmd, cwd=HERE, capture_output=True, text=True, check=True).stdout.strip()

        return run("git", "rev-parse", "--short", "HEAD") + (" (modified)" if run("git", "status", "--porcelain") else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def versions() -> dict[str, str | None]:
    from importlib import metadata

    found: dict[str, str | None] = {"python": platform.python_version(), "torch": torch.__version__}
    for dist in ("triton", "liger-kernel", "torchport"):
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            found[dist] = None
    if found["torchport"] is None:
        with contextlib.suppress(ImportError):
            import torchport

            found["torchport"] = torchport.__version__
    return found


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type} ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def judge(op: Any, rows: list[dict]) -> None:
    """Speedup of each torchport row over the fastest passing peer, and the time and memory targets."""
    peers = [r for r in rows if r["contender"] in PEERS and r["status"] == "ok" and r.get("median_ms")]
    fastest = min(peers, key=lambda r: r["median_ms"], default=None)
    peaks = [r["peak_mib"] for r in peers if r.get("peak_mib") is not None]
    lowest = min(peaks, default=None)
    for row in rows:
        if not row["contender"].startswith("torchport") or not row.get("median_ms") or fastest is None:
            continue
        row["fastest_peer"] = fastest["label"]
        row["speedup"] = fastest["median_ms"] / row["median_ms"]
        graphed = [r for r in peers if r.get("gpu_ms")]
        if graphed and row.get("gpu_ms"):
            gpu_fastest = min(graphed, key=lambda r: r["gpu_ms"])
            row["gpu_fastest_peer"] = gpu_fastest["label"]
            row["gpu_speedup"] = gpu_fastest["gpu_ms"] / row["gpu_ms"]
        if row["status"] != "ok":
            row["time_target"] = "missed (FAIL)"
        elif row["speedup"] >= op.target:
            row["time_target"] = "met"
        else:
            row["time_target"] = f"missed, {row['speedup']:.2f}× < {op.target}×"
        if lowest is not None and row.get("peak_mib") is not None:
            row["lowest_peer_mib"] = lowest
            over = row["peak_mib"] - lowest
            row["memory_target"] = "met" if over <= 0 else f"missed by {over:.1f} MiB"
