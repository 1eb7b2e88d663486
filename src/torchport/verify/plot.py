"""PNG plots of a verify report. matplotlib is imported here only, when a plot is asked for.

Figures are drawn with matplotlib's object API on the Agg canvas, without pyplot, so a plot neither changes the
caller's matplotlib backend nor opens a window.
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .report import Report

__all__ = ["new_figure", "plot_report", "require_matplotlib"]


def require_matplotlib() -> None:
    """Raise ImportError with the install command when matplotlib is missing.

    Example:
        >>> require_matplotlib()   # before a long run that ends with a plot
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise ImportError("plots need matplotlib, which is not installed: pip install matplotlib") from exc


def new_figure(width: float, height: float) -> Any:
    """A matplotlib Figure on an Agg canvas (no pyplot, no window).

    Example:
        >>> fig = new_figure(8, 4); fig.add_subplot().plot([1, 2]); fig.savefig("a.png")
    """
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def plot_report(report: Report, path: str | os.PathLike[str]) -> str:
    """Relative error by row (execution order) on a log scale, the rtol line, failing rows in red, and the first
    divergence marked with its name. Returns the path written.

    Example:
        >>> plot_report(torchport.verify.compare(model, x), "verify.png")
    """
    figure = new_figure(10, 4.5)
    ax = figure.add_subplot()
    rows = report.layers
    finite = [row.rel_error for row in rows if math.isfinite(row.rel_error) and row.rel_error > 0]
    # zero errors sit on a floor below everything else, infinite ones on a ceiling above: a log axis has neither
    floor = min(finite + [report.rtol]) / 10
    ceiling = max(finite + [report.rtol]) * 10
    for kind, marker, label in (("output", "o", "module output"), ("grad", "s", "parameter gradient")):
        picked = [row for row in rows if row.kind == kind]
        if not picked:
            continue
        x = [row.index for row in picked]
        y = [min(max(row.rel_error, floor), ceiling) if not math.isnan(row.rel_error) else ceiling for row in picked]
        colors = ["tab:blue" if row.ok else "tab:red" for row in picked]
        ax.plot(x, y, color="0.75", linewidth=0.8, zorder=1)
        ax.scatter(x, y, c=colors, marker=marker, s=18, zorder=2, label=label)
    ax.axhline(report.rtol, color="0.3", linestyle="--", linewidth=1, label=f"tolerance (rtol {report.rtol:g})")
    first = report.first_failing()
    if first is not None:
        ax.axvline(first.index, color="tab:red", linewidth=1, alpha=0.6)
        ax.annotate(f"first divergence: {first.name}", xy=(first.index, ceiling), xytext=(4, -12),
                    textcoords="offset points", color="tab:red", fontsize=9, va="top")
    ax.set_yscale("log")
    ax.set_ylim(floor / 2, ceiling * 2)
    ax.set_xlabel("module call, in execution order (gradients after the forward)")
    ax.set_ylabel("relative error ‖out − ref‖ / ‖ref‖")
    ax.set_title(f"{report.device} ({report.dtype}) against {report.reference} ({report.reference_dtype})")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    path = os.fspath(path)
    figure.savefig(path, format="png", dpi=110)
    return path
