"""torchport.compat.cpu_fallback on the simulated NPU with operators declared missing, and the simulation's errors."""

from __future__ import annotations

import io
import warnings

import pytest
import torch

from torchport.compat import cpu_fallback
from torchport.compat.cpu_fallback import calls, count_host_fallbacks, explain_missing_op, registered
from torchport.compat.report import Recorder
from torchport.compile.op_support import device_op_support
from torchport.testing import unsupported_ops

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.filterwarnings("ignore:torchport. .* runs on the CPU instead of")

DECLARED = {"aten::rsqrt", "aten::embedding_dense_backward"}  # one forward, one backward operator of a Llama


@pytest.fixture
def sim(npu: torch.device):
    if not hasattr(torch.npu, "_torchport_simulated"):
        pytest.skip("a real NPU is present; operators can be declared missing on the simulated one only")
    yield npu
    cpu_fallback(False, device="npu")


def _calls(op: str) -> int:
    return sum(row["calls"] for row in calls() if row["op"] == op and row["device"] == "npu")


def _llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                      max_position_embeddings=32)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _loss_and_grads(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach().cpu(), [p.grad.detach().cpu() for p in model.parameters()]


def test_a_missing_operator_fails_as_the_dispatcher_fails_and_the_error_says_what_to_do(sim) -> None:
    x = torch.full((3,), 0.5, device=sim)
    with unsupported_ops({"aten::erfinv"}):
        assert device_op_support("npu", "aten::erfinv") == "missing"
        with pytest.raises(NotImplementedError, match=r"^Could not run 'aten::erfinv' with arguments from the "
                                                      r"'PrivateUse1' backend\.") as caught:
            x.erfinv()
    hint = explain_missing_op(caught.value)
    assert "aten::erfinv" in hint and "torchport.compat.cpu_fallback(ops=['aten::erfinv'])" in hint
    assert "torchport coverage TARGET --device npu" in hint
    assert torch.allclose(x.erfinv().cpu(), torch.full((3,), 0.5).erfinv())  # outside the block it runs again
    assert explain_missing_op(RuntimeError("Could not run 'aten::erfinv' ...")) is None
    no_cpu = explain_missing_op(NotImplementedError("Could not run 'aten::foo' with arguments from the 'CPU' backend"))
    assert "no CPU kernel either" in no_cpu and "cpu_fallback(" not in no_cpu


def test_torch_npu_fallback_mode_warns_like_torch_npu_and_runs(sim) -> None:
    x = torch.full((3,), 0.5, device=sim)
    with unsupported_ops(["aten::erfinv"], torch_npu_fallback=True):
        assert device_op_support("npu", "aten::erfinv") == "host"
        with pytest.warns(UserWarning, match="CAUTION: The operator 'aten::erfinv' is not currently supported on the "
                                             "NPU backend and will fall back to run on the CPU"):
            y = x.erfinv()
    assert torch.allclose(y.cpu(), torch.full((3,), 0.5).erfinv())


def test_a_llama_runs_with_the_fallback_and_matches_the_cpu(sim) -> None:
    model = _llama()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    expected_loss, expected_grads = _loss_and_grads(model, ids)
    model.to(sim)
    with unsupported_ops(DECLARED):
        with pytest.raises(NotImplementedError, match="Could not run 'aten::rsqrt'"):
            _loss_and_grads(model, ids.to(sim))
        before = {op: _calls(op) for op in DECLARED}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            taken = cpu_fallback(device="npu")  # every operator the device lacks
            loss, grads = _loss_and_grads(model, ids.to(sim))
            _loss_and_grads(model, ids.to(sim))
        assert {"aten::rsqrt", "aten::embedding_dense_backward"} <= set(taken) == registered("npu")
        assert all(op.partition(".")[0] in DECLARED for op in taken)
        torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)
        for grad, expected in zip(grads, expected_grads):
            torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-6)
        assert _calls("aten::rsqrt") - before["aten::rsqrt"] == 6  # 3 norms, 2 runs
        assert _calls("aten::embedding_dense_backward") - before["aten::embedding_dense_backward"] == 2
        fallback_warnings = [str(w.message) for w in caught if "torchport.compat.cpu_fallback" in str(w.message)]
        assert sorted(m.split()[1] for m in fallback_warnings) == sorted(DECLARED)  # once per operator
        assert cpu_fallback(False, device="npu") == [] and registered("npu") == frozenset()
        with pytest.raises(NotImplementedError, match="Could not run 'aten::rsqrt'"):
            _loss_and_grads(model, ids.to(sim))


def test_in_place_out_and_list_arguments_come_back_and_numbers_work(sim) -> None:
    half = torch.full((3,), 0.5)
    with unsupported_ops({"aten::erfinv", "aten::_amp_foreach_non_finite_check_and_unscale_"}):
        assert cpu_fallback(ops=["aten::erfinv", "aten::_amp_foreach_non_finite_check_and_unscale_"], device="npu")
        x = half.to(sim)
        assert x.erfinv_() is x and torch.allclose(x.cpu(), half.erfinv())
        out = torch.empty(1, device=sim)  # resized by the operator, on the device
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # PyTorch's own note that out= tensors get resized
            torch.erfinv(half.to(sim), out=out)
        assert out.shape == (3,) and torch.allclose(out.cpu(), half.erfinv())
        # GradScaler's unscale: a list of tensors and one more tensor written in place, nothing returned
        grads = [torch.tensor([2.0, float("inf")], device=sim), torch.tensor([4.0], device=sim)]
        found_inf = torch.zeros(1, device=sim)
        assert torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, torch.full((1,), 0.5, device=sim)) \
            is None
        assert grads[0].cpu().tolist() == [1.0, float("inf")] and grads[1].cpu().tolist() == [2.0]
        assert found_inf.cpu().tolist() == [1.0] and grads[1].device == sim and isinstance(grads[1], type(x))
    # a named operator the device has: its kernel is bypassed, and Python numbers in Tensor places are handled
    assert "aten::mul.Tensor" in cpu_fallback(ops=["aten::mul.Tensor"], device="npu")
    before = _calls("aten::mul.Tensor")
    y = torch.arange(3, device=sim) * 2.5  # an int tensor times a float: float32, as on any device
    assert y.dtype == torch.float32 and y.device == sim and y.cpu().tolist() == [0.0, 2.5, 5.0]
    assert _calls("aten::mul.Tensor") == before + 1


def test_counts_reach_the_report_and_the_log(sim, monkeypatch, caplog) -> None:
    monkeypatch.setenv("TORCHPORT_LOG", "fallback")
    with unsupported_ops({"aten::erfinv"}), caplog.at_level("INFO", logger="torchport.fallback"):
        cpu_fallback(ops=["aten::erfinv"], device="npu")
        x = torch.full((2,), 0.25, device=sim)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(4):
                x.erfinv()
    row = next(row for row in Recorder().to_dict()["cpu_fallback"] if row["op"] == "aten::erfinv")
    assert row["calls"] >= 4 and row["device"] == "npu" and "test_cpu_fallback.py:" in row["first_site"]
    logged = [r.getMessage() for r in caplog.records if r.name == "torchport.fallback"]
    assert any("2 operator(s) fall back to the CPU: aten::erfinv, aten::erfinv.out" in m for m in logged)
    assert any("aten::erfinv ran on the CPU instead of npu: call 4" in m for m in logged)
    printed = io.StringIO()
    Recorder().print("npu:0", file=printed)
    assert "operators run on the CPU" in printed.getvalue() and "aten::erfinv" in printed.getvalue()


def test_the_device_librarys_own_host_fallback_is_counted_with_its_call_site(sim) -> None:
    assert count_host_fallbacks("npu") == []  # nothing runs on the host by itself
    with unsupported_ops({"aten::erfinv"}, torch_npu_fallback=True):
        assert device_op_support("npu", "aten::erfinv") == "host"
        assert count_host_fallbacks("npu") == ["aten::erfinv", "aten::erfinv.out"]
        before = _calls("aten::erfinv")
        x = torch.full((3,), 0.5, device=sim)
        for _ in range(3):
            y = x.erfinv()  # the line the report names
        assert y.device == sim and round(y.cpu()[0].item(), 4) == 0.4769
    assert _calls("aten::erfinv") == before + 3
    row = next(row for row in calls() if row["op"] == "aten::erfinv" and row["device"] == "npu")
    assert "test_cpu_fallback.py:" in row["first_site"]
    printed = io.StringIO()
    Recorder().print("npu:0", file=printed)
    assert "operators run on the CPU instead of npu:0" in printed.getvalue()
    with unsupported_ops({"aten::erfinv"}, torch_npu_fallback=True):
        cpu_fallback(False, device="npu")
        assert count_host_fallbacks("cpu") == []  # the host itself has nothing to fall back from


@pytest.mark.parametrize(("ops", "message"), [
    (["aten::view"], "returns a view of its input"),
    (["aten::_to_copy"], "allocates or copies between devices"),
    (["aten::_scaled_dot_product_flash_attention"], "the CPU has no kernel for it either"),
    (["aten::erfinvv"], "has no operator aten::erfinvv"),
    (["aten.erfinv"], "is not an operator: write 'namespace::name'"),
    (["aten::add.Tensr"], "has no overload 'Tensr'"),
])
def test_bad_operators_are_refused_with_the_reason(sim, ops, message) -> None:
    with pytest.raises(ValueError, match=message):
        cpu_fallback(ops=ops, device="npu")
    assert registered("npu") == frozenset()


def test_nothing_falls_back_on_the_cpu() -> None:
    assert cpu_fallback(device="cpu") == [] and cpu_fallback(ops=["aten::erfinv"], device="cpu") == []
    assert registered("cpu") == frozenset()


def test_declaring_what_no_device_can_lack_is_refused(sim) -> None:
    for name, message in [("aten::linear", "PyTorch builds it from other operators"),
                          ("aten::transpose", "returns a view"), ("aten::copy_", "moves tensors with it"),
                          ("aten::nope", "has no operator aten::nope")]:
        with pytest.raises(ValueError, match=message):
            with unsupported_ops([name]):
                pass


FALLBACK_SCRIPT = """
import torch
import torchport.testing
from torchport.compat import cpu_fallback

with torchport.testing.unsupported_ops({"aten::erfinv"}):
    cpu_fallback()
    x = torch.full((3,), 0.5).cuda()
    for _ in range(2):
        y = x.erfinv()
    print(round(y.cpu()[0].item(), 4))
"""


def test_torchport_run_report_counts_the_fallback(tmp_path, torchport_run) -> None:
    (tmp_path / "uses_erfinv.py").write_text(FALLBACK_SCRIPT)
    result = torchport_run("--report", "uses_erfinv.py", cwd=tmp_path, env={"TORCHPORT_SIMULATE": "npu"})
    assert result.returncode == 0, result.stderr
    assert result.stdout == "0.4769\n"
    assert "operators run on the CPU" in result.stderr, result.stderr
    table = result.stderr[result.stderr.index("operators run on the CPU"):]
    row = next(line for line in table.splitlines() if "aten::erfinv" in line)
    assert row.split()[1:] == ["aten::erfinv", "│", "npu", "│", "2", "│", "uses_erfinv.py:10", "│"], table
