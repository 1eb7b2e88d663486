from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
import torch

import torchport
from torchport.cli.main import main
from torchport.kernels import KernelError, registry
from torchport.kernels.rms_norm import rms_norm_reference
from torchport.testing import npu_fused_ops


@pytest.fixture
def fresh_registry():
    registry.refresh()
    yield registry
    registry.refresh()


@pytest.fixture
def failing_triton(monkeypatch, fresh_registry):
    """rms_norm's triton implementation replaced by one that serves the cpu and fails as a compile error would."""
    calls = []

    class CompilationError(Exception):
        pass

    def broken(*args):
        calls.append(args)
        raise CompilationError("ptxas: out of registers (forced failure)")

    impls = registry._implementations("rms_norm")
    monkeypatch.setitem(impls, "triton", dataclasses.replace(impls["triton"], fn=broken, devices=frozenset({"cpu"})))
    return calls


def test_auto_mode_warns_once_and_still_answers_right(failing_triton):
    x, w = torch.randn(3, 16), torch.randn(16)
    with pytest.warns(RuntimeWarning, match=r"rms_norm: triton cannot run on cpu \(CompilationError: ptxas"):
        y = torchport.kernels.rms_norm(x, w)
    torch.testing.assert_close(y, rms_norm_reference(x, w, 1e-6))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y2 = torchport.kernels.rms_norm(x, w)  # no second warning, and the broken kernel is not retried
    torch.testing.assert_close(y2, y)
    assert len(failing_triton) == 1


def test_forced_mode_raises_with_the_reason(failing_triton):
    with torchport.settings.override(kernels="rms_norm=triton"):
        with pytest.raises(KernelError, match=r"rms_norm: the forced implementation 'triton' failed on cpu: .*ptxas"):
            torchport.kernels.rms_norm(torch.randn(3, 16), torch.randn(16))


def test_unsupported_arguments_fall_back_each_time_without_being_marked_broken(monkeypatch, fresh_registry):
    def picky(x, w, eps, offset, in_place):
        if x.shape[-1] % 8:
            raise registry.Unsupported("hidden size must be a multiple of 8")
        return rms_norm_reference(x, w, eps, offset) + 1  # recognisable

    impls = registry._implementations("rms_norm")
    monkeypatch.setitem(impls, "triton", dataclasses.replace(impls["triton"], fn=picky, devices=frozenset({"cpu"})))
    with pytest.warns(RuntimeWarning, match="multiple of 8"):
        torchport.kernels.rms_norm(torch.randn(2, 7), torch.ones(7))
    x = torch.randn(2, 8)
    torch.testing.assert_close(torchport.kernels.rms_norm(x, torch.ones(8)), rms_norm_reference(x, torch.ones(8), 1e-6) + 1)


def test_input_errors_reach_the_caller_without_a_fallback(monkeypatch, fresh_registry):
    """An implementation that finds the caller's data bad (InputError, a ValueError) is not broken: the error reaches
    the caller as it is, nothing warns, nothing falls back, and the implementation stays chosen."""
    def checking(x, w, eps, offset, in_place):
        if (x < 0).any():
            raise registry.InputError("rms_norm: negative input, allowed: x >= 0")
        return rms_norm_reference(x, w, eps, offset) + 1  # recognisable

    impls = registry._implementations("rms_norm")
    monkeypatch.setitem(impls, "triton", dataclasses.replace(impls["triton"], fn=checking, devices=frozenset({"cpu"})))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="negative input, allowed: x >= 0"):
            torchport.kernels.rms_norm(-torch.ones(2, 8), torch.ones(8))
        x = torch.rand(2, 8)
        torch.testing.assert_close(torchport.kernels.rms_norm(x, torch.ones(8)),
                                   rms_norm_reference(x, torch.ones(8), 1e-6) + 1)
    assert registry.select("rms_norm", x.device).name == "triton"


def test_forced_choices_name_what_exists(device):
    x, w = torch.randn(2, 8, device=device), torch.ones(8, device=device)
    with torchport.settings.override(kernels="triton"):
        if device.type != "cuda":
            with pytest.raises(KernelError, match=rf"'triton' for 'rms_norm', which does not run on {device.type} "
                                                  r"tensors; implementations: .*triton \(cuda\)"):
                torchport.kernels.rms_norm(x, w)
    with torchport.settings.override(kernels="layer_norm=npu"):
        with pytest.raises(KernelError, match=r"no such implementation; it has: reference \(every device\), triton"):
            torchport.kernels.layer_norm(x, w, None)
    with torchport.settings.override(kernels="rms_norm=reference,rmsnorm=triton"):
        with pytest.raises(ValueError, match=r"unknown kernel\(s\) rmsnorm; registered: .*geglu, layer_norm, lowbit_matmul, rms_norm, rope"):
            torchport.kernels.rms_norm(x, w)
    with torchport.settings.override(kernels="reference"):
        assert registry.select("rms_norm", x.device).name == "reference"


def test_registration_rules():
    with pytest.raises(ValueError, match=r"'rms_norm' already has an implementation named 'triton'"):
        registry.register_kernel("rms_norm", "triton", devices=["cuda"])(lambda *a: None)
    with pytest.raises(ValueError, match="must serve every device"):
        registry.register_kernel("new_op", "reference", devices=["cpu"])
    assert registry.list_kernels()["rms_norm"] == ["triton", "npu", "reference"]
    with pytest.raises(ValueError, match=r"unknown kernel 'rmsnorm'; registered: .*rms_norm"):
        registry.implementation("rmsnorm", "triton")


def test_npu_uses_torch_npu_fused_operators(npu, fresh_registry):
    x, w = torch.randn(2, 5, 32, device=npu), torch.randn(32, device=npu)
    q, k = torch.randn(1, 2, 5, 8, device=npu), torch.randn(1, 1, 5, 8, device=npu)
    angles = torch.randn(1, 5, 8)
    cos, sin = angles.cos().to(npu), angles.sin().to(npu)  # torch_npu takes them within [-1, 1]
    before = dict(npu_fused_ops.calls)
    torchport.kernels.rms_norm(x, w)
    torchport.kernels.rope(q, k, cos, sin)
    torchport.kernels.swiglu(x, x)
    used = {name: npu_fused_ops.calls[name] - before.get(name, 0) for name in ("npu_rms_norm", "npu_rotary_mul",
                                                                                "npu_swiglu")}
    assert used == {"npu_rms_norm": 1, "npu_rotary_mul": 2, "npu_swiglu": 1}
    rows = {(r["op"], r["device"]): r["implementation"] for r in torchport.kernels.table([npu])}
    assert rows[("rms_norm", "npu:0")] == "npu" and rows[("layer_norm", "npu:0")] == "reference"


def test_npu_without_a_fused_operator_falls_back(npu, fresh_registry):
    x, w = torch.randn(2, 32, device=npu), torch.randn(32, device=npu)
    with npu_fused_ops.only(["npu_swiglu"]):
        registry.refresh()
        with pytest.warns(RuntimeWarning, match="npu software stack has no fused operator npu_rms_norm"):
            y = torchport.kernels.rms_norm(x, w)
        torch.testing.assert_close(y.cpu(), rms_norm_reference(x.cpu(), w.cpu(), 1e-6))
        with torchport.settings.override(kernels="npu"):
            with pytest.raises(KernelError, match="forced implementation 'npu' cannot run on npu: .*npu_rms_norm"):
                torchport.kernels.rms_norm(x, w)
        row = [r for r in torchport.kernels.table([npu]) if r["op"] == "rms_norm"][0]
        assert row["implementation"] == "reference" and "npu_rms_norm" in row["notes"][0]


def test_kernels_command(capsys):
    assert main(["kernels", "--json", "--device", "cpu"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["op"] for r in rows} >= {"rms_norm", "layer_norm", "rope", "swiglu", "geglu"}
    chosen = {r["op"]: r["implementation"] for r in rows if r["device"] == "cpu"}
    assert all(chosen[op] == "reference" for op in ("rms_norm", "layer_norm", "rope", "swiglu", "geglu"))
    assert main(["kernels"]) == 0
    assert "rms_norm" in capsys.readouterr().out
    assert main(["kernels", "--device", "gpu"]) == 2
    assert "--device='gpu' is not a device type" in capsys.readouterr().err


def test_every_registered_implementation_can_be_forced() -> None:
    assert {"auto", "reference", "triton", "npu", "chunked"} <= set(registry.kernel_modes())
    h, w = torch.randn(5, 8), torch.randn(11, 8)
    target = torch.randint(0, 11, (5,))
    with torchport.settings.override(kernels="fused_linear_cross_entropy=chunked"):
        assert registry.select("fused_linear_cross_entropy", torch.device("cpu")).name == "chunked"
        loss = torchport.kernels.fused_linear_cross_entropy(h, w, target)
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(h @ w.T, target))
    with pytest.raises(ValueError, match=r"'fast' is not a kernel mode; valid modes: auto, chunked, npu, reference"):
        with torchport.settings.override(kernels="fast"):
            pass


def test_the_choice_is_kept_until_the_setting_or_the_registry_changes(monkeypatch, fresh_registry):
    """A kernel call looks its implementation up (no settings parse, no probes); a new TORCHPORT_KERNELS value, an
    override, a registration or refresh() makes the next call choose again."""
    chosen = []
    choose = registry._select
    monkeypatch.setattr(registry, "_select", lambda *args: chosen.append(args[:2]) or choose(*args))
    cpu = torch.device("cpu")
    x, w = torch.randn(2, 8), torch.ones(8)
    for _ in range(3):
        torchport.kernels.rms_norm(x, w)
    assert chosen == [("rms_norm", cpu)] and not registry.forced("rms_norm")
    with torchport.settings.override(kernels="rms_norm=reference"):
        assert registry.forced("rms_norm")
        torchport.kernels.rms_norm(x, w)
        torchport.kernels.rms_norm(x, w)
    assert len(chosen) == 2
    torchport.kernels.rms_norm(x, w)  # back to the environment's value: chosen before
    assert len(chosen) == 2 and not registry.forced("rms_norm")
    monkeypatch.setenv("TORCHPORT_KERNELS", "reference")
    torchport.kernels.rms_norm(x, w)
    assert len(chosen) == 3 and registry.forced("rms_norm")
    monkeypatch.setenv("TORCHPORT_KERNELS", "triton")
    with pytest.raises(KernelError, match="'triton' for 'rms_norm', which does not run on cpu"):
        torchport.kernels.rms_norm(x, w)  # a refusal is never kept: it is raised again
    with pytest.raises(KernelError, match="does not run on cpu"):
        torchport.kernels.rms_norm(x, w)
    monkeypatch.delenv("TORCHPORT_KERNELS")
    registry.refresh()
    torchport.kernels.rms_norm(x, w)
    assert chosen[-1] == ("rms_norm", cpu) and len(chosen) == 6
    registry.register_kernel("rms_norm", "probe_impl", devices=["cpu"], priority=99)(rms_norm_reference)
    try:
        assert registry.select("rms_norm", cpu).name == "probe_impl"  # a registration is seen at once
    finally:
        with registry._lock:
            del registry._ops["rms_norm"]["probe_impl"]
            registry._forget_choices()


def test_host_bound_means_small_accelerator_inputs_in_auto_mode(monkeypatch):
    small, big = torch.empty(16, 8192, device="meta"), torch.empty(17, 8192, device="meta")
    assert registry.host_bound("rms_norm", small) and registry.host_bound("layer_norm", small)
    assert not registry.host_bound("rms_norm", big)
    # the CPU runs the Triton kernels only under Triton's interpreter, whose calls are the kernels under test
    assert not registry.host_bound("rms_norm", torch.empty(4, 64))
    monkeypatch.setenv("TORCHPORT_KERNELS", "rms_norm=triton")
    assert not registry.host_bound("rms_norm", small) and registry.host_bound("layer_norm", small)
    # under autocast PyTorch's operators follow its casting policy, which the Triton kernels do not: no switch
    monkeypatch.setattr(torch, "is_autocast_enabled", lambda device_type: device_type == "meta")
    assert not registry.host_bound("layer_norm", small)
    monkeypatch.undo()
    assert registry.host_bound("swiglu", small) and registry.host_bound("rms_norm", small)
    # while a stream captures a graph, its replays cost the host nothing per kernel: device time decides
    monkeypatch.setattr(registry, "capturing", lambda device: device.type == "meta")
    assert not registry.host_bound("swiglu", small) and not registry.host_bound("rms_norm", small)
