"""`torchport bench`: the table, JSON and plot per batch size, how batch sizes are applied, exit codes."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from torchport.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = f"{ROOT / 'examples' / 'verify_target.py'}:factory"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

TARGETS = textwrap.dedent('''
    import time

    import torch
    from torch import nn

    SEEN = []


    class Recording(nn.Module):
        def __init__(self, limit=1 << 30):
            super().__init__()
            self.linear = nn.Linear(4, 2)
            self.limit = limit

        def forward(self, x):
            if x.shape[0] > self.limit:
                raise torch.OutOfMemoryError("simulated: too many rows")
            SEEN.append(tuple(x.shape))
            return self.linear(x)


    def tiled():
        return Recording(), torch.randn(2, 4)


    def small_device():
        return Recording(limit=2), torch.randn(2, 4)


    def no_batch():
        return Recording(), {"scale": 2.0}


    def wrong():
        return (Recording(),)


    class Uneven(nn.Linear):
        """Calls of alternating length above one row (a noisy machine, made on purpose); 20 ms each with one row
        (sub-millisecond calls can be noisy on a busy machine: the test wants one row flagged, not two)."""

        calls = 0

        def forward(self, x):
            Uneven.calls += 1
            time.sleep(0.02 if x.shape[0] == 1 else 0.03 if Uneven.calls % 2 else 0.001)
            return super().forward(x)


    def uneven():
        return Uneven(4, 2), torch.randn(1, 4)
''')


@pytest.fixture
def targets(tmp_path: Path) -> Path:
    path = tmp_path / "bench_targets.py"
    path.write_text(TARGETS)
    return path


def test_example_over_batch_sizes(device: torch.device, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    code = main(["bench", EXAMPLE, "--device", str(device), "--batch-sizes", "1,4,8", "--warmup", "1", "--iters", "3",
                 "--json-out", str(out_json), "--plot", str(out_png)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "median ms" in out and "factory(batch_size=b)" in out
    data = json.loads(out_json.read_text())
    assert data["ok"] and data["device"] == str(device)
    assert [p["batch_size"] for p in data["points"]] == [1, 4, 8]
    assert all(p["iters"] == 3 and p["median_ms"] > 0 and p["throughput"] > 0 for p in data["points"])
    assert out_png.read_bytes()[:8] == PNG_MAGIC


def test_inputs_are_tiled_without_a_batch_size_keyword(targets: Path, tmp_path: Path) -> None:
    out_json = tmp_path / "bench.json"
    assert main(["bench", f"{targets}:tiled", "--device", "cpu", "--batch-sizes", "3,5", "--warmup", "0",
                 "--iters", "1", "--json-out", str(out_json)]) == 0
    data = json.loads(out_json.read_text())
    assert data["batching"] == "the factory's inputs tiled along dim 0"
    seen = sys.modules["_torchport_target_bench_targets"].SEEN
    assert seen == [(3, 4), (5, 4)]


def test_a_failing_batch_size_exits_1_after_the_table(targets: Path, capsys: pytest.CaptureFixture) -> None:
    code = main(["bench", f"{targets}:small_device", "--device", "cpu", "--batch-sizes", "1,2,4", "--warmup", "0",
                 "--iters", "1"])
    out = capsys.readouterr().out
    assert code == 1
    assert "out of memory" in out and out.count("\n") > 5


@pytest.mark.parametrize("args, message", [
    (["{targets}:tiled", "--batch-sizes", "1,x"], "--batch-sizes '1,x' is not a list of batch sizes"),
    (["{targets}:tiled", "--batch-sizes", "0"], "positive integers"),
    (["{targets}:tiled", "--iters", "0"], "--iters 0 is not allowed"),
    (["{targets}:wrong", "--batch-sizes", "2"], "must return (model, inputs)"),
    (["{targets}:no_batch", "--batch-sizes", "2"], "no tensor with a batch dimension"),
    (["{targets}:tiled", "--device", "npu:4"], "npu:4"),
    (["{targets}:nothing"], "'nothing' does not exist"),
    (["{targets}:tiled", "--json-out", "/no/such/folder/b.json"], "does not exist"),
])
def test_usage_errors_exit_2_with_one_line(targets: Path, npu: torch.device, capsys: pytest.CaptureFixture,
                                           args: list[str], message: str) -> None:
    args = [arg.format(targets=targets) for arg in args]
    assert main(["bench", *args, "--iters", "1"] if "--iters" not in args else ["bench", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("torchport bench: error: ") and message in captured.err
    assert len(captured.err.strip().splitlines()) == 1


def test_in_a_fresh_process_on_the_simulated_npu() -> None:
    clean = {key: value for key, value in os.environ.items() if not key.startswith("TORCHPORT_")}
    result = subprocess.run(
        [sys.executable, "-m", "torchport", "bench", EXAMPLE, "--device", "npu", "--batch-sizes", "2,4",
         "--iters", "2"],
        env={**clean, "COLUMNS": "200", "TORCHPORT_SIMULATE": "npu"}, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "torchport bench: npu:0 (simulated), device events" in result.stdout and "MiB" in result.stdout
    assert "the device is simulated" in " ".join(result.stdout.split())
    assert "Traceback" not in result.stderr


def test_npu_absent_names_the_simulated_npu(targets: Path) -> None:
    if importlib.util.find_spec("torch_npu") is not None:
        pytest.skip("torch_npu is installed: the NPU is not missing")
    clean = {key: value for key, value in os.environ.items() if not key.startswith("TORCHPORT_")}
    result = subprocess.run([sys.executable, "-m", "torchport", "bench", f"{targets}:tiled", "--device", "npu"],
                            env={**clean, "COLUMNS": "200"}, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith("torchport bench: error: --device='npu' asked for npu")
    assert "torch_npu is not installed" in result.stderr and "set TORCHPORT_SIMULATE=npu" in result.stderr


def test_a_wide_spread_is_named_under_the_table(targets: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out_json = tmp_path / "bench.json"
    assert main(["bench", f"{targets}:uneven", "--device", "cpu", "--batch-sizes", "1,2", "--warmup", "0",
                 "--iters", "10", "--json-out", str(out_json)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "p80/p20" in out and "warning: p80/p20 above 1.5 at batch size 2:" in out
    data = json.loads(out_json.read_text())
    assert data["wide_spread"] == [2] and [p["wide_spread"] for p in data["points"]] == [False, True]
