"""Ascend chip profiles (``torchport.backends.npu``) and the simulated NPU playing each chip: what ``torch.npu``
reports, what fails at call time, how the kernel registry falls back, and the NPU tests on a chip without bfloat16."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import torchport
from torchport.backends import get_backend
from torchport.backends.npu import ChipProfile, chip_profile, device_chip, npu_chip_profiles
from torchport.compile.op_support import device_op_support
from torchport.export.atc import soc_version
from torchport.kernels import KernelError, registry
from torchport.kernels.glu import swiglu_reference
from torchport.testing import npu_fused_ops, simulated_chip, unsupported_ops

ROOT = Path(__file__).resolve().parents[2]


# -- the profiles ------------------------------------------------------------------------------------------------------
def test_profiles_of_each_family() -> None:
    profiles = npu_chip_profiles()
    assert {"Ascend910A", "Ascend910B1", "Ascend910B2", "Ascend910B3", "Ascend910B4", "Ascend910_9392",
            "Ascend310P3"} <= set(profiles)
    a1, a2, a3, p310 = (profiles[n] for n in ("Ascend910A", "Ascend910B3", "Ascend910_9392", "Ascend310P3"))
    assert (a1.family, a2.family, a3.family, p310.family) == ("A1", "A2", "A3", "310P")
    assert (a1.ai_cores, a1.vector_cores, a1.multi_processor_count) == (32, 0, 32)  # no separate vector cores
    assert (a2.ai_cores, a2.vector_cores, a2.multi_processor_count) == (20, 40, 40)
    assert (p310.ai_cores, p310.vector_cores, p310.multi_processor_count) == (8, 7, 7)
    assert not a1.bf16 and not p310.bf16 and a2.bf16 and a3.bf16
    assert torch.bfloat16 not in p310.dtypes and torch.float16 in p310.dtypes
    assert "npu_swiglu" in a2.ops and "npu_swiglu" not in a1.ops | p310.ops
    assert "npu_rms_norm" in a1.ops & a2.ops & a3.ops & p310.ops
    assert "npu_weight_quant_batchmatmul" in p310.ops and "npu_convert_weight_to_int4pack" not in p310.ops
    assert a2.lacks("npu_swiglu") is None
    assert a1.lacks("npu_swiglu") == ("npu_swiglu does not run on Ascend910A (A1: Atlas training series, Ascend 910); "
                                      "torch_npu documents it for A2 only")


def test_chip_names_aliases_and_errors() -> None:
    assert chip_profile().soc_version == "Ascend910B3"  # the default
    assert chip_profile(" ascend310p3 ").soc_version == "Ascend310P3"
    assert chip_profile("Ascend910_93").soc_version == "Ascend910_9392"
    with pytest.raises(ValueError, match=r"'Ascend910C' is not an Ascend chip torchport knows; known: Ascend910A, .*"
                                         r"Ascend310P3.*Ascend910_93"):
        chip_profile("Ascend910C")
    b4 = chip_profile("Ascend910B4")
    assert isinstance(b4, ChipProfile) and b4.memory_bytes == 32 * 2**30


def test_simulate_setting_takes_a_chip() -> None:
    with torchport.settings.override(simulate="npu:ascend910a"):
        assert torchport.settings.value("simulate") == "npu:Ascend910A"
    with torchport.settings.override(simulate="npu"):
        assert torchport.settings.value("simulate") == "npu"
    with pytest.raises(ValueError, match=r"simulate='npu:Ascend999': 'Ascend999' is not an Ascend chip torchport "
                                         r"knows; known: Ascend910A.*Ascend310P3"):
        with torchport.settings.override(simulate="npu:Ascend999"):
            pass
    with pytest.raises(ValueError, match=r"cannot be simulated; valid values: npu, or npu:<soc>"):
        with torchport.settings.override(simulate="gpu:Ascend910A"):
            pass


# -- torch.npu per chip --------------------------------------------------------------------------------------------
@pytest.fixture
def npu(npu: torch.device) -> torch.device:
    """The conftest's NPU, which must be the simulated one here: these tests change its chip."""
    if not torchport.testing.is_simulating():
        pytest.skip("changes the simulated chip; this NPU is a real one")
    return npu


@pytest.mark.parametrize("soc", ["Ascend910A", "Ascend910B1", "Ascend910B4", "Ascend910_9392", "Ascend310P3"])
def test_torch_npu_reports_the_chip(npu: torch.device, soc: str) -> None:
    with simulated_chip(soc) as chip:
        assert torch.npu.get_device_name() == torch.npu.get_device_name(0) == soc  # the SoC, whatever the index
        props = torch.npu.get_device_properties(0)
        assert props.name == soc and props.major is None and props.minor is None  # never set by torch_npu
        assert (props.cube_core_num, props.vector_core_num) == (chip.ai_cores, chip.vector_cores)
        assert props.multi_processor_count == (chip.vector_cores or chip.ai_cores)
        assert props.L2_cache_size == chip.l2_bytes and len(props.uuid.bytes) == 16
        assert torch.npu.is_bf16_supported() == chip.bf16
        assert (torch.bfloat16 in torch.npu.get_amp_supported_dtype()) == chip.bf16
        backend = get_backend("npu")
        assert backend.chip(0) == device_chip(npu) == chip and soc_version(device=npu) == soc
        assert backend.dtype_works(torch.bfloat16, 0) == chip.bf16  # by the dtype probe
        assert backend.properties(0)["multi_processor_count"] == chip.multi_processor_count
        assert "major" not in backend.properties(0)
    with pytest.warns(UserWarning, match="TORCH_NPU_DEVICE_CAPABILITY"):
        assert torch.npu.get_device_capability(0) is None


def test_the_soc_version_of_a_hyphenated_chip_is_whole(npu: torch.device) -> None:
    with simulated_chip("Ascend910B4-1"):
        assert torch.npu.get_device_name() == soc_version(device=npu) == "Ascend910B4-1"


def test_a_chip_without_bf16_copies_but_does_not_compute_in_it(npu: torch.device) -> None:
    with simulated_chip("Ascend310P3"):
        x = torch.ones(2, 3).to(npu, torch.bfloat16)
        assert x.cpu().dtype == torch.bfloat16 and x.t().shape == (3, 2) and x.float().sum().item() == 6
        with pytest.raises(RuntimeError, match="Ascend310P3 .310P. has no bfloat16 kernels"):
            x + x
    assert (x + x).float().sum().item() == 12  # the A2 default computes in it


def test_a_missing_operator_is_there_and_fails_when_called(npu: torch.device) -> None:
    backend = get_backend("npu")
    x = torch.randn(2, 8).to(npu)
    with simulated_chip("Ascend910A"):
        op = backend.fused_op("npu_swiglu")
        assert op is not None  # torch_npu has every operator on every chip
        with pytest.raises(RuntimeError, match="npu_swiglu: NPU function error: .*Ascend910A.*documents it for A2"):
            op(x)
        assert backend.chip_lacks("npu_swiglu", 0) is not None and backend.chip_lacks("npu_rms_norm", 0) is None


def test_the_registry_takes_the_reference_on_a_chip_without_the_operator(npu: torch.device) -> None:
    gate, up = torch.randn(3, 8).to(npu), torch.randn(3, 8).to(npu)
    with simulated_chip("Ascend910A"):
        calls = npu_fused_ops.calls["npu_swiglu"]
        with pytest.warns(RuntimeWarning, match=r"swiglu: npu cannot run on npu \(npu_swiglu does not run on "
                                                r"Ascend910A .* A2 only\); using the reference"):
            y = torchport.kernels.swiglu(gate, up)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # one warning, and no kernel failure: nothing is marked broken
            torchport.kernels.swiglu(gate, up)
        assert npu_fused_ops.calls["npu_swiglu"] == calls and not registry._broken
        torch.testing.assert_close(y.cpu(), swiglu_reference(gate.cpu(), up.cpu()))
        assert registry.select("rms_norm", npu).name == "npu"  # what the chip has stays fused
        with torchport.settings.override(kernels="swiglu=npu"):
            with pytest.raises(KernelError, match="forced implementation 'npu' cannot run on npu: npu_swiglu does "
                                                  "not run on Ascend910A"):
                torchport.kernels.swiglu(gate, up)
        from torchport import attention

        assert attention.best(npu) == "sdpa"  # npu_fusion_attention: A2 (and 950) only
    assert registry.select("swiglu", npu).name == "npu"  # back on the A2 default


def test_cpu_fallback_can_be_switched_off_as_in_torch_npu(npu: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.rand(4).to(npu)
    backend = get_backend("npu")
    with unsupported_ops({"aten::erfinv"}, torch_npu_fallback=True):
        assert device_op_support(backend, "aten::erfinv") == "host"
        monkeypatch.setenv("TORCH_NPU_FALLBACK_CPU_DISABLE", "1")
    with unsupported_ops({"aten::erfinv"}, torch_npu_fallback=True):
        assert device_op_support(backend, "aten::erfinv") == "missing"
        with pytest.raises(RuntimeError, match="'aten::erfinv.*' has no NPU kernel .* TORCH_NPU_FALLBACK_CPU_DISABLE"):
            x.erfinv()
        monkeypatch.setenv("TORCH_NPU_FALLBACK_CPU_DISABLE", "0")
    with unsupported_ops({"aten::erfinv"}, torch_npu_fallback=True):
        assert device_op_support(backend, "aten::erfinv") == "host"


# -- the environment variable, and the NPU tests on a second chip ----------------------------------------------------
def _run(*args: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TORCHPORT_")}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env={**clean, **env}, capture_output=True, text=True,
                          timeout=timeout, check=False)


def test_simulate_environment_variable_picks_the_chip() -> None:
    code = "import torch, torchport; print(torch.npu.get_device_name(), torch.npu.is_bf16_supported())"
    assert _run("-c", code, env={"TORCHPORT_SIMULATE": "npu:Ascend910A"}, timeout=120).stdout.split() == \
        ["Ascend910A", "False"]
    result = _run("-c", "import torchport; torchport.device()", env={"TORCHPORT_SIMULATE": "npu:Ascend9"}, timeout=120)
    assert result.returncode != 0 and "'Ascend9' is not an Ascend chip torchport knows; known: Ascend910A" in \
        result.stderr


# The kernels, low-bit and attention tests again, simulating an Ascend310P3: no bfloat16, no npu_swiglu,
# npu_cross_entropy_loss, npu_fusion_attention nor int4 packing, npu_rotary_mul for head_dim 128 only. They skip what
# the chip cannot do (by capability, not by name) and must pass the rest. About 25 s.
SECOND_CHIP_FILES = ["tests/kernels/test_rms_norm.py", "tests/kernels/test_rope.py", "tests/kernels/test_glu.py",
                     "tests/kernels/test_cross_entropy.py", "tests/kernels/test_lowbit_matmul.py",
                     "tests/quant/test_quantize.py", "tests/test_attention.py"]


@pytest.mark.usefixtures("npu")  # in the passes that test the (simulated) NPU
def test_npu_tests_pass_on_a_chip_without_bf16() -> None:
    result = _run("-m", "pytest", "-q", "-p", "no:cacheprovider", "--devices", "npu", *SECOND_CHIP_FILES,
                  env={"TORCHPORT_SIMULATE": "npu:Ascend310P3"}, timeout=600)
    tail = "\n".join(result.stdout.splitlines()[-25:])
    assert result.returncode == 0, tail
    assert " passed" in tail and " failed" not in tail
