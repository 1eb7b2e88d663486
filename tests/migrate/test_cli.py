"""`torchport migrate` on the command line: modes, exit codes, the JSON report, excludes, the walk."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from torchport.cli.main import main

CUDA_SCRIPT = "import torch\nx = torch.ones(2).cuda()\n"


@pytest.fixture()
def project(tmp_path: Path) -> Path:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "train.py").write_text(CUDA_SCRIPT)
    (tmp_path / "pkg" / "clean.py").write_text("import torch\nx = torch.ones(2)\n")
    (tmp_path / "pkg" / "broken.py").write_text("import torch\ndef f(:\n    pass\n")
    (tmp_path / "pkg" / "latin1.py").write_bytes(b"# caf\xe9\nx = 1\n")
    (tmp_path / "pkg" / "notes.txt").write_text(CUDA_SCRIPT)
    for hidden in (".git", "venv", "__pycache__"):
        (tmp_path / hidden).mkdir()
        (tmp_path / hidden / "x.py").write_text(CUDA_SCRIPT)
    (tmp_path / "venv" / "pyvenv.cfg").write_text("home = /usr\n")
    return tmp_path


def test_default_prints_a_diff_writes_nothing_and_reports_skipped_files(project: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(project)
    assert main(["migrate", "."]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("--- a/pkg/train.py\n+++ b/pkg/train.py\n")
    assert "+x = torch.ones(2).to(DEVICE)" in out and out.count("--- a/") == 1
    assert "skipped pkg/broken.py: syntax error" in " ".join(err.split())
    assert "skipped pkg/latin1.py: not UTF-8" in " ".join(err.split())
    assert (project / "pkg" / "train.py").read_text() == CUDA_SCRIPT
    assert (project / ".git" / "x.py").read_text() == CUDA_SCRIPT


def test_write_rewrites_only_changed_files_and_check_then_passes(project: Path, capsys) -> None:
    clean = project / "pkg" / "clean.py"
    before = clean.stat().st_mtime_ns
    assert main(["migrate", "--write", str(project / "pkg"), "--exclude", "broken.py", "--exclude", "latin1.py"]) == 0
    assert capsys.readouterr().out == ""  # no diff with --write
    assert "torch.ones(2).to(DEVICE)" in (project / "pkg" / "train.py").read_text()
    assert clean.stat().st_mtime_ns == before
    assert (project / "venv" / "x.py").read_text() == CUDA_SCRIPT
    assert main(["migrate", "--check", str(project / "pkg"), "--exclude", "broken.py", "--exclude", "latin1.py"]) == 0


def test_check_exits_1_when_a_file_would_change_or_is_skipped(project: Path) -> None:
    assert main(["migrate", "--check", str(project / "pkg" / "train.py")]) == 1
    assert main(["migrate", "--check", str(project / "pkg" / "broken.py")]) == 1
    assert main(["migrate", "--check", str(project / "pkg" / "clean.py")]) == 0
    assert (project / "pkg" / "train.py").read_text() == CUDA_SCRIPT


def test_report_json(project: Path) -> None:
    report = project / "report.json"
    assert main(["migrate", str(project / "pkg"), "--report", str(report)]) == 0
    data = json.loads(report.read_text())
    assert data["files"] == 4  # train, clean, broken, latin1: .txt files are not walked
    assert data["changed"] == [str((project / "pkg" / "train.py").as_posix())]
    change = data["changes"][0]
    assert (change["line"], change["col"], change["rule"]) == (2, 5, "tensor-cuda")
    assert change["before"] == "torch.ones(2).cuda()" and change["after"] == "torch.ones(2).to(DEVICE)"
    assert data["counts"]["rules"] == {"tensor-cuda": 1}
    assert {s["path"].rsplit("/", 1)[1] for s in data["skipped"]} == {"broken.py", "latin1.py"}


def test_guards_that_stop_without_a_gpu_are_in_the_table_and_the_json(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "250")  # one table row a line
    script = tmp_path / "sr.py"
    script.write_text("import argparse\nimport torch\np = argparse.ArgumentParser()\n"
                      "p.add_argument('--cuda', action='store_true')\nopt = p.parse_args()\n"
                      "if opt.cuda and not torch.cuda.is_available():\n    raise Exception('No GPU found')\n")
    report = tmp_path / "report.json"
    assert main(["migrate", str(script), "--report", str(report)]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert "to review" in err and "run the script there without --cuda" in err and "1 to review" in err
    data = json.loads(report.read_text())
    [site] = data["review"]
    assert (site["line"], site["col"], site["what"]) == (6, 1, "raises when no GPU is found")
    assert data["counts"]["files"][script.as_posix()]["review"] == 1


def test_exclude_glob_on_relative_paths(project: Path, capsys) -> None:
    assert main(["migrate", str(project), "--exclude", "pkg/*"]) == 0
    assert capsys.readouterr().out == ""


def test_symlinks_out_of_the_tree_are_not_followed(tmp_path: Path, capsys) -> None:
    outside, tree = tmp_path / "outside", tmp_path / "tree"
    outside.mkdir()
    tree.mkdir()
    (outside / "secret.py").write_text(CUDA_SCRIPT)
    os.symlink(outside, tree / "linked_dir")
    os.symlink(outside / "secret.py", tree / "linked.py")
    assert main(["migrate", "--write", str(tree)]) == 0
    assert (outside / "secret.py").read_text() == CUDA_SCRIPT


def test_missing_path_and_conflicting_modes_exit_2(tmp_path: Path, capsys) -> None:
    assert main(["migrate", str(tmp_path / "nope.py")]) == 2
    assert f"no such file or directory: {tmp_path / 'nope.py'}" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["migrate", "--write", "--check", str(tmp_path)])
    assert exc.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err
    assert main(["migrate", str(tmp_path), "--report", str(tmp_path / "no" / "r.json")]) == 2


def test_import_torchport_does_not_import_libcst() -> None:
    import subprocess
    import sys

    code = "import sys, torchport, torchport.cli.main; print('libcst' in sys.modules, 'torchport.migrate' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.split() == ["False", "False"]
