"""The ``torchport`` dynamo backend: found by name, same results as eager (forward and backward), options checked."""

from __future__ import annotations

import importlib.metadata
import warnings

import pytest
import torch
from torch import nn

import torchport
from torchport.compile import dynamo_backend


class Block(nn.Module):
    """A Llama-like block written in plain PyTorch: RMSNorm, SwiGLU MLP, residual."""

    def __init__(self, hidden: int = 24, inner: int = 40) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(hidden) + 0.5)
        self.gate = nn.Linear(hidden, inner, bias=False)
        self.up = nn.Linear(hidden, inner, bias=False)
        self.down = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        h = self.weight * h.to(x.dtype)
        return x + self.down(nn.functional.silu(self.gate(h)) * self.up(h))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_registered_as_entry_point_and_found_by_name() -> None:
    names = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="torch_dynamo_backends")}
    assert names.get("torchport") == "torchport.compile.dynamo_backend:torchport_backend"
    from torch._dynamo.backends.registry import lookup_backend

    assert lookup_backend("torchport") is dynamo_backend.torchport_backend
    assert torchport.compile.backend is dynamo_backend.torchport_backend


def _train_step(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    y = model(x)
    y.square().mean().backward()
    return y.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("compiler", ["auto", "eager"])
def test_training_matches_eager_on_every_device(device: torch.device, compiler: str) -> None:
    if compiler == "auto" and device.type == "cpu":
        pytest.importorskip("torch._inductor")
    torch.manual_seed(0)
    model = Block().to(device)
    x = torch.randn(3, 5, 24, device=device)
    expected, expected_grads = _train_step(model, x)
    compiled = torch.compile(model, backend="torchport", options={"compiler": compiler})
    got, grads = _train_step(compiled, x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    for g, e in zip(grads, expected_grads):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)


def test_inference_under_no_grad(device: torch.device) -> None:
    torch.manual_seed(0)
    model = Block().to(device).eval()
    x = torch.randn(2, 7, 24, device=device)
    with torch.no_grad():
        expected = model(x)
        got = torch.compile(model, backend="torchport", options={"compiler": "eager"})(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_auto_compiler_is_asked_of_the_device_backend(device: torch.device) -> None:
    name, compiler = torchport.backends.get_backend(device.type).dynamo_compiler()
    expected = {"cpu": "inductor", "cuda": "inductor", "npu": "eager"}[device.type]  # the simulated npu has no TorchAir
    assert name == expected and (compiler is None) == (name == "eager")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"bogus": 1}, r"unknown torchport compile option\(s\) bogus; valid options: compiler:"),
        ({"passes": {"no_such_pass": False}}, r"unknown compile pass\(es\) no_such_pass; registered:"),
        ({"passes": {"dead_code": "no"}}, r"must be a dict of pass name -> True/False"),
        ({"compiler": "no_such_compiler"}, r"compiler='no_such_compiler' is not a dynamo backend; registered: auto,"),
        ({"compiler": "torchport"}, r"would hand the graph back to this backend"),
        ({"fallback": "yes"}, r"fallback='yes' must be True or False"),
    ],
)
def test_bad_options_name_what_is_valid(options: dict, message: str) -> None:
    model = Block()
    with pytest.raises(Exception, match=message):
        torch.compile(model, backend="torchport", options=options)(torch.randn(2, 24))


def _failing_compiler(gm: torch.fx.GraphModule, example_inputs: list) -> None:
    raise RuntimeError("this compiler cannot handle the graph")


def test_a_failing_compiler_falls_back_to_eager_or_raises_when_strict(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch._dynamo.backends.registry import _BACKENDS, _COMPILER_FNS, register_backend

    if "torchport_test_failing" not in _COMPILER_FNS:
        register_backend(_failing_compiler, name="torchport_test_failing")
    try:
        model = Block()
        x = torch.randn(2, 24)
        with pytest.warns(RuntimeWarning, match="torchport_test_failing failed on a graph.*running that graph eagerly"):
            got = torch.compile(model, backend="torchport", options={"compiler": "torchport_test_failing"})(x)
        torch.testing.assert_close(got, model(x))
        torch._dynamo.reset()
        with pytest.raises(Exception, match="this compiler cannot handle the graph"):
            torch.compile(model, backend="torchport",
                          options={"compiler": "torchport_test_failing", "fallback": False})(x)
        torch._dynamo.reset()
        monkeypatch.setenv("TORCHPORT_STRICT", "1")
        with pytest.raises(Exception, match="this compiler cannot handle the graph"):
            torch.compile(model, backend="torchport", options={"compiler": "torchport_test_failing"})(x)
    finally:
        _COMPILER_FNS.pop("torchport_test_failing", None)
        _BACKENDS.pop("torchport_test_failing", None)


def test_explain_reports_each_graph_and_runs_nothing_compiled() -> None:
    model = Block()
    x = torch.randn(2, 24)
    with torch.no_grad():
        report = torchport.compile.explain(model, x)
    assert len(report.graphs) == 1
    graph = report.graphs[0]
    assert graph.device == "cpu" and graph.training is False and graph.compiler == "inductor"
    assert graph.nodes_before > 0 and graph.nodes_after <= graph.nodes_before
    text = str(report)
    assert text.startswith("graph 0 (cpu, inference, compiler inductor):")
    assert '"graphs"' in report.to_json()
    with torch.enable_grad():
        assert torchport.compile.explain(model, x).graphs[0].training is True


def test_compile_log_lines(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TORCHPORT_LOG", "compile")
    model = Block()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.compile(model, backend="torchport", options={"compiler": "eager"})(torch.randn(2, 24))
    err = capsys.readouterr().err
    assert "[torchport.compile] graph of" in err and "compiled with eager" in err


def test_kernel_fusions_are_left_to_inductor_unless_asked() -> None:
    model = Block()
    x = torch.randn(2, 5, 24)
    with torch.no_grad():
        before_inductor = torchport.compile.explain(model, x, options={"compiler": "inductor"}).graphs[0]
        before_eager = torchport.compile.explain(model, x, options={"compiler": "eager"}).graphs[0]
        asked = torchport.compile.explain(
            model, x, options={"compiler": "inductor", "passes": {"rms_norm": True, "swiglu": True}}).graphs[0]
    ran = lambda graph: {r.name for r in graph.passes}  # noqa: E731
    fusions = {p.name for p in torchport.compile.passes.list_passes() if p.fusion}
    assert fusions == {"rms_norm", "swiglu", "geglu", "rope", "cross_entropy"}
    assert not ran(before_inductor) & fusions
    assert {"rms_norm", "swiglu"} <= ran(before_eager)
    assert any("torchport::rms_norm" in line for line in before_eager.changes())
    assert {"rms_norm", "swiglu"} <= ran(asked) and "rope" not in ran(asked)
    assert any("torchport::swiglu" in line for line in asked.changes())
