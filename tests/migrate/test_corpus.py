"""The corpus: CUDA-written scripts, migrated with --write, run on the CPU with plain python like hand-ported ones.

Each tests/migrate/corpus/NAME.py was written for CUDA; tests/migrate/ported/NAME.py is the same program ported by
hand to the CPU. After `torchport migrate --write`, each migrated script must run in a fresh interpreter without
importing torchport and print exactly what its hand-ported version prints. The scripts of tests/compat/corpus named
in SHARED run here too (against their ports in tests/compat/corpus_cpu), so those idioms are checked both ways:
`torchport run` unchanged, and migrated then run with plain python.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from torchport.cli.main import main
from torchport.migrate import migrate_paths

pytestmark = pytest.mark.slow  # migrated scripts run in fresh processes

HERE = Path(__file__).parent
COMPAT = HERE.parent / "compat"
# idioms the shim and the codemod both handle: TorchScript, the torchrun DDP tutorial, timed events, integer devices
SHARED = ("cuda_events.py", "ddp_torchrun.py", "device_map.py", "integer_devices.py", "jit_library.py")
CORPUS = sorted((HERE / "corpus").glob("*.py")) + [COMPAT / "corpus" / name for name in SHARED]


def _port(script: Path) -> Path:
    """The hand-ported CPU version of a corpus script."""
    return (HERE / "ported" if script.parent == HERE / "corpus" else COMPAT / "corpus_cpu") / script.name
# runs a script as __main__ with the arguments after it (as `python script.py ARGS` would), then fails if torchport
# was imported along the way
RUNNER = ("import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__'); "
          "assert not [m for m in sys.modules if m.startswith('torchport')], 'torchport was imported'")


@pytest.fixture(scope="module")
def migrated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("corpus")
    for script in CORPUS:
        shutil.copy(script, target / script.name)
    assert main(["migrate", "--write", str(target)]) == 0
    return target


def _run_all(paths: list[Path], *args: str) -> list[subprocess.CompletedProcess[str]]:
    env = {"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": "", "PYTHONHASHSEED": "0"}
    procs = [subprocess.Popen([sys.executable, "-c", RUNNER, str(p), *args], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env, cwd=p.parent) for p in paths]
    results = []
    for path, proc in zip(paths, procs):
        out, err = proc.communicate(timeout=120)
        results.append(subprocess.CompletedProcess(path, proc.returncode, out, err))
    return results


def test_corpus_is_not_empty_and_every_script_has_a_port() -> None:
    assert len(CORPUS) >= 5 and len({script.name for script in CORPUS}) == len(CORPUS)
    for script in CORPUS:
        assert _port(script).exists(), script.name


def test_migrated_scripts_run_on_cpu_like_the_hand_ported_ones(migrated: Path) -> None:
    names = [script.name for script in CORPUS]
    runs = _run_all([migrated / n for n in names] + [_port(script) for script in CORPUS])
    for name, mine, theirs in zip(names, runs[: len(names)], runs[len(names):]):
        assert theirs.returncode == 0, f"the port of {name} failed:\n{theirs.stderr}"
        assert mine.returncode == 0, f"migrated {name} failed:\n{mine.stderr}"
        assert mine.stdout == theirs.stdout, f"{name}: migrated printed\n{mine.stdout}\nported printed\n{theirs.stdout}"
        assert mine.stdout.strip()


def test_migrated_corpus_is_plain_pytorch(migrated: Path) -> None:
    for script in CORPUS:
        code = (migrated / script.name).read_text()
        assert "torchport" not in code
        assert "torch.cuda" not in code and ".cuda(" not in code, script.name
        compile(code, script.name, "exec")


def test_the_migrated_ddp_tutorial_runs_under_torchrun_like_its_port(migrated: Path, launch_ranks) -> None:
    # two ranks on one CPU: gloo, every device id on the host, the checkpoint reloaded onto it
    env = {"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": "", "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    mine, theirs = (launch_ranks(lambda path=path: subprocess.run([*command, str(path)], capture_output=True,
                                                                  text=True, env=env, cwd=path.parent, timeout=180))
                    for path in (migrated / "ddp_torchrun.py", COMPAT / "corpus_cpu" / "ddp_torchrun.py"))
    assert theirs.returncode == 0, theirs.stderr
    assert mine.returncode == 0, mine.stderr
    assert mine.stdout == theirs.stdout and mine.stdout.startswith("mean loss ")


def test_second_run_changes_nothing(migrated: Path) -> None:
    results = migrate_paths([migrated])
    assert [r.path for r in results if r.changed] == []
    assert main(["migrate", "--check", str(migrated)]) == 0


def test_a_guard_that_stops_without_a_gpu_is_reported_with_how_to_run_on_a_cpu(migrated: Path) -> None:
    script = HERE / "corpus" / "cuda_flag.py"
    source = script.read_text()
    [site] = migrate_paths([script])[0].review
    guard = source.splitlines().index("if opt.cuda and not torch.cuda.is_available():") + 1
    assert (site.line, site.what) == (guard, "raises when no GPU is found")
    assert site.hint.endswith("run the script there without --cuda")
    # called as the report says, the migrated script runs (test above); asked for the GPU, it stops as it did
    [stopped] = _run_all([migrated / "cuda_flag.py"], "--cuda")
    assert stopped.returncode == 1 and "No GPU found, please run without --cuda" in stopped.stderr


def test_directory_run_skips_a_syntax_error_and_a_non_utf8_file(tmp_path: Path) -> None:
    shutil.copy(CORPUS[0], tmp_path / CORPUS[0].name)
    (tmp_path / "broken.py").write_text("x = torch.ones(1).cuda(\n")
    (tmp_path / "cp1252.py").write_bytes(b"import torch\nname = '\x93quoted\x94'\nx = torch.ones(1).cuda()\n")
    results = {Path(r.path).name: r for r in migrate_paths([tmp_path], write=True)}
    assert "syntax error" in results["broken.py"].skipped
    assert "not UTF-8" in results["cp1252.py"].skipped
    assert results[CORPUS[0].name].written
    assert (tmp_path / "broken.py").read_text() == "x = torch.ones(1).cuda(\n"
