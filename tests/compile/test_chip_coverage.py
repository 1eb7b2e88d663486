"""torchport.compile.chip_coverage: what an Ascend chip runs of torchport, planned from the snapshots on any machine,
and the same answer as the kernel registry gives on the simulated chip."""

from __future__ import annotations

import io

import pytest
import torch

import torchport
from torchport.backends import get_backend
from torchport.backends.npu import npu_chip_profiles, torch_npu_contract
from torchport.compile import chip_coverage as chip_module
from torchport.compile.chip_coverage import chip_coverage, chip_report, resolve_chip, vendor_operator
from torchport.compile.op_coverage import coverage
from torchport.kernels import registry
from torchport.testing import simulated_chip

FUSED_KERNELS = {"rms_norm": "npu_rms_norm", "rope": "npu_rotary_mul", "swiglu": "npu_swiglu",
                 "cross_entropy": "npu_cross_entropy_loss", "lowbit_matmul": "npu_weight_quant_batchmatmul"}


def _rows(report) -> dict[str, object]:
    return {row.kernel: row for row in report.kernels}


def test_an_a2_chip_runs_every_fused_kernel_in_every_dtype() -> None:
    report = chip_coverage("Ascend910B3")
    rows = _rows(report)
    for kernel, operator in FUSED_KERNELS.items():
        assert rows[kernel].fused and rows[kernel].operator == operator and rows[kernel].implementation == "npu"
    assert rows["rms_norm"].dtypes == ("float32", "float16", "bfloat16") and rows["rms_norm"].reference_when == ()
    assert rows["lowbit_matmul"].dtypes == ("float16", "bfloat16")  # the activations torch_npu takes
    assert any("multiple of 32" in limit for limit in rows["lowbit_matmul"].reference_when)
    assert any("[1, 65535]" in limit for limit in rows["lowbit_matmul"].reference_when)
    assert "label_smoothing when the logits require grad" in rows["cross_entropy"].reference_when
    assert any("[-1, 1]" in limit for limit in rows["rope"].reference_when)
    assert not any("compiled kernel" in limit for limit in rows["rope"].reference_when)  # A1/310P only
    attention = rows["attention"]
    assert attention.fused and attention.implementation == "npu_fusion_attention"
    assert "key and value of different shapes (MLA)" in attention.reference_when
    assert any("more than 256 query heads" in limit for limit in attention.reference_when)
    # kernels without a vendor operator on Ascend: PyTorch operators
    assert (rows["geglu"].implementation, rows["geglu"].operator, rows["geglu"].fused) == ("reference", None, False)
    assert (rows["fused_linear_cross_entropy"].implementation, rows["fused_linear_cross_entropy"].operator) == \
        ("npu", None)
    assert report.lacks_dtypes == [] and report.dtypes() == {"float32": True, "float16": True, "bfloat16": True}
    assert all(report.operators[op] for op in FUSED_KERNELS.values())
    assert report.operators["npu_convert_weight_to_int4pack"] and report.operators["npu_fusion_attention"]


def test_the_310p3_runs_norms_rope_and_int8_and_no_bfloat16() -> None:
    report = chip_coverage("ascend310p3")  # any case
    rows = _rows(report)
    assert report.chip.soc_version == "Ascend310P3" and report.lacks_dtypes == [torch.bfloat16]
    assert "no bfloat16" in report.dtype_note() and "7.0" in report.dtype_note()
    for kernel in ("rms_norm", "rope", "lowbit_matmul"):
        assert rows[kernel].fused, kernel
    for kernel in ("swiglu", "cross_entropy"):
        row = rows[kernel]
        assert (row.implementation, row.operator, row.fused) == ("reference", FUSED_KERNELS[kernel], False)
        assert row.note.startswith("not on 310P: torch_npu documents") and row.dtypes == ("float32", "float16")
    assert "npu_swiglu for A2 only" in rows["swiglu"].note
    assert rows["lowbit_matmul"].dtypes == ("float16",)
    assert any(limit.startswith("int4 weights (not on 310P") for limit in rows["lowbit_matmul"].reference_when)
    assert rows["rms_norm"].dtypes == ("float32", "float16")
    assert rows["rms_norm"].reference_when == ("rows of fewer than 32 bytes (hidden size x element size)",)
    assert any("head_dim other than 128" in limit for limit in rows["rope"].reference_when)
    assert (rows["attention"].implementation, rows["attention"].fused) == ("sdpa", False)
    assert not report.operators["npu_swiglu"] and not report.operators["npu_convert_weight_to_int4pack"]


def test_the_910a_has_norms_and_rope_only() -> None:
    rows = _rows(chip_coverage("Ascend910A"))
    assert [kernel for kernel, row in rows.items() if row.fused] == ["rms_norm", "rope"]
    assert (rows["lowbit_matmul"].implementation, rows["lowbit_matmul"].fused) == ("reference", False)
    assert "npu_weight_quant_batchmatmul for A2, A3, 310P only" in rows["lowbit_matmul"].note
    assert rows["rope"].dtypes == ("float32", "float16")


def test_every_vendor_operator_a_kernel_calls_is_described() -> None:
    for kernel, names in registry.list_kernels().items():
        for name in names:
            operator = vendor_operator(registry.implementation(kernel, name))
            if operator is not None:
                assert operator in torch_npu_contract() and operator in chip_module._REFERENCE_WHEN, operator
    called = {vendor_operator(registry.implementation(k, n)) for k, names in registry.list_kernels().items()
              for n in names} - {None}
    assert called == set(FUSED_KERNELS.values())


def test_every_known_chip_has_a_report() -> None:
    for soc, chip in npu_chip_profiles().items():
        report = chip_coverage(soc)
        assert {row.kernel for row in report.kernels} == {*registry.list_kernels(), "attention"}
        assert all(set(row.dtypes) <= {str(d).removeprefix("torch.") for d in chip.dtypes} for row in report.kernels)
        assert report.to_dict()["soc"] == soc


@pytest.fixture
def sim(npu: torch.device) -> torch.device:
    if not torchport.testing.is_simulating():
        pytest.skip("changes the simulated chip; this NPU is a real one")
    return npu


@pytest.mark.parametrize("soc", ["Ascend910B3", "Ascend310P3", "Ascend910A"])
def test_the_plan_is_what_the_registry_picks_on_the_simulated_chip(sim: torch.device, soc: str) -> None:
    with simulated_chip(soc):
        planned = chip_coverage(soc)
        assert planned.device == "npu:0 (simulated)"
        for row in planned.kernels:
            if row.kernel == "attention":
                assert get_backend("npu").attention_implementation(0) == row.implementation
            else:
                assert registry.select(row.kernel, sim, quiet=True).name == row.implementation, row.kernel
        assert chip_coverage().chip.soc_version == soc  # the chip present is the default
        assert resolve_chip("npu", None).soc_version == soc


def test_a_chip_must_be_known_and_on_an_npu() -> None:
    with pytest.raises(ValueError, match=r"'Ascend999' is not an Ascend chip torchport knows; known: Ascend910A.*"
                                         r"Ascend310P3"):
        chip_coverage("Ascend999")
    with pytest.raises(ValueError, match=r"--soc names an Ascend chip, which only --device npu has; 'cpu' has none"):
        resolve_chip("cpu", "Ascend310P3")
    with pytest.raises(ValueError, match="TARGET is required with --device cpu"):
        chip_report("cpu")
    assert resolve_chip("cpu", None) is None
    with pytest.raises(ValueError, match="is not an Ascend chip"):
        coverage(torch.nn.Linear(2, 2), torch.zeros(1, 2), "npu", soc="Ascend999")
    with pytest.raises(ValueError, match="only --device npu has"):
        coverage(torch.nn.Linear(2, 2), torch.zeros(1, 2), "cpu", soc="Ascend910B3")


def test_planning_works_without_an_npu(monkeypatch) -> None:
    backend = get_backend("npu")
    monkeypatch.setattr(type(backend), "is_available", lambda self: False)
    report = chip_coverage("Ascend310P3")
    assert report.device is None
    with pytest.raises(ValueError, match=r"no Ascend NPU here to report on: name a chip \(--soc\); known: Ascend910A"):
        chip_coverage()


class _Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.Parameter(torch.ones(16))
        self.up = torch.nn.Linear(16, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torchport.kernels.library  # noqa: F401 - registers torch.ops.torchport

        h = torch.ops.torchport.rms_norm(x, self.norm, 1e-6, 0.0)
        gate, up = self.up(h).chunk(2, dim=-1)
        return torch.ops.torchport.swiglu(gate, up)


def _mlp(dtype: torch.dtype) -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return _Mlp().to(dtype), torch.randn(3, 16, dtype=dtype)


def test_a_model_on_a_chip_says_what_its_kernels_run_and_what_its_dtype_breaks() -> None:
    model, x = _mlp(torch.float32)
    report = coverage(model, x, "npu", soc="Ascend310P3")
    notes = {(row.op, row.phase): row.note for row in report.rows}
    assert notes[("torchport::rms_norm", "forward")] == "torch_npu.npu_rms_norm on Ascend310P3"
    assert notes[("torchport::swiglu", "forward")] == "reference (no npu_swiglu on 310P) on Ascend310P3"
    assert notes[("torchport::swiglu_backward", "backward")].startswith("backward through reference")
    assert report.missing == [] and report.dtypes == ["float32"] and report.chip.chip.soc_version == "Ascend310P3"
    assert report.to_dict()["chip"]["soc"] == "Ascend310P3"

    model, x = _mlp(torch.bfloat16)
    on_310p = coverage(model, x, "npu", soc="Ascend310P3", backward=False)
    assert "bfloat16" in on_310p.dtypes and "torchport::rms_norm" in on_310p.missing
    assert "aten::addmm" in on_310p.missing  # the linear layer computes in bfloat16
    row = next(row for row in on_310p.rows if row.op == "aten::addmm")
    assert row.status == "missing" and row.note == "computes in bfloat16, which Ascend310P3 lacks"
    assert not any(row.op == "aten::_to_copy" and row.status == "missing" for row in on_310p.rows)  # casts work
    on_a2 = coverage(model, x, "npu", soc="Ascend910B3", backward=False)
    assert on_a2.missing == []
    printed = io.StringIO()
    on_310p.print(file=printed)
    assert "computes in bfloat16" in printed.getvalue() and "torchport kernels on Ascend310P3" in printed.getvalue()


def test_without_a_chip_the_report_is_the_operators_alone() -> None:
    model, x = _mlp(torch.float32)
    report = coverage(model, x, "cpu", backward=False)
    assert report.chip is None and report.to_dict()["chip"] is None
    assert {row.note for row in report.rows if row.op.startswith("torchport::")} == {""}
