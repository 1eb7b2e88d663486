"""`torchrun --nproc-per-node 2 --no-python torchport run ...`: two ranks of a script that asks for "nccl" run on the
CPU (gloo), all_reduce across both, and train as one process would; two ranks of a tensor-parallel script that
checks for a GPU per rank and builds a device mesh on "cuda" train as the unsharded model does in one process."""

from __future__ import annotations

import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # torchrun starts two processes

HERE = Path(__file__).parent


def _torchport_executable() -> str | None:
    beside = Path(sys.executable).with_name("torchport")  # the console script of this interpreter's environment
    return str(beside) if beside.exists() else shutil.which("torchport")


def test_two_ranks_asking_for_nccl_run_on_the_cpu(tmp_path: Path, run_python, launch_ranks) -> None:
    executable = _torchport_executable()
    if executable is None:
        pytest.skip("no `torchport` console script beside sys.executable nor on PATH (pip install -e .)")
    single = run_python(str(HERE / "corpus_cpu" / "ddp_nccl.py"), cwd=tmp_path)
    assert single.returncode == 0, single.stderr
    # same model and data on both ranks: the averaged step equals the one-process step
    fields = single.stdout.split()  # rank 0 world 1 loss L weight W allreduce 3.000000
    loss, weight = fields[fields.index("loss") + 1], fields[fields.index("weight") + 1]

    result = launch_ranks(lambda: run_python(
        "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--no-python",
        executable, "run", "--device", "cpu", str(HERE / "corpus" / "ddp_nccl.py"),
        cwd=tmp_path, timeout=180,
    ))
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    # both ranks write to one pipe: their lines can interleave, so find the records rather than split lines
    ranks = sorted(re.findall(r"rank \d+ world \d+ loss \S+ weight \S+ allreduce [0-9.]+", result.stdout))
    assert ranks == [f"rank {rank} world 2 loss {loss} weight {weight} allreduce 9.000000" for rank in (0, 1)], (
        result.stdout + result.stderr
    )


def test_two_ranks_of_a_tensor_parallel_script_that_wants_two_gpus_run_on_the_cpu(tmp_path: Path, run_python,
                                                                                   launch_ranks) -> None:
    executable = _torchport_executable()
    if executable is None:
        pytest.skip("no `torchport` console script beside sys.executable nor on PATH (pip install -e .)")
    single = run_python(str(HERE / "corpus_cpu" / "tensor_parallel.py"), cwd=tmp_path)
    assert single.returncode == 0, single.stderr
    want = [float(loss) for loss in re.findall(r"step \d+ loss ([0-9.]+)", single.stdout)]
    assert len(want) == 3, single.stdout

    result = launch_ranks(lambda: run_python(
        "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--no-python",
        executable, "run", "--device", "cpu", str(HERE / "corpus" / "tensor_parallel.py"),
        cwd=tmp_path, timeout=180,
    ))
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"exit {result.returncode}\n{output}"
    for rank in (0, 1):
        # sharded matmuls sum in another order than the unsharded one: equal up to float32 rounding
        got = [float(loss) for loss in re.findall(rf"rank {rank} world 2 step \d+ loss ([0-9.]+)", result.stdout)]
        assert len(got) == 3 and all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(got, want)), output
        assert f"rank {rank} shard (2, 2) gathered 28.0" in result.stdout, output
        assert f"rank {rank} dropout zeros or twos True" in result.stdout, output


def test_two_ranks_of_the_ddp_tutorial_run_on_the_cpu_as_its_port_does(tmp_path: Path, run_python,
                                                                        launch_ranks) -> None:
    # nccl, device ids from rank % device_count(), .to(int), DDP(device_ids=[int]), map_location={"cuda:0": ...}
    executable = _torchport_executable()
    if executable is None:
        pytest.skip("no `torchport` console script beside sys.executable nor on PATH (pip install -e .)")
    launch = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2")
    port = launch_ranks(lambda: run_python(*launch, str(HERE / "corpus_cpu" / "ddp_torchrun.py"), cwd=tmp_path,
                                           timeout=180))
    assert port.returncode == 0, port.stderr
    result = launch_ranks(lambda: run_python(*launch, "--no-python", executable, "run", "--device", "cpu",
                                             str(HERE / "corpus" / "ddp_torchrun.py"), cwd=tmp_path, timeout=180))
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    assert result.stdout == port.stdout and port.stdout.startswith("mean loss "), result.stdout + port.stdout


def test_only_a_rank_aborting_at_exit_launches_again(launch_ranks) -> None:
    aborted = "terminate called without an active exception\n  exitcode  : -6 (pid: 1)  (SIGABRT)\n"

    def launches(*results: tuple[int, str]):
        queue = [subprocess.CompletedProcess(["torchrun"], code, "", err) for code, err in results]
        return lambda: queue.pop(0), queue

    launch, left = launches((1, aborted), (0, ""))
    assert launch_ranks(launch).returncode == 0 and not left
    launch, left = launches((1, "RuntimeError: mismatch\n  exitcode  : 1"), (0, ""))
    assert launch_ranks(launch).returncode == 1 and len(left) == 1  # any other failure is the test's to report
    launch, left = launches((1, aborted), (1, aborted), (1, aborted), (0, ""))
    assert launch_ranks(launch).returncode == 1 and len(left) == 1  # three times is a failure too
