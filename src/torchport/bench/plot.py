"""PNG plot of a batch-size sweep: throughput and peak memory against batch size. matplotlib is imported here only."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ..verify.plot import new_figure

if TYPE_CHECKING:
    from .sweep import Sweep

__all__ = ["plot_sweep"]


def plot_sweep(sweep: Sweep, path: str | os.PathLike[str], compare: Sweep | None = None) -> str:
    """Two panels side by side: items/s and peak device memory (MiB) against batch size; failed batch sizes are
    marked with their error. Returns the path written.

    Example:
        >>> plot_sweep(torchport.bench.sweep(factory, [1, 4, 16]), "bench.png")
    """
    figure = new_figure(11, 4.2)
    speed, memory = figure.subplots(1, 2)
    done = [p for p in sweep.points if p.result is not None]
    sizes = [p.batch_size for p in done]
    speed.plot(sizes, [p.result.throughput for p in done], marker="o", color="tab:blue", label=sweep.label)
    if compare is not None:
        other = [p for p in compare.points if p.result is not None]
        speed.plot([p.batch_size for p in other], [p.result.throughput for p in other], marker="^",
                   color="tab:green", label=compare.label)
        speed.legend(fontsize=8)
    speed.set_ylabel("throughput (items/s, median)")
    measured = [p for p in done if p.result.peak_memory is not None]
    if measured:
        memory.plot([p.batch_size for p in measured], [p.result.peak_memory / 2**20 for p in measured],
                    marker="s", color="tab:orange")
    else:
        memory.text(0.5, 0.5, "this device keeps no count\nof tensor memory", ha="center", va="center",
                    transform=memory.transAxes, color="0.4")
    memory.set_ylabel("peak device memory (MiB)")
    all_sizes = [p.batch_size for p in sweep.points]
    for ax in (speed, memory):
        if len(set(all_sizes)) > 1 and max(all_sizes) / min(all_sizes) >= 8:
            ax.set_xscale("log", base=2)
        ticks = sorted(set(all_sizes))
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("batch size")
        ax.grid(True, alpha=0.3)
        for point in sweep.points:
            if point.error is not None:
                ax.axvline(point.batch_size, color="tab:red", alpha=0.4, linestyle=":")
                ax.annotate(point.error.split(":")[0], xy=(point.batch_size, 0.02), xycoords=("data", "axes fraction"),
                            rotation=90, color="tab:red", fontsize=8, va="bottom")
    title = f"torchport bench: {sweep.label}" + (f" ({sweep.dtype})" if sweep.dtype else "")
    figure.suptitle(title)
    path = os.fspath(path)
    figure.savefig(path, format="png", dpi=110)
    return path
