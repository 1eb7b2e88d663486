"""`import torchport` needs only torch, is fast, and touches no accelerator; device names stay in backends/."""

import os
import pathlib
import re
import subprocess
import sys
import textwrap

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "torchport"


def _run(code: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHPORT_")}
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                            env=env, timeout=120, check=True)
    return result.stdout


def test_import_loads_no_optional_package_and_no_device() -> None:
    out = _run("""
        import sys, torch, torchport
        heavy = ["torch_npu", "triton", "transformers", "rich", "safetensors", "numpy.random", "torchport.testing",
                 "torchport.cli"]
        print([m for m in heavy if m in sys.modules])
        print(torch.cuda.is_initialized(), torch._C._get_privateuse1_backend_name())
    """)
    assert out.split("\n")[:2] == ["[]", "False privateuseone"]


def test_import_adds_little_to_import_torch() -> None:
    # Best of 3 runs, each in a fresh interpreter, to ride out a noisy machine.
    cost = min(float(_run("""
        import time, torch
        t = time.perf_counter(); import torchport; print(time.perf_counter() - t)
    """)) for _ in range(3))
    assert cost < 0.5, f"import torchport took {cost:.3f} s on top of import torch"


def test_device_names_only_in_backends_compat_and_testing() -> None:
    pattern = re.compile(r"torch\.(cuda|npu)\b|torch_npu")
    allowed = {"backends", "compat", "testing"}
    offenders = []
    for path in SRC.rglob("*.py"):
        if path.relative_to(SRC).parts[0] in allowed:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if pattern.search(code) and not re.search(r"[\"'][^\"']*torch_npu[^\"']*[\"']", code):
                offenders.append(f"{path.relative_to(SRC)}:{number}: {line.strip()}")
    assert not offenders, "device modules named outside backends/, compat/, testing/:\n" + "\n".join(offenders)
