"""The device definition at the module top, aliases, formatting, and the sites left as written."""

from __future__ import annotations

import pytest

from torchport.migrate import migrate_source

HEADER = 'DEVICE = torch.accelerator.current_accelerator(check_available=True) or torch.device("cpu")'


def test_one_definition_after_the_imports_reused_by_every_site_and_kept_on_a_second_run() -> None:
    code = '"""Doc."""\nfrom __future__ import annotations\nimport os\nimport torch\n\nA = 1\nx = t.cuda()\ny = u.cuda()\n'
    once = migrate_source(code).code
    assert once == ('"""Doc."""\nfrom __future__ import annotations\nimport os\nimport torch\n\n'
                    f"{HEADER}\n\nA = 1\nx = t.to(DEVICE)\ny = u.to(DEVICE)\n")
    assert migrate_source(once).code == once
    assert migrate_source(once + "z = v.cuda()\n").code.count("current_accelerator") == 1


def test_no_definition_when_no_site_needs_the_device() -> None:
    code = "import torch\nok = torch.cuda.is_available()\n"
    assert migrate_source(code).code == "import torch\nok = torch.accelerator.is_available()\n"


def test_torch_alias_is_used_and_a_missing_torch_import_is_added() -> None:
    code = migrate_source("import torch as th\nx = t.cuda()\nth.cuda.synchronize()\n").code
    assert 'DEVICE = th.accelerator.current_accelerator(check_available=True) or th.device("cpu")' in code
    assert "th.accelerator.synchronize()" in code
    code = migrate_source("import numpy as np\nx = t.cuda()\n").code
    assert code.startswith(f"import numpy as np\nimport torch\n\n{HEADER}\n")


def test_a_taken_name_is_not_reused() -> None:
    code = migrate_source('import torch\nDEVICE = "cuda"\nx = t.cuda()\n').code
    assert 'DEFAULT_DEVICE = torch.accelerator.current_accelerator(check_available=True) or torch.device("cpu")' in code
    assert "DEVICE = DEFAULT_DEVICE.type\nx = t.to(DEFAULT_DEVICE)" in code
    assert migrate_source(code).code == code


def test_comments_formatting_and_line_endings_survive() -> None:
    code = "import torch\r\n\r\n# setup\r\nx = t.cuda(  # move it\r\n)\r\ny = {'a':1}  # odd spacing\r\n"
    new = migrate_source(code).code
    assert "# setup\r\nx = t.to(  # move it\r\nDEVICE)\r\ny = {'a':1}  # odd spacing\r\n" in new
    assert "\n" not in new.replace("\r\n", "")


def test_changes_carry_site_rule_before_and_after() -> None:
    change = migrate_source("import torch\n\nx = t.cuda()\n", "a.py").changes[0]
    assert (change.path, change.line, change.col, change.rule) == ("a.py", 3, 5, "tensor-cuda")
    assert (change.before, change.after) == ("t.cuda()", "t.to(DEVICE)")


@pytest.mark.parametrize(("code", "what"), [
    ("from flash_attn import flash_attn_func", "flash_attn"),
    ("import cupy as cp", "cupy"),
    ("import triton\n@triton.jit\ndef k(x):\n    pass", "Triton kernel"),
    ("from torch.utils.cpp_extension import load\nm = load('m', ['m.cu'])", "custom C++/CUDA extension"),
    ("torch.cuda.nvtx.range_push('step')", "NVTX range"),
    ("g = torch.cuda.CUDAGraph()", "CUDA graph"),
    ("with torch.cuda.graph(g):\n    pass", "CUDA graph capture"),
    ("p = torch.cuda.get_device_properties(0)", "no rule for torch.cuda.get_device_properties"),
    ("s = torch.cuda.Stream(device=1)", "Stream(device)"),
    ("from torch.cuda.amp import custom_fwd, autocast\nwith autocast():\n    pass", "from torch.cuda.amp import"),
])
def test_unconvertible_sites_are_left_as_written_and_reported(code: str, what: str) -> None:
    source = f"import torch\n{code}\n"
    result = migrate_source(source, "m.py")
    assert result.code == source
    assert any(what in site.what for site in result.unconverted), result.unconverted
    site = result.unconverted[0]
    assert site.path == "m.py" and site.line >= 2 and site.hint


def test_syntax_error_is_skipped_with_its_line() -> None:
    result = migrate_source("import torch\ndef f(:\n    x.cuda()\n")
    assert result.skipped and "line 2" in result.skipped
    assert not result.changed and result.code == result.original
