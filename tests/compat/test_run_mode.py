"""`torchport run --mode` and TORCHPORT_MODE: the mode is on before the program starts, and reaches the models the
program builds itself (patched classes, the best attention, flash requests that fall back)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # programs run in fresh processes

pytest.importorskip("transformers")

SCRIPT = textwrap.dedent("""
    import warnings
    import torch, transformers, torchport
    from torchport import models

    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1, head_dim=16, vocab_size=64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="flash_attention_2")
    ours = [w for w in caught if str(w.message).startswith("torchport:")]
    print("mode", torchport.modes.active().mode)
    print("patched", models.patched_families() == models.supported(), models.is_patched())
    print("attention", model.config._attn_implementation, len(ours))
    print("logits", tuple(model(torch.tensor([[1, 2, 3]])).logits.shape))
""")


def test_run_mode_enables_the_mode_for_the_programs_models(tmp_path: Path, torchport_run) -> None:
    (tmp_path / "prog.py").write_text(SCRIPT)
    result = torchport_run("--device", "cpu", "--mode", "balanced", "--report", "prog.py", cwd=tmp_path,
                           timeout=300)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "mode balanced" in lines and "patched True True" in lines
    assert "attention sdpa 1" in lines or "attention flash_attention_2 0" in lines  # flash-attn installed or not
    assert "logits (1, 3, 64)" in lines
    assert "torchport balanced mode on cpu for process" in result.stderr  # --report shows what the mode changed


def test_torchport_mode_variable_and_bad_values(tmp_path: Path, torchport_run) -> None:
    (tmp_path / "prog.py").write_text(SCRIPT)
    result = torchport_run("--device", "cpu", "prog.py", cwd=tmp_path, env={"TORCHPORT_MODE": "memory"},
                           timeout=300)
    assert result.returncode == 0, result.stderr
    assert "mode memory" in result.stdout.splitlines()
    for args, env, shown in ((["--mode", "fast"], {}, "--mode 'fast' is not a mode; modes: speed, balanced, memory"),
                             ([], {"TORCHPORT_MODE": "fast"}, "TORCHPORT_MODE='fast' is not a mode; valid values: "
                                                               "speed, balanced, memory")):
        result = torchport_run("--device", "cpu", *args, "prog.py", cwd=tmp_path, env=env)
        assert result.returncode == 2 and shown in result.stderr, result.stderr
        assert "Traceback" not in result.stderr and "mode" not in result.stdout
