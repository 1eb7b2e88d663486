"""The offload benchmark runs end to end on a tiny model (CPU), with bit-identical outputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # a benchmark run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_small_run_writes_json_with_identical_outputs(tmp_path) -> None:
    pytest.importorskip("transformers")
    out = tmp_path / "offload.json"
    env = {key: value for key, value in os.environ.items() if not key.startswith("TORCHPORT_")}
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "bench_offload.py"), "--small", "--device", "cpu",
         "--iterations", "1", "--decode", "2", "--stack-size", "2MiB", "--json", str(out),
         "--disk-dir", str(tmp_path / "tier")],
        capture_output=True, text=True, timeout=300, env={**env, "TORCHPORT_DEVICE": "cpu"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    summary = result["summary"]
    assert summary["torchport_identical"] is True
    methods = [row["method"] for row in result["rows"]]
    # the peer computes the same on the CPU; its row decodes fewer tokens, compared with the resident's first ones
    assert summary["accelerate_identical"] in ((None,) if "accelerate cpu_offload" not in methods else (True,))
    assert summary["all_identical"] is True
    disk = next(row for row in result["rows"] if "disk tier" in row["method"])
    assert disk["page_cache"]["method"] and isinstance(disk["page_cache"]["dropped_verified"], bool)
    if disk["page_cache"]["dropped_verified"] and result["stack"]["disk"]["page_cache_dropped"]:
        assert "disk_warning" not in summary or "faster than the measured disk" in summary["disk_warning"]
    else:
        assert "page cache not dropped: figure is an upper bound" in summary["disk_warning"]
    assert methods[0] == "resident" and any("disk tier" in m for m in methods)
    assert os.listdir(tmp_path / "tier") == []  # the benchmark removes its tier files
    assert "| method |" in done.stdout
