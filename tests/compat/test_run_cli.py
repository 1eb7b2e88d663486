"""`torchport run`'s command line keeps `python script.py`'s contract: argv, __main__, sys.path, exit codes,
exceptions and tracebacks; `-m`; `--report`; and CUDA-only imports (flash_attn) that cannot run on the target.

Each test writes a small script into its tmp_path and runs it in a fresh process on the CPU target.
"""

from __future__ import annotations

import json
import re
import subprocess
import textwrap
from pathlib import Path

import pytest

import torchport

PACKAGE_DIR = Path(torchport.__file__).resolve().parent
_FRAME = re.compile(r'^  File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<name>.+)$', re.MULTILINE)


def write(path: Path, source: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(source).lstrip())
    return path


def describe(result: subprocess.CompletedProcess[str]) -> str:
    return (f"\n$ {' '.join(map(str, result.args))}\nexit {result.returncode}\n"
            f"--- stdout ---\n{result.stdout}--- stderr ---\n{result.stderr}")


def frames(traceback: str, cwd: Path) -> list[tuple[Path, int, str]]:
    """(file, line, function) of each frame of a printed traceback, files resolved against ``cwd``."""
    return [((cwd / m["file"]).resolve(), int(m["line"]), m["name"]) for m in _FRAME.finditer(traceback)]


# -- bad input --------------------------------------------------------------------------------------------------------
def test_missing_script_is_a_usage_error_naming_the_path(tmp_path: Path, torchport_run) -> None:
    result = torchport_run("--device", "cpu", "nowhere/missing_script.py", cwd=tmp_path)
    assert result.returncode == 2, describe(result)
    assert "nowhere/missing_script.py" in result.stderr
    assert "Traceback" not in result.stderr


def test_unknown_device_is_a_usage_error_listing_devices(tmp_path: Path, torchport_run) -> None:
    write(tmp_path / "ran.py", 'print("the script ran")\n')
    result = torchport_run("--device", "nonsense", "ran.py", cwd=tmp_path)
    assert result.returncode == 2, describe(result)
    assert "nonsense" in result.stderr and ("registered:" in result.stderr or "Available" in result.stderr)
    assert "the script ran" not in result.stdout
    assert "Traceback" not in result.stderr


def test_invalid_report_setting_is_a_usage_error(tmp_path: Path, torchport_run) -> None:
    write(tmp_path / "ran.py", 'print("the script ran")\n')
    result = torchport_run("ran.py", cwd=tmp_path, env={"TORCHPORT_REPORT": "maybe"})
    assert result.returncode == 2, describe(result)
    assert "TORCHPORT_REPORT='maybe'" in result.stderr and "valid values" in result.stderr
    assert "Traceback" not in result.stderr and "the script ran" not in result.stdout


# -- the script's own exit ---------------------------------------------------------------------------------------------
def test_exception_passes_through_with_a_traceback_into_the_script(tmp_path: Path, torchport_run) -> None:
    script = write(tmp_path / "boom.py", """
        def fail():
            raise ValueError("boom")

        fail()
    """)
    result = torchport_run("--device", "cpu", "boom.py", cwd=tmp_path)
    assert result.returncode == 1, describe(result)
    assert result.stderr.rstrip().splitlines()[-1] == "ValueError: boom", describe(result)
    stack = frames(result.stderr, tmp_path)
    assert stack[-2:] == [(script.resolve(), 4, "<module>"), (script.resolve(), 2, "fail")], describe(result)
    first_in_script = next(i for i, (file, _, _) in enumerate(stack) if file == script.resolve())
    above = [file for file, _, _ in stack[:first_in_script]]
    assert not [file for file in above if PACKAGE_DIR in file.parents], describe(result)


@pytest.mark.parametrize("code", [0, 3])
def test_sys_exit_code_passes_through(code: int, tmp_path: Path, torchport_run) -> None:
    write(tmp_path / "exits.py", f"import sys\nprint('before exit')\nsys.exit({code})\n")
    result = torchport_run("--device", "cpu", "exits.py", cwd=tmp_path)
    assert result.returncode == code, describe(result)
    assert result.stdout == "before exit\n"
    assert "Traceback" not in result.stderr


def test_script_sees_argv_main_and_its_directory_on_sys_path(tmp_path: Path, torchport_run) -> None:
    script = write(tmp_path / "scripts" / "show_argv.py", """
        import json, sys
        print(json.dumps({"argv": sys.argv, "name": __name__, "path0": sys.path[0], "file": __file__}))
    """)
    # arguments after the script are the script's, even where they look like torchport's own options
    args = ["--device", "npu", "--report", "-m", "x", "two words"]
    result = torchport_run("--device", "cpu", "scripts/show_argv.py", *args, cwd=tmp_path)
    assert result.returncode == 0, describe(result)
    seen = json.loads(result.stdout)
    assert seen["argv"] == ["scripts/show_argv.py", *args]
    assert seen["name"] == "__main__"
    assert Path(seen["path0"]).resolve() == script.parent.resolve()
    assert (tmp_path / seen["file"]).resolve() == script.resolve()


def test_module_mode_runs_a_package_module_as_main(tmp_path: Path, torchport_run) -> None:
    write(tmp_path / "pkg" / "__init__.py", "")
    module = write(tmp_path / "pkg" / "tool.py", """
        import json, sys
        import torch
        x = torch.arange(4.0).cuda()
        print(json.dumps({"argv": sys.argv, "name": __name__, "path0": sys.path[0], "sum": x.sum().item()}))
        sys.exit(5)
    """)
    result = torchport_run("--device", "cpu", "-m", "pkg.tool", "a", "--b", cwd=tmp_path)
    assert result.returncode == 5, describe(result)
    seen = json.loads(result.stdout)
    assert seen["name"] == "__main__" and seen["sum"] == 6.0
    assert seen["argv"][1:] == ["a", "--b"]
    assert Path(seen["argv"][0]).resolve() == module.resolve()
    assert Path(seen["path0"] or ".").resolve() == tmp_path.resolve()  # the working directory, as with python -m


# -- the report -------------------------------------------------------------------------------------------------------
REPORTED = """
import torch
xs = []
for i in range(3):
    xs.append(torch.ones(2).cuda())
torch.cuda.synchronize()
print(f"{sum(x.sum() for x in xs).item():.1f}")
"""


@pytest.mark.parametrize("how", ["flag", "env"])
def test_report_counts_redirects_with_their_first_call_site(how: str, tmp_path: Path, torchport_run) -> None:
    write(tmp_path / "report_me.py", REPORTED)
    options, env = (["--report"], {}) if how == "flag" else ([], {"TORCHPORT_REPORT": "1"})
    result = torchport_run("--device", "cpu", *options, "report_me.py", cwd=tmp_path, env=env)
    assert result.returncode == 0, describe(result)
    assert result.stdout == "6.0\n"  # the report goes to stderr only
    cuda_rows = [line for line in result.stderr.splitlines() if "Tensor.cuda" in line]
    assert cuda_rows, describe(result)
    assert re.search(r"\b3\b", cuda_rows[0]) and "report_me.py:4" in cuda_rows[0], describe(result)
    sync_rows = [line for line in result.stderr.splitlines() if "torch.cuda.synchronize" in line]
    assert sync_rows and re.search(r"\b1\b", sync_rows[0]) and "report_me.py:5" in sync_rows[0], describe(result)


# -- CUDA-only dependencies -------------------------------------------------------------------------------------------
def test_optional_flash_attn_falls_back_and_is_reported(tmp_path: Path, torchport_run) -> None:
    write(tmp_path / "attention.py", """
        import torch
        import torch.nn.functional as F
        try:
            from flash_attn import flash_attn_func
            HAVE_FLASH = True
        except ImportError:
            HAVE_FLASH = False
        torch.manual_seed(0)
        q = torch.randn(1, 2, 4, 8).cuda()
        print("flash", HAVE_FLASH)
        print(f"{F.scaled_dot_product_attention(q, q, q).sum().item():.6f}")
    """)
    result = torchport_run("--device", "cpu", "--report", "attention.py", cwd=tmp_path)
    assert result.returncode == 0, describe(result)
    assert result.stdout.splitlines()[0] == "flash False"  # flash_attn cannot run on the CPU, installed or not
    rows = [line for line in result.stderr.splitlines() if "flash_attn" in line]
    assert rows, describe(result)
    # a hint: more words on the row (or the next) than the name and a count
    hint = " ".join(rows[0].replace("flash_attn", " ").split())
    assert len(re.findall(r"[A-Za-z]{3,}", hint)) >= 2, describe(result)


def test_required_flash_attn_fails_with_one_clear_message(tmp_path: Path, torchport_run) -> None:
    write(tmp_path / "needs_flash.py", """
        import torch
        from flash_attn import flash_attn_func
        print("unreachable")
    """)
    result = torchport_run("--device", "cpu", "needs_flash.py", cwd=tmp_path)
    assert result.returncode == 1, describe(result)
    assert "unreachable" not in result.stdout
    assert "flash_attn" in result.stderr.strip().splitlines()[-1], describe(result)
    assert not [f for f, _, _ in frames(result.stderr, tmp_path) if "flash_attn" in f.parts], describe(result)


# -- torch.compile --------------------------------------------------------------------------------------------------
@pytest.mark.slow  # Inductor generates and builds C++ for the forward and the backward on the CPU (~20 s on 2 cores)
@pytest.mark.parametrize("target", ["cpu", "npu"])
def test_a_compiled_model_trains_on_the_target(target: str, tmp_path: Path, torchport_run) -> None:
    """A CUDA-written script that compiles its model with the default backend (Inductor), as nanoGPT's train.py
    does, trains on the CPU (Inductor, which the shim must not hand the target's answers to its own device queries)
    and on the simulated NPU (torchport's backend: Inductor has no code generator for that device)."""
    write(tmp_path / "compiled.py", """
        import torch

        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).to("cuda")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        step = torch.compile(model)
        x, y = torch.randn(8, 16, device="cuda"), torch.randn(8, 4, device="cuda")
        for _ in range(3):
            with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
                loss = torch.nn.functional.mse_loss(step(x).float(), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        print("device", next(model.parameters()).device.type, "finite", bool(torch.isfinite(loss)))
    """)
    env = {"TORCHPORT_SIMULATE": "npu"} if target == "npu" else {}
    result = torchport_run("--device", target, "--report", "compiled.py", cwd=tmp_path, env=env, timeout=600)
    assert result.returncode == 0, describe(result)
    assert result.stdout.strip().splitlines()[-1] == f"device {target} finite True", describe(result)
    assert ("torch.compile(backend=inductor)" in result.stderr) == (target == "npu"), describe(result)


@pytest.mark.slow  # imports transformers and trains a few steps in a fresh process
def test_a_hugging_face_trainer_written_for_cuda_trains_on_the_cpu_target(tmp_path: Path, torchport_run) -> None:
    """A Trainer script as written for a GPU (model.cuda(), bf16=True) trains on the CPU target."""
    pytest.importorskip("transformers")
    write(tmp_path / "train_hf.py", """
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

        assert torch.cuda.is_available(), "this script needs a GPU"
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2)
        model = LlamaForCausalLM(config).cuda()
        ids = torch.randint(0, 64, (16, 12))
        data = [{"input_ids": row, "labels": row} for row in ids]
        args = TrainingArguments(output_dir="out", per_device_train_batch_size=4, max_steps=3, bf16=True,
                                 report_to=[], save_strategy="no", dataloader_pin_memory=True, logging_steps=1)
        result = Trainer(model=model, args=args, train_dataset=data).train()
        print("device", next(model.parameters()).device.type, "steps", result.global_step,
              "finite", bool(torch.isfinite(torch.tensor(result.training_loss))))
    """)
    result = torchport_run("--device", "cpu", "--report", "train_hf.py", cwd=tmp_path, timeout=600)
    assert result.returncode == 0, describe(result)
    assert result.stdout.strip().splitlines()[-1] == "device cpu steps 3 finite True", describe(result)
    assert "TrainingArguments(use_cpu=True)" in result.stderr, describe(result)


@pytest.mark.slow  # imports Lightning and trains two ranks in fresh processes
def test_a_lightning_script_asking_for_gpus_trains_on_the_cpu_target(tmp_path: Path, torchport_run) -> None:
    """A Lightning script as written for two GPUs (accelerator="cuda", devices=[0, 1], DDP, fp16 mixed precision)
    trains on the CPU target as two CPU processes; Lightning's relaunched rank runs under the shim too."""
    pytest.importorskip("lightning")
    write(tmp_path / "train_lightning.py", """
        import torch
        import lightning as L


        class Model(L.LightningModule):
            def __init__(self):
                super().__init__()
                self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

            def training_step(self, batch, _):
                x, y = batch
                return torch.nn.functional.mse_loss(self.net(x), y)

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)


        torch.manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
        trainer = L.Trainer(accelerator="cuda", devices=[0, 1], strategy="ddp", precision="16-mixed", max_steps=3,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False)
        trainer.fit(Model(), torch.utils.data.DataLoader(data, batch_size=8))
        with open(f"rank{trainer.global_rank}.txt", "w") as out:  # a file each: the ranks share stdout
            out.write(f"rank {trainer.global_rank} of {trainer.world_size} on {trainer.strategy.root_device.type} "
                      f"steps {trainer.global_step}")
    """)
    result = torchport_run("--device", "cpu", "--report", "train_lightning.py", cwd=tmp_path, timeout=600)
    assert result.returncode == 0, describe(result)
    printed = sorted(path.read_text() for path in tmp_path.glob("rank*.txt"))
    assert printed == ["rank 0 of 2 on cpu steps 3", "rank 1 of 2 on cpu steps 3"], describe(result)
    assert "Trainer(accelerator='cuda')" in result.stderr, describe(result)
