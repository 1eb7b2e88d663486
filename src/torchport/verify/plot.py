"""PNG plots of a verify report. matplotlib is imported here only, when a plot is asked for.

Figures are drawn with matplotlib's object API on the Agg canvas, without pyplot, so a plot neither changes the
caller's matplotlib backend nor opens a window.
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .report import LayerRow, Report

__all__ = ["new_figure", "plot_report", "require_matplotlib"]

# The x axis names the modules, rotated. At 7 points and 110 dpi a label is 11 pixels high: 60 of them fill the
# 10-inch axis with a label's height between neighbours; past that, every k-th row is named (and the first
# divergence always), and the other rows keep an unnamed tick. Names longer than 28 characters keep their end, which
# names the module (``…layers.11.mlp.down_proj``).
_MAX_LABELS = 60
_LABEL_CHARS = 28
_LABEL_POINTS = 7


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


def _short(name: str) -> str:
    """``name`` within ``_LABEL_CHARS`` characters: its end, from a dot where one is near, behind an ellipsis."""
    if len(name) <= _LABEL_CHARS:
        return name
    tail = name[-(_LABEL_CHARS - 1):]
    dot = tail.find(".")
    return "…" + (tail[dot + 1:] if 0 <= dot < len(tail) // 2 else tail)


def _named_rows(rows: list[LayerRow], first: LayerRow | None) -> list[LayerRow]:
    """The rows whose names label the x axis: all that fit, else every k-th, counted from the first divergence so
    that it is one of them and the labels stay evenly spaced."""
    if len(rows) <= _MAX_LABELS:
        return list(rows)
    step = math.ceil(len(rows) / _MAX_LABELS)
    start = 0 if first is None else rows.index(first) % step
    return rows[start::step]


def _label_axis(figure: Any, ax: Any, rows: list[LayerRow], first: LayerRow | None) -> None:
    named = _named_rows(rows, first)
    labels = [_short(row.name) for row in named]
    rotation = 45 if len(named) <= 16 else 90
    ax.set_xticks([row.index for row in named], labels, rotation=rotation, ha="right" if rotation == 45 else "center",
                  rotation_mode="anchor" if rotation == 45 else "default", fontsize=_LABEL_POINTS)
    if len(named) < len(rows):
        ax.set_xticks([row.index for row in rows], minor=True)
    for row, label in zip(named, ax.get_xticklabels()):
        if not row.ok:
            label.set_color("tab:red")
            label.set_fontweight("bold" if row is first else "normal")
    # The figure grows by the labels' height, so the plot keeps its size (a character is about 0.6 of the font size)
    longest = max((len(label) for label in labels), default=0)
    extra = longest * 0.6 * _LABEL_POINTS / 72 * math.sin(math.radians(rotation))
    figure.set_size_inches(figure.get_figwidth(), figure.get_figheight() + extra)


def plot_report(report: Report, path: str | os.PathLike[str]) -> str:
    """Relative error by row (execution order) on a log scale, the rtol line, failing rows in red, and the first
    divergence marked with its name. The x axis names each row's module (or parameter gradient), rotated; with many
    rows, every k-th one and the first divergence, long names shortened to their end. Returns the path written.

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
    _label_axis(figure, ax, rows, first)
    ax.set_xlabel("module call, in execution order (gradients after the forward)")
    ax.set_ylabel("relative error ‖out − ref‖ / ‖ref‖")
    ax.set_title(f"{report.device} ({report.dtype}) against {report.reference} ({report.reference_dtype})")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    path = os.fspath(path)
    figure.savefig(path, format="png", dpi=110)
    return path
