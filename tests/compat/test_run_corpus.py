"""`torchport run` on a corpus of CUDA-written scripts: each runs unchanged on the CPU and on the simulated NPU and
prints what its hand-ported CPU version (``corpus_cpu/``, same file name) prints.

Every run is a fresh process (``python -m torchport run --device D corpus/X.py``) in a copy of the two corpus
folders. The CPU ports run once per session. Numbers must be equal, except on the simulated NPU in the scripts whose
autocast takes its default dtype: float16 there, bfloat16 in the CPU port, so floats are compared with a tolerance.
"""

from __future__ import annotations

import math
import re
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # each case runs a script in fresh processes

HERE = Path(__file__).parent
HELPERS = {"child.py"}  # run by subprocess_child.py, not a corpus entry of its own
SCRIPTS = sorted(path.name for path in (HERE / "corpus").glob("*.py") if path.name not in HELPERS)

TARGETS = {
    "cpu": (["--device", "cpu"], {}),  # explicit, so that it is also the CPU on a GPU machine
    "npu": (["--device", "npu"], {"TORCHPORT_SIMULATE": "npu"}),
}
# (rtol, atol) for floats on the simulated NPU, where autocast("cuda") without a dtype means float16 and the CPU
# port's bfloat16. Measured: 0.07% apart after three SGD steps; bf16's own resolution is 0.4%.
NPU_TOLERANCE = {"autocast_default.py": (2e-2, 1e-3), "amp_training.py": (2e-2, 1e-3)}
# Three python processes each (spawn), ~10 s per run on 2 cores: their CPU runs stay in the default pass.
SLOW_ON_NPU = {"dataloader_spawn.py", "mp_spawn.py"}

_TOKEN = re.compile(r"[^\s,()\[\]]+|[,()\[\]]")
_FLOAT = re.compile(r"[-+]?(\d+\.\d*|\.\d+|\d+)([eE][-+]?\d+)?|[-+]?(inf|nan)")


def assert_same_output(got: str, want: str, rtol: float = 0.0, atol: float = 0.0) -> None:
    """Line by line: tokens equal, except floats (in both) that are within ``rtol``/``atol``; exact by default.

    Example:
        >>> assert_same_output("loss 1.000100 (2, 3)", "loss 1.000000 (2, 3)", rtol=1e-3)
    """
    got_lines, want_lines = got.splitlines(), want.splitlines()
    if len(got_lines) != len(want_lines):
        raise AssertionError(f"{len(got_lines)} lines printed, {len(want_lines)} expected\n"
                             f"--- got ---\n{got}--- expected ---\n{want}")
    for number, (got_line, want_line) in enumerate(zip(got_lines, want_lines), start=1):
        if got_line == want_line:
            continue
        got_tokens, want_tokens = _TOKEN.findall(got_line), _TOKEN.findall(want_line)
        same = len(got_tokens) == len(want_tokens) and all(
            a == b or _close(a, b, rtol, atol) for a, b in zip(got_tokens, want_tokens)
        )
        if not same:
            raise AssertionError(f"line {number} differs (rtol={rtol}, atol={atol}):\n"
                                 f"  got      {got_line!r}\n  expected {want_line!r}")


def _close(a: str, b: str, rtol: float, atol: float) -> bool:
    if not (rtol or atol) or not (_FLOAT.fullmatch(a) and _FLOAT.fullmatch(b)):
        return False
    return math.isclose(float(a), float(b), rel_tol=rtol, abs_tol=atol)


def describe(result: subprocess.CompletedProcess[str]) -> str:
    """The command, exit code and both streams, for an assertion message."""
    return (f"\n$ {' '.join(map(str, result.args))}\nexit {result.returncode}\n"
            f"--- stdout ---\n{result.stdout}--- stderr ---\n{result.stderr}")


@pytest.fixture(scope="session")
def corpus_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of corpus/ and corpus_cpu/, so that no run writes into the source tree."""
    root = tmp_path_factory.mktemp("corpus")
    for name in ("corpus", "corpus_cpu"):
        shutil.copytree(HERE / name, root / name, ignore=shutil.ignore_patterns("__pycache__"))
    return root


@pytest.fixture(scope="session")
def reference(corpus_root: Path, run_python):
    """``reference(name)``: the stdout of ``python corpus_cpu/<name>``, run once per session."""
    cache: dict[str, str] = {}

    def stdout(name: str) -> str:
        if name not in cache:
            result = run_python(f"corpus_cpu/{name}", cwd=corpus_root)
            assert result.returncode == 0, f"the CPU port itself fails{describe(result)}"
            cache[name] = result.stdout
        return cache[name]

    return stdout


# The simulated NPU has no collective backend (a real NPU uses HCCL), so DDP and tensor parallelism run on the CPU
# target only.
NO_COLLECTIVES_ON_SIMULATED_NPU = {"ddp_nccl.py", "ddp_torchrun.py", "tensor_parallel.py"}


def _cases():
    for target in TARGETS:
        for name in SCRIPTS:
            marks = [pytest.mark.slow] if target == "npu" and name in SLOW_ON_NPU else []
            if target == "npu" and name in NO_COLLECTIVES_ON_SIMULATED_NPU:
                marks.append(pytest.mark.skip(reason="the simulated NPU has no collective (hccl) backend"))
            yield pytest.param(target, name, id=f"{target}-{name.removesuffix('.py')}", marks=marks)


@pytest.mark.parametrize(("target", "name"), list(_cases()))
def test_script_prints_what_its_cpu_port_prints(target: str, name: str, corpus_root: Path, reference,
                                                torchport_run) -> None:
    options, env = TARGETS[target]
    result = torchport_run(*options, f"corpus/{name}", cwd=corpus_root, env=env)
    assert result.returncode == 0, describe(result)
    rtol, atol = NPU_TOLERANCE.get(name, (0.0, 0.0)) if target == "npu" else (0.0, 0.0)
    try:
        assert_same_output(result.stdout, reference(name), rtol=rtol, atol=atol)
    except AssertionError as error:
        raise AssertionError(f"{error}{describe(result)}") from None


def test_every_script_has_a_cpu_port() -> None:
    cuda = {path.name for path in (HERE / "corpus").glob("*.py")}
    cpu = {path.name for path in (HERE / "corpus_cpu").glob("*.py")}
    assert cuda == cpu


# -- the comparison helper itself -----------------------------------------------------------------------------------
def test_assert_same_output_is_exact_by_default() -> None:
    assert_same_output("a 1.000000\nshape (2, 3)\n", "a 1.000000\nshape (2, 3)\n")
    with pytest.raises(AssertionError, match="line 1"):
        assert_same_output("a 1.000001\n", "a 1.000000\n")
    with pytest.raises(AssertionError, match="2 lines printed, 1 expected"):
        assert_same_output("a\nb\n", "a\n")


def test_assert_same_output_tolerates_floats_only() -> None:
    assert_same_output("loss 1.010000 [0.5, 2.02]\n", "loss 1.000000 [0.5, 2.0]\n", rtol=2e-2)
    assert_same_output("mean 0.000400\n", "mean -0.000300\n", rtol=2e-2, atol=1e-3)
    with pytest.raises(AssertionError):
        assert_same_output("loss 1.100000\n", "loss 1.000000\n", rtol=2e-2)
    with pytest.raises(AssertionError):
        assert_same_output("dtype torch.float16 1.0\n", "dtype torch.bfloat16 1.0\n", rtol=2e-2)
    with pytest.raises(AssertionError):
        assert_same_output("available False\n", "available True\n", rtol=1.0)
