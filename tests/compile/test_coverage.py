"""torchport.compile.coverage: the operators a model runs and how a device runs them, by dispatcher or snapshot."""

from __future__ import annotations

import importlib.metadata
import io
import json

import pytest
import torch

from torchport.backends import get_backend
from torchport.compile.op_support import device_op_support, op_support
from torchport.backends.npu import NpuBackend
from torchport.compat import cpu_fallback
from torchport.compile import op_coverage as coverage_module
from torchport.compile.op_coverage import STATUSES, coverage
from torchport.testing import unsupported_ops

transformers = pytest.importorskip("transformers")

DECLARED = ["aten::embedding_dense_backward", "aten::rsqrt"]  # one backward, one forward operator of a Llama
pytestmark = pytest.mark.filterwarnings("ignore:torchport. .* runs on the CPU instead of")


@pytest.fixture
def sim(npu: torch.device):
    if not hasattr(torch.npu, "_torchport_simulated"):
        pytest.skip("a real NPU is present; operators can be declared missing on the simulated one only")
    yield npu
    cpu_fallback(False, device="npu")


def _llama(attention: str = "eager") -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                      max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.config._attn_implementation = attention
    return model, {"input_ids": torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))}


def _rows(report) -> dict[tuple[str, str], object]:
    return {(row.op, row.phase): row for row in report.rows}


def test_op_support_answers_from_kernels_composites_and_out_variants() -> None:
    assert op_support("aten::add_.Tensor", lambda op: op == "aten::add.out") == "native"  # structured: out= variant
    assert op_support("aten::erfinv", lambda op: False) == "missing"
    assert op_support("aten::erfinv", lambda op: False, host_fallback=True) == "host"
    assert op_support("aten::linear", lambda op: False) == "native"  # composite: its parts are what count
    assert op_support("aten::erfinv", lambda op: None) is None
    assert device_op_support("cpu", "aten::erfinv") == "native"


def test_a_llama_on_the_simulated_npu_lists_exactly_the_declared_operators(sim) -> None:
    model, inputs = _llama()
    with unsupported_ops([*DECLARED, "aten::erfinv"]):  # erfinv: declared, but a Llama does not run it
        report = coverage(model, inputs, "npu")
        assert report.missing == DECLARED
        rows = _rows(report)
        assert rows[("aten::rsqrt", "forward")].status == "missing" and rows[("aten::rsqrt", "forward")].calls == 3
        assert rows[("aten::embedding_dense_backward", "backward")].status == "missing"
        assert rows[("aten::mm", "forward")].status == "native" and rows[("aten::mm", "backward")].calls > 0
        assert [row.status for row in report.rows] == sorted((row.status for row in report.rows), key=STATUSES.index)
        assert report.recorded_on == "cpu" and report.backward and "simulated" in report.source

        # on the device itself: the missing operators fail there, are recorded, and run on the CPU so the run goes on
        # (use_cache=False: transformers' cache makes torch.tensor(data, device="npu"), which fails under any
        # TorchDispatchMode on the simulated NPU, inside PyTorch's trampoline for Python-registered kernels)
        on_device = coverage(model.to(sim), {"input_ids": inputs["input_ids"].to(sim), "use_cache": False}, "npu")
        assert on_device.missing == DECLARED and on_device.recorded_on == "npu"
        assert {row.op for row in on_device.rows if row.phase == "backward"} >= {"aten::embedding_dense_backward"}

        cpu_fallback(device="npu")  # with the fallback, they run on the CPU and nothing is missing
        fallen = coverage(model, {"input_ids": inputs["input_ids"].to(sim), "use_cache": False}, "npu")
        assert fallen.missing == [] and fallen.ops("cpu fallback") == DECLARED
        assert _rows(fallen)[("aten::rsqrt", "forward")].note == "torchport.compat.cpu_fallback"
    assert model.lm_head.weight.grad is None  # coverage leaves no gradients behind


def test_the_device_librarys_own_fallback_is_a_cpu_fallback(sim) -> None:
    model, inputs = _llama()
    with unsupported_ops(["aten::rsqrt"], torch_npu_fallback=True):
        report = coverage(model, inputs, "npu", backward=False)
    row = _rows(report)[("aten::rsqrt", "forward")]
    assert row.status == "cpu fallback" and "runs it on the CPU itself" in row.note
    assert not report.backward and {row.phase for row in report.rows} == {"forward"}


def _only_torch_npu(version: str):
    """``importlib.metadata.version`` of an environment whose torch_npu package is ``version``."""
    real = importlib.metadata.version

    def answer(name: str) -> str:
        return version if name.replace("-", "_") == "torch_npu" else real(name)

    return answer


def test_without_torch_npu_the_snapshot_answers(monkeypatch) -> None:
    backend = NpuBackend()  # the real backend class; torch_npu is not loaded in this process
    if backend.has_kernel("aten::empty.memory_format") is not None:
        pytest.skip("torch_npu is loaded here: the dispatcher answers")
    monkeypatch.setattr(coverage_module, "get_backend", lambda name, source=None: backend)
    # torch_npu 2.6's list, which lacks the tensor shift (2.14 has it): a listed composite with an unlisted part
    monkeypatch.setattr(importlib.metadata, "version", _only_torch_npu("2.6.0.post5"))

    class Shifts(torch.nn.Module):
        def forward(self, q: torch.Tensor) -> torch.Tensor:  # attention (torch_npu has it whole), and a shift it lacks
            out = torch.nn.functional.scaled_dot_product_attention(q, q, q)
            return out * torch.bitwise_left_shift(torch.ones(1, dtype=torch.int64), 1)

    q = torch.randn(1, 2, 4, 8, requires_grad=True)
    report = coverage(Shifts(), q, "npu")
    assert report.source == "snapshot torch_npu_ops-2.6.txt (torch_npu 2.6.0.post5)"
    rows = _rows(report)
    attention = rows[("aten::scaled_dot_product_attention", "forward")]
    assert attention.status == "native" and attention.calls == 1 and "runs it whole" in attention.note
    assert ("aten::scaled_dot_product_attention", "backward") in rows  # its backward, not the CPU kernel's parts
    assert not any("_for_cpu" in op for op, _ in rows) and q.grad is None
    composite = rows[("aten::bitwise_left_shift.Tensor_Scalar", "forward")]  # PyTorch's kernel for a shift by 1
    assert composite.status == "native" and "its parts are listed too" in composite.note
    shift = rows[("aten::bitwise_left_shift.Tensor", "forward")]  # its part, which torch_npu lacks
    assert shift.status == "cpu fallback" and "runs it on the CPU itself" in shift.note


@torch.library.custom_op("torchport::_coverage_test_scale", mutates_args=())
def _scale(x: torch.Tensor) -> torch.Tensor:
    return x.erfinv() * 2  # what a torchport kernel runs inside is its own per-device business


@_scale.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class _UsesKernel(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.torchport._coverage_test_scale(x) + 1


@pytest.mark.parametrize("target", ["cpu", "npu"])
def test_a_torchport_kernel_is_one_row_without_what_it_runs_inside(target: str) -> None:
    report = coverage(_UsesKernel(), torch.zeros(2), target, backward=False)
    assert report.ops("torchport kernel") == ["torchport::_coverage_test_scale"]
    assert {row.op for row in report.rows} == {"torchport::_coverage_test_scale", "aten::add.Tensor"}


def test_json_and_table() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU())
    report = coverage(model, torch.randn(2, 4), "cpu")
    data = json.loads(report.to_json())
    assert data["device"] == "cpu" and data["summary"]["missing"] == 0 and data["backward"] is True
    assert {"op": "aten::gelu_backward", "phase": "backward", "calls": 1, "status": "native", "note": ""} in data["rows"]
    printed = io.StringIO()
    report.print(file=printed)
    assert "aten::addmm" in printed.getvalue() and "0 missing" in printed.getvalue()
    with pytest.raises(ValueError, match="status 'absent' is not one of missing, cpu fallback"):
        report.ops("absent")


@pytest.mark.parametrize(("spec", "message"), [
    ("gpu", "device='gpu' is not a device type; registered: npu, cuda"),
    ("npu:x", "is not a device"),
])
def test_bad_devices_are_refused(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        coverage(torch.nn.Linear(2, 2), torch.zeros(1, 2), spec)


def test_a_device_nothing_can_answer_for_is_refused(monkeypatch) -> None:
    cuda = get_backend("cuda")
    if cuda.has_kernel("aten::empty.memory_format") is not None:
        pytest.skip("this torch has CUDA kernels: the dispatcher answers")
    with pytest.raises(ValueError, match="cannot tell which operators cuda runs: its library is not loaded"):
        coverage(torch.nn.Linear(2, 2), torch.zeros(1, 2), "cuda")


@pytest.mark.parametrize("installed, expected", [
    ({"torch_npu": "2.6.0.post5"}, "torch_npu_ops-2.6.txt"),  # the installed torch_npu decides
    ({"torch_npu": "2.9.0"}, "torch_npu_ops-2.6.txt"),
    ({"torch_npu": "2.12.0.post2"}, "torch_npu_ops-2.14.txt"),
    ({"torch": "2.13.0+cpu"}, "torch_npu_ops-2.14.txt"),       # else the installed torch
    ({"torch": "2.7.1"}, "torch_npu_ops-2.6.txt"),
    ({"torch": "2.20.0"}, "torch_npu_ops-2.14.txt"),
])
def test_npu_operator_list_of_the_nearest_release(monkeypatch, installed, expected) -> None:
    from torchport.backends import npu as npu_backend

    def version(name: str) -> str:
        if name not in installed:
            raise importlib.metadata.PackageNotFoundError(name)
        return installed[name]

    monkeypatch.setattr(importlib.metadata, "version", version)
    monkeypatch.setattr(torch, "__version__", installed.get("torch", "2.13.0"))
    assert npu_backend.NpuBackend().op_snapshot == expected
