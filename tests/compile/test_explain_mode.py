"""``explain`` calls a graph a training graph exactly when it will be differentiated (grad mode on as it compiles and
some input or parameter requiring grad), whatever the model's train/eval mode, and says why."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch import nn

import torchport
from torchport.compile import dynamo_backend


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _conv_bn() -> nn.Module:
    """Conv + batch norm with trained-looking statistics; the activation is over 8x the weight, so the conv_bn pass
    folds it whenever it is allowed to."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    with torch.no_grad():
        bn = model[1]
        bn.running_mean.uniform_(-0.5, 0.5), bn.running_var.uniform_(0.5, 2.0)
        bn.weight.uniform_(0.5, 1.5), bn.bias.uniform_(-0.5, 0.5)
    return model


X = torch.randn(2, 3, 16, 16)


def _folded(graph: dynamo_backend.GraphReport) -> bool:
    return any(record.name == "conv_bn" and record.changed for record in graph.passes)


@pytest.mark.parametrize("no_grad", [torch.no_grad, torch.inference_mode], ids=["no_grad", "inference_mode"])
def test_eval_model_without_grad_mode_is_inference(no_grad):
    with no_grad():
        report = torchport.compile.explain(_conv_bn().eval(), X)
    graph = report.graphs[0]
    assert graph.training is False and graph.mode == "inference"
    assert "grad mode is off" in graph.why
    assert report.model_mode == "eval"
    assert "  inference: grad mode is off" in str(report) and "the model is in eval mode" in str(report)
    assert _folded(graph)  # the inference-only pass ran


def test_eval_model_with_grad_on_is_a_training_graph_and_says_why():
    """Dynamo lifts the parameters into inputs that require grad in eval mode too; with grad on, AOTAutograd builds
    a backward through them, so folding the batch norm into constants would lose their gradients."""
    model = _conv_bn().eval()
    report = torchport.compile.explain(model, X)
    graph = report.graphs[0]
    assert graph.training is True
    assert graph.why == "grad mode is on and 4 parameters require grad, so a backward is built"
    text = str(report)
    assert "  training: grad mode is on and 4 parameters require grad" in text
    assert "the model is in eval mode: explain it under torch.no_grad()" in text
    assert not _folded(graph)
    # ... and it is differentiated: the compiled eval model gives every parameter the gradient eager mode gives
    reference = _conv_bn().eval()
    reference(X).square().sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = torch.compile(model, backend="torchport", options={"compiler": "eager"})
        compiled(X).square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_frozen_model_is_inference_unless_an_input_requires_grad():
    model = _conv_bn().eval().requires_grad_(False)
    graph = torchport.compile.explain(model, X).graphs[0]
    assert graph.training is False and "no input or parameter requires grad" in graph.why
    assert _folded(graph)
    graph = torchport.compile.explain(model, X.clone().requires_grad_()).graphs[0]
    assert graph.training is True and graph.why == "grad mode is on and 1 input requires grad, so a backward is built"


def test_training_model_under_no_grad_is_inference():
    with torch.no_grad():
        report = torchport.compile.explain(_conv_bn().train(), X)
    assert report.graphs[0].training is False and report.model_mode == "training"
    assert "the model is in training mode" in str(report)
    assert "explain it under" not in str(report)


def test_mixed_modes_and_plain_functions():
    model = _conv_bn().train()
    model[1].eval()  # a frozen batch norm in a training model
    report = torchport.compile.explain(model, X)
    assert report.graphs[0].training is True and report.model_mode == "mixed"
    assert "modules in training mode and in eval mode" in str(report)
    with torch.no_grad():
        report = torchport.compile.explain(lambda x: torch.relu(x) * 2, X)
    assert report.model_mode is None and report.graphs[0].training is False
    assert str(report).splitlines()[1] == "  inference: " + report.graphs[0].why


def test_json_carries_the_reason():
    with torch.no_grad():
        data = json.loads(torchport.compile.explain(_conv_bn().eval(), X).to_json())
    assert data["model_mode"] == "eval"
    assert data["graphs"][0]["training"] is False and "grad mode is off" in data["graphs"][0]["why"]


def test_parameters_held_by_the_graph_module_count():
    """A graph traced without dynamo keeps its parameters as attributes, not inputs: they are differentiated too."""
    gm = torch.fx.symbolic_trace(nn.Linear(4, 3))
    x = torch.randn(2, 4)
    options = dynamo_backend._options({"compiler": "eager"})
    _, report = dynamo_backend._prepare(gm, [x], options, 0)
    assert report.training is True
    assert report.why == "grad mode is on and 2 parameters require grad, so a backward is built"
    with torch.no_grad():
        _, report = dynamo_backend._prepare(gm, [x], options, 0)
    assert report.training is False
