"""``--json`` prints JSON on stdout and nothing else, ``--json-out PATH`` writes it to a file, in every command;
the old ``--json OUT`` of bench, verify and export still writes the file, with a deprecation note."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from torchport.cli import main as cli
from torchport.cli.main import main

TARGET = '''
import torch
from torch import nn


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2)), (torch.randn(2, 8),)
'''

JSON_COMMANDS = ["doctor", "kernels", "stack", "coverage", "verify", "bench", "export"]


@pytest.fixture
def target(tmp_path: Path) -> str:
    path = tmp_path / "target.py"
    path.write_text(TARGET)
    return f"{path}:mlp"


def _options(command: str) -> dict[str, argparse.Action]:
    parser = cli.build_parser()
    sub = next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
    return {option: action for action in sub.choices[command]._actions for option in action.option_strings}


@pytest.mark.parametrize("command", JSON_COMMANDS)
def test_every_command_has_both_options_with_one_meaning(command: str) -> None:
    options = _options(command)
    assert "print" in options["--json"].help and "stdout" in options["--json"].help
    assert options["--json-out"].metavar == "PATH" and "file" in options["--json-out"].help


def test_json_prints_only_json_on_stdout(target: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["verify", target, "--device", "cpu", "--json"]) == 0
    out = capsys.readouterr().out
    assert json.loads(out)["ok"] is True
    assert main(["kernels", "--device", "cpu", "--json"]) == 0
    assert isinstance(json.loads(capsys.readouterr().out), list)


def test_json_out_writes_a_file_and_keeps_the_table(target: str, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "report.json"
    assert main(["verify", target, "--device", "cpu", "--json-out", str(out)]) == 0
    captured = capsys.readouterr()
    assert json.loads(out.read_text())["ok"] is True
    assert "torchport verify: cpu (float32) against cpu (float64)" in captured.out  # the table, as without JSON
    kernels = tmp_path / "kernels.json"
    assert main(["kernels", "--device", "cpu", "--json", "--json-out", str(kernels)]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(kernels.read_text())


def test_the_old_file_spelling_still_writes_and_says_what_to_write(target: str, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "old.json"
    assert main(["verify", target, "--device", "cpu", "--json", str(out)]) == 0
    captured = capsys.readouterr()
    assert json.loads(out.read_text())["ok"] is True
    assert f"--json {out} is deprecated" in captured.err and f"write --json-out {out}" in captured.err
    assert "torchport verify: cpu (float32)" in captured.out  # the table, not JSON, went to stdout


def test_two_files_or_a_folder_are_usage_errors(target: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert main(["verify", target, "--device", "cpu", "--json", str(a), "--json-out", str(b)]) == 2
    assert "both name a file" in capsys.readouterr().err
    assert main(["doctor", "--device", "cpu", "--json-out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("torchport doctor: error: --json-out") and "is a folder" in err
