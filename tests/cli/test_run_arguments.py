"""`torchport run` passes the program's arguments as python does: everything after the script or `-m MODULE` is
the program's, options included, and one `--` separating torchport's options from the program's is dropped."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from torchport.cli import run
from torchport.cli.main import main

ARGV = "import json, sys\nprint(json.dumps(sys.argv[1:]))\n"
Runner = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def program(tmp_path: Path) -> Path:
    """A folder holding pkg/mod.py and script.py, both printing their sys.argv[1:] as JSON."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "mod.py").write_text(ARGV)
    (tmp_path / "script.py").write_text(ARGV)
    return tmp_path


def _argv(run_python: Runner, cwd: Path, *args: str) -> list[str]:
    result = run_python(*args, cwd=cwd)
    assert result.returncode == 0, f"$ python {' '.join(args)}\n{result.stdout}{result.stderr}"
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("words", [
    ["-m", "pkg.mod", "--flag", "value"],
    ["-m", "pkg.mod", "--", "--flag", "value"],
    ["--device", "cpu", "-m", "pkg.mod", "--flag", "value"],
    ["script.py", "--flag", "value"],
    ["script.py", "--", "--flag", "value"],
    ["--device", "cpu", "--", "script.py", "--flag", "value"],
], ids=["module", "module --", "options module", "script", "script --", "-- script"])
def test_the_program_gets_what_python_would_give_it(program: Path, run_python: Runner, words: list[str]) -> None:
    expected = _argv(run_python, program, "-m", "pkg.mod", "--flag", "value")
    assert expected == ["--flag", "value"]
    assert _argv(run_python, program, "-m", "torchport", "run", *words) == expected


def test_the_device_flag_is_the_device_torchport_gives_the_program(program: Path, run_python: Runner) -> None:
    """``--device`` is also what the program's own ``torchport.device()`` answers (which ``torchport.distributed.init``
    uses), not the device detected: here the simulated NPU, which the program would otherwise get."""
    (program / "where.py").write_text("import torchport\nprint(torchport.device())\n")
    simulated = {"TORCHPORT_SIMULATE": "npu"}
    detected = run_python("-m", "torchport", "run", "where.py", cwd=program, env=simulated)
    assert detected.returncode == 0 and detected.stdout.split()[-1] == "npu:0", detected.stdout + detected.stderr
    chosen = run_python("-m", "torchport", "run", "--device", "cpu", "where.py", cwd=program, env=simulated)
    assert chosen.returncode == 0 and chosen.stdout.split()[-1] == "cpu", chosen.stdout + chosen.stderr
    # an index in the flag is where the program starts; a rank that moves to its own device (as
    # torchport.distributed.init does from LOCAL_RANK) is then answered that device, not the flag's index
    (program / "rank.py").write_text("import torch, torchport\ntorch.npu.set_device(1)\nprint(torchport.device())\n")
    two = {**simulated, "TORCHPORT_SIMULATE_DEVICES": "2"}
    moved = run_python("-m", "torchport", "run", "--device", "npu:0", "rank.py", cwd=program, env=two)
    assert moved.returncode == 0 and moved.stdout.split()[-1] == "npu:1", moved.stdout + moved.stderr


def test_torchport_options_after_the_script_are_the_programs(program: Path, run_python: Runner) -> None:
    result = run_python("-m", "torchport", "run", "script.py", "--device", "nowhere", "--report", "-h", cwd=program)
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads(result.stdout) == ["--device", "nowhere", "--report", "-h"]
    assert result.stderr == ""  # neither torchport's --report nor its --help ran


@pytest.mark.parametrize(("words", "own", "arguments"), [
    (["-m", "pkg.mod", "--flag"], ["-m", "pkg.mod"], ["--flag"]),
    (["-mpkg.mod", "--", "--flag"], ["-m", "pkg.mod"], ["--flag"]),
    (["-m", "pkg.mod", "--", "--", "x"], ["-m", "pkg.mod"], ["--", "x"]),
    (["--device", "cpu", "script.py", "--device", "npu"], ["--device", "cpu"], ["script.py", "--device", "npu"]),
    (["--dev", "cpu", "--report", "script.py"], ["--dev", "cpu", "--report"], ["script.py"]),
    (["--device=cpu", "script.py", "-m", "x"], ["--device=cpu"], ["script.py", "-m", "x"]),
    (["--", "script.py", "--", "x"], [], ["script.py", "--", "x"]),
    (["script.py", "--", "--", "x"], [], ["script.py", "--", "x"]),
    (["--nproc-per-node", "2", "--master-port", "29500", "script.py"],
     ["--nproc-per-node", "2", "--master-port", "29500"], ["script.py"]),
    (["--device", "cpu"], ["--device", "cpu"], []),
])
def test_split_arguments(words: list[str], own: list[str], arguments: list[str]) -> None:
    assert run.split_arguments(words) == (own, arguments)


def test_every_option_of_run_is_known_to_the_split() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    run.add_arguments(parser)
    for action in parser._actions:
        for option in action.option_strings:
            if option == "-m":
                continue  # ends torchport's options, as python's -m does
            assert option in run._VALUED + run._SWITCHES, option
            assert (option in run._VALUED) == (action.nargs is None and action.const is None), option


def test_a_literal_double_dash_survives_the_torchrun_launch(program: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    launched: list[list[str]] = []

    class Process:
        def __init__(self, command: list[str]) -> None:
            launched.append(command)

        def wait(self) -> int:
            return 0

    monkeypatch.setattr(run.subprocess, "Popen", Process)
    monkeypatch.chdir(program)
    assert main(["run", "--nproc-per-node", "1", "--device", "cpu", "-m", "pkg.mod", "--", "--", "x"]) == 0
    command = launched[0]
    inner = command[command.index("run") + 1:]
    assert run.split_arguments(inner) == (["--device", "cpu", "-m", "pkg.mod"], ["--", "x"])


def test_options_still_need_their_value(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "-m"])
    assert exit_info.value.code == 2
    assert "-m: expected one argument" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["run", "--bogus", "script.py"])
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_help_text_says_where_the_programs_arguments_start(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "everything after the script or module belongs to the program" in help_text
