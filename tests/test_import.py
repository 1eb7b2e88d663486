"""`import torchport` needs only torch, is fast, and touches no accelerator; device names stay in backends/."""

import io
import os
import pathlib
import subprocess
import sys
import textwrap
import tokenize

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


def _public_names() -> tuple[list[str], list[str]]:
    """The public subpackages (folders with an __init__.py) and modules of src/torchport, as found on disk."""
    packages = sorted(p.name for p in SRC.iterdir() if (p / "__init__.py").is_file() and not p.name.startswith("_"))
    modules = sorted(p.stem for p in SRC.glob("*.py") if not p.stem.startswith("_"))
    return packages, modules


def test_every_public_subpackage_is_an_attribute_after_import_torchport() -> None:
    packages, modules = _public_names()
    assert {"compat", "distributed", "testing", "kernels"} <= set(packages)  # the scan itself finds them
    # auto redirects CUDA calls when imported: it is imported on purpose (`import torchport.auto`), never by a lookup
    wanted = packages + [name for name in modules if name != "auto"]
    out = _run(f"""
        import sys, types, torchport
        wanted = {wanted!r}
        loaded = sorted(name for name in {packages!r} if "torchport." + name in sys.modules)
        print(loaded)
        print(sorted(set(wanted) - set(dir(torchport))))
        print(sorted(name for name in wanted if getattr(torchport, name, None) is None))
        print(sorted(name for name in {packages!r}
                     if getattr(torchport, name) is not sys.modules.get("torchport." + name)))
        print(callable(torchport.distributed.init), callable(torchport.compat.patch))
        print("torchport.auto" in sys.modules)
    """).split("\n")
    assert out[0] == "['backends']", "import torchport imported more subpackages than the device API needs"
    assert out[1] == "[]", f"missing from dir(torchport): {out[1]}"
    assert out[2] == "[]", f"not reachable as torchport.<name>: {out[2]}"
    assert out[3] == "[]", f"torchport.<name> is not the subpackage for: {out[3]}"
    assert out[4:6] == ["True True", "False"]


def test_the_lazy_list_names_every_subpackage_not_imported_eagerly() -> None:
    import torchport

    packages, _ = _public_names()
    assert sorted(set(packages) - torchport._LAZY_SUBPACKAGES) == ["backends"]


def _device_module_uses(source: str) -> list[int]:
    """Lines whose code (not strings or comments) names torch.cuda, torch.npu or torch_npu."""
    tokens = [t for t in tokenize.generate_tokens(io.StringIO(source).readline)
              if t.type in (tokenize.NAME, tokenize.OP)]
    lines = []
    for i, tok in enumerate(tokens):
        if tok.string == "torch_npu":
            lines.append(tok.start[0])
        elif (tok.string == "torch" and i + 2 < len(tokens) and tokens[i + 1].string == "."
              and tokens[i + 2].string in ("cuda", "npu")):
            lines.append(tok.start[0])
    return lines


def test_device_names_only_in_backends_compat_and_testing() -> None:
    allowed = {"backends", "compat", "testing"}
    offenders = []
    for path in SRC.rglob("*.py"):
        if path.relative_to(SRC).parts[0] in allowed:
            continue
        source = path.read_text()
        for number in _device_module_uses(source):
            offenders.append(f"{path.relative_to(SRC)}:{number}: {source.splitlines()[number - 1].strip()}")
    assert not offenders, "device modules named outside backends/, compat/, testing/:\n" + "\n".join(offenders)


def test_the_house_rule_check_sees_code_not_text() -> None:
    assert _device_module_uses("import torch\nx = torch.cuda.is_available()\nimport torch_npu\n") == [2, 3]
    assert _device_module_uses("s = 'torch.cuda.synchronize()'  # torch.npu\n") == []
