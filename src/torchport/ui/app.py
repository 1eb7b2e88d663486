"""The dashboard: one gradio app with a tab per view. gradio is imported here, only when an app is built."""

from __future__ import annotations

import tempfile
from typing import Any

import torch

from .. import __version__
from ..device import devices
from . import devices as devices_tab
from . import doctor, kernels, migrate, verify

__all__ = ["CSS", "TABS", "build_app", "theme"]

TABS = ("Devices", "Doctor", "Kernels", "Verify", "Migrate")

CSS = """
.tp-diff { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; font-size: 13px;
           line-height: 1.45; padding: 10px 12px; border: 1px solid var(--border-color-primary);
           border-radius: 6px; overflow-x: auto; white-space: pre; margin: 0; }
.tp-diff .tp-add { background: #dcfce7; color: #14532d; display: inline-block; min-width: 100%; }
.tp-diff .tp-del { background: #fee2e2; color: #7f1d1d; display: inline-block; min-width: 100%; }
.tp-diff .tp-hunk { color: #1d4ed8; }
.tp-diff .tp-file { color: #6b7280; font-weight: 600; }
.tp-diff.tp-empty { color: #6b7280; }
.dark .tp-diff .tp-add { background: #14532d; color: #dcfce7; }
.dark .tp-diff .tp-del { background: #7f1d1d; color: #fee2e2; }
#tp-header h1 { margin-bottom: 0; }
.tp-error { border: 1px solid #fca5a5; background: #fef2f2; color: #991b1b; padding: 8px 12px; border-radius: 6px; }
.dark .tp-error { border-color: #7f1d1d; background: #450a0a; color: #fecaca; }
"""


def theme() -> Any:
    """gradio's default theme with system fonts: the page loads nothing from outside this machine.

    Example:
        >>> build_app().launch(theme=theme(), css=CSS)
    """
    import gradio as gr

    return gr.themes.Default(
        primary_hue="orange",
        font=["ui-sans-serif", "system-ui", "-apple-system", "Segoe UI", "Helvetica", "Arial", "sans-serif"],
        font_mono=["ui-monospace", "SFMono-Regular", "Menlo", "Consolas", "monospace"],
    )


def build_app() -> Any:
    """The dashboard as a ``gr.Blocks`` with its queue set up (not launched): Devices, Doctor, Kernels, Verify and
    Migrate tabs. Launch it with :func:`torchport.ui.serve` (or ``app.launch(css=CSS, theme=theme())``).

    Example:
        >>> app = build_app()
        >>> app.launch(server_name="127.0.0.1", server_port=7860, css=CSS, theme=theme())
    """
    import gradio as gr

    # plots and downloads; removed when the process exits
    folder = tempfile.TemporaryDirectory(prefix="torchport-ui-")
    present = ", ".join(str(d) for d in devices())
    with gr.Blocks(title="torchport", analytics_enabled=False) as app:
        gr.Markdown(f"# torchport\ntorchport {__version__} · torch {torch.__version__} · devices: {present}",
                    elem_id="tp-header")
        with gr.Tabs():
            with gr.Tab("Devices", id="devices"):
                devices_tab.tab()
            with gr.Tab("Doctor", id="doctor"):
                doctor.tab()
            with gr.Tab("Kernels", id="kernels"):
                kernels.tab()
            with gr.Tab("Verify", id="verify"):
                verify.tab(folder.name)
            with gr.Tab("Migrate", id="migrate"):
                migrate.tab(folder.name)
    app.torchport_folder = folder  # lives as long as the app
    # One run at a time per action (two benchmarks at once would time each other); the device refresh has no limit.
    app.queue(default_concurrency_limit=1)
    return app
