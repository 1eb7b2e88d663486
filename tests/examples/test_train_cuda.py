"""The demo, ``torchport run --report examples/train_cuda.py`` (what ``scripts/demo.sh`` runs), trains on the CPU and
on the simulated NPU, saves its weights where ``--save-dir`` says (a new temporary directory by default), and
prints where."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # the demo trains in a fresh process per device

ROOT = Path(__file__).resolve().parents[2]
DEMO = "examples/train_cuda.py"
TARGETS = {
    "cpu": (["--device", "cpu"], {}),  # explicit, so that it is also the CPU on a GPU machine
    "npu": (["--device", "npu"], {"TORCHPORT_SIMULATE": "npu"}),
}
SHORT = ["--steps", "2", "--batch", "4"]  # the contract, not the convergence: ~5 s a run on 2 cores
SAVED = re.compile(r"^saved the weights to (?P<path>.+)$", re.MULTILINE)


def describe(result) -> str:
    return (f"\n$ {' '.join(map(str, result.args))}\nexit {result.returncode}\n"
            f"--- stdout ---\n{result.stdout}--- stderr ---\n{result.stderr}")


def run_demo(run_python, target: str, *args: str, env: dict[str, str] | None = None):
    options, target_env = TARGETS[target]
    return run_python("-m", "torchport", "run", *options, "--report", DEMO, *SHORT, *args, cwd=ROOT,
                      env={**target_env, **(env or {})}, timeout=300)


def saved_path(result) -> Path:
    found = SAVED.findall(result.stdout)
    assert len(found) == 1, describe(result)
    return Path(found[0])


@pytest.mark.parametrize("target", list(TARGETS))
def test_demo_saves_where_asked_and_says_so(run_python, tmp_path: Path, target: str,
                                           request: pytest.FixtureRequest) -> None:
    if target == "npu":
        # the simulated NPU's tensors load back (torch.load, weights_only) where the simulation runs: its pass
        request.getfixturevalue("npu")
    save_dir = tmp_path / "runs" / "tiny"  # not there yet: the script makes it
    result = run_demo(run_python, target, "--save-dir", str(save_dir))
    assert result.returncode == 0, describe(result)
    path = saved_path(result)
    assert path == save_dir / "tiny_transformer.pt"
    state = torch.load(path, map_location="cpu", weights_only=True)
    assert {"embed.weight", "pos", "head.weight", "mask"} <= set(state)
    assert state["embed.weight"].shape == (256, 64)
    assert "CUDA calls redirected to" in result.stderr and "torch.cuda.amp.GradScaler" in result.stderr  # --report
    assert "/tmp/tiny_transformer.pt" not in result.stdout + result.stderr


def test_demo_saves_into_a_new_temporary_directory_by_default(run_python, tmp_path: Path) -> None:
    result = run_demo(run_python, "cpu", env={"TMPDIR": str(tmp_path)})
    assert result.returncode == 0, describe(result)
    path = saved_path(result)
    assert path.parent.parent == tmp_path and path.parent.name.startswith("tiny_transformer-")
    assert path.name == "tiny_transformer.pt" and path.is_file()
    again = saved_path(run_demo(run_python, "cpu", env={"TMPDIR": str(tmp_path)}))
    assert again.parent != path.parent and path.is_file()  # a second run does not overwrite the first
