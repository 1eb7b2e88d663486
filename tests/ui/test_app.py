"""The dashboard app, built (not served): its tabs, and nothing that reaches outside this machine."""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("gradio", reason="the dashboard needs gradio: pip install 'torchport[ui]'")

from torchport.ui.app import CSS, TABS, build_app, theme  # noqa: E402


def test_the_app_has_one_tab_per_view_and_no_analytics(npu: torch.device) -> None:
    app = build_app()
    config = app.get_config_file()
    assert [c["props"]["label"] for c in config["components"] if c["type"] == "tabitem"] == list(TABS)
    assert config["analytics_enabled"] is False and config["enable_queue"] is True
    ids = {c["props"].get("elem_id") for c in config["components"]}
    assert {"devices-table", "doctor-run", "kernels-run", "verify-run", "migrate-upload", "migrate-diff"} <= ids
    assert "npu:0" in str(config["components"])  # the device choices and the header


def test_the_page_style_loads_no_remote_fonts_or_sheets() -> None:
    style = theme()
    assert style._stylesheets == []
    assert set(re.findall(r"https?://[^\s)\"']+", style._get_theme_css() + CSS)) <= {"http://www.w3.org/2000/svg"}
