"""The generic FX passes: dead code, constant folding, conv + batch norm, addmm, channels-last.

Each pass is checked on graphs where its pattern occurs (the rewrite happens, the values stay) and on graphs where
it must not act. Graphs come from dynamo (a recording backend: parameters and buffers are placeholders) or from
``torch.fx`` tracing (parameters, and buffers with ``proxy_buffer_attributes``, are get_attr nodes).
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.fx
import torch.nn.functional as F
from torch import nn
from torch.fx.passes.shape_prop import ShapeProp

from torchport.backends import get_backend
from torchport.compile import passes
from torchport.compile.passes import addmm, channels_last, constant_fold, conv_bn, dead_code

CPU = passes.PassContext(torch.device("cpu"), training=False)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def capture(model: Callable[..., Any], *inputs: Any, grad: bool = False) -> tuple[torch.fx.GraphModule, list[Any]]:
    """The graph dynamo captures for ``model(*inputs)`` and the inputs it is called with."""
    graphs: list[tuple[torch.fx.GraphModule, list[Any]]] = []

    def record(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        graphs.append((gm, list(example_inputs)))
        return gm.forward

    with torch.set_grad_enabled(grad):
        torch.compile(model, backend=record, fullgraph=True)(*inputs)
    assert len(graphs) == 1
    return graphs[0]


def trace(model: nn.Module, *shape_inputs: torch.Tensor) -> torch.fx.GraphModule:
    """``torch.fx`` tracing with buffers as get_attr nodes; with inputs, ``ShapeProp`` records every shape."""
    tracer = torch.fx.Tracer()
    tracer.proxy_buffer_attributes = True
    gm = torch.fx.GraphModule(model, tracer.trace(model))
    if shape_inputs:
        ShapeProp(gm).propagate(*shape_inputs)
    return gm


def apply(fn: Callable[[torch.fx.GraphModule], torch.fx.GraphModule], gm: torch.fx.GraphModule,
          ctx: passes.PassContext = CPU) -> torch.fx.GraphModule:
    with passes.running(ctx):
        out = fn(gm)
    out.graph.lint()
    out.recompile()
    return out


def ops(gm: torch.fx.GraphModule) -> list[Any]:
    return [n.target for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]


def run(gm: torch.fx.GraphModule, inputs: list[Any]) -> Any:
    with torch.no_grad():
        return gm(*inputs)


# -- registry ------------------------------------------------------------------------------------------------------
def test_registered_in_order_with_their_patterns() -> None:
    registered = {p.name: p for p in passes.list_passes()}
    expected = {"dead_code": (10, True), "constant_fold": (20, True), "conv_bn": (30, False), "addmm": (400, True),
                "channels_last": (500, True)}
    for name, (order, training) in expected.items():
        p = registered[name]
        assert (p.order, p.training, p.default) == (order, training, True)
        assert "Pattern" in p.fn.__doc__ and p.summary


# -- dead_code -----------------------------------------------------------------------------------------------------
class Leaf(nn.Module):
    """A user's module: its forward could do anything."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


class LeafTracer(torch.fx.Tracer):
    proxy_buffer_attributes = True

    def is_leaf_module(self, m: nn.Module, name: str) -> bool:
        return isinstance(m, Leaf) or super().is_leaf_module(m, name)


class Dead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Linear(4, 4)
        self.used = nn.Linear(4, 4)
        self.leaf = Leaf()
        self.bn = nn.BatchNorm1d(4)
        self.register_buffer("scale", torch.full((4,), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.exp(x)                      # pure, unused
        self.unused(x)                    # torch.nn module in eval, unused
        self.scale * 3                    # get_attr chain, unused
        y = x.clone()
        y.add_(1)                         # writes into y
        F.relu(y, inplace=True)           # writes into y
        torch.randn_like(x)               # draws random numbers
        F.dropout(x, 0.5, training=True)  # draws random numbers
        F.dropout(x, 0.5, training=False)  # does not: removed
        self.leaf(x)                      # unknown body
        self.bn(x)                        # updates its running statistics while training
        return self.used(y)


def test_dead_code_removes_pure_unused_nodes_and_keeps_effects() -> None:
    model = Dead()
    gm = torch.fx.GraphModule(model, LeafTracer().trace(model))
    x = torch.randn(3, 4)
    torch.manual_seed(1)
    expected = gm(x)
    out = apply(dead_code.dead_code, gm)
    kept = ops(out)
    assert torch.exp not in kept and "unused" not in kept and operator.mul not in kept
    assert F.dropout in kept and kept.count(F.dropout) == 1
    for effect in ("add_", torch.randn_like, "leaf", "bn"):
        assert effect in kept
    assert kept.count(F.relu) == 1
    assert not hasattr(out, "unused") and not hasattr(out, "scale") and hasattr(out, "used")
    torch.manual_seed(1)
    torch.testing.assert_close(out(x), expected)  # random draws kept: the same numbers come out


def test_dead_code_removes_a_batch_norm_in_eval_mode_only() -> None:
    model = Dead().eval()
    gm = torch.fx.GraphModule(model, LeafTracer().trace(model))
    assert "bn" not in ops(apply(dead_code.dead_code, gm))


def test_dead_code_keeps_grad_mode_switches() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            y = x * 2
        return x + y

    gm, inputs = capture(f, torch.randn(3), grad=True)
    before = [n.target for n in gm.graph.nodes if n.op == "call_function" and n.target is torch._C._set_grad_enabled]
    assert before
    out = apply(dead_code.dead_code, gm)
    after = [n.target for n in out.graph.nodes if n.op == "call_function" and n.target is torch._C._set_grad_enabled]
    assert after == before


def test_side_effect_judgement() -> None:
    g = torch.fx.Graph()
    x = g.placeholder("x")
    nodes = {
        "exp": g.call_function(torch.exp, (x,)),
        "add_out": g.call_function(torch.add, (x, x), {"out": x}),
        "relu_": g.call_function(torch.relu_, (x,)),
        "iadd": g.call_function(operator.iadd, (x, 1)),
        "setitem": g.call_function(operator.setitem, (x, 0, 1.0)),
        "rand": g.call_function(torch.rand, (3,)),
        "generator": g.call_function(torch.normal, (x, 1.0), {"generator": None}),
        "print": g.call_function(print, (x,)),
        "seed": g.call_function(torch.manual_seed, (0,)),
        "mean": g.call_method("mean", (x,)),
        "mul_": g.call_method("mul_", (x, 2)),
        "bernoulli": g.call_method("bernoulli", (x,)),
    }
    g.output(x)
    torch.fx.GraphModule(nn.Module(), g)
    effects = {name for name, node in nodes.items() if dead_code.has_side_effects(node)}
    assert effects == {"add_out", "relu_", "iadd", "setitem", "rand", "generator", "print", "seed", "mul_", "bernoulli"}


# -- constant_fold -------------------------------------------------------------------------------------------------
class Rotary(nn.Module):
    """The cos/sin table of rotary embeddings: a function of buffers only."""

    def __init__(self, dim: int = 8, positions: int = 6) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim), persistent=False)
        self.register_buffer("positions", torch.arange(positions).float(), persistent=False)
        self.weight = nn.Parameter(torch.randn(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        freqs = torch.outer(self.positions, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return x * emb.cos() + self.weight * 2  # the parameter's term is never folded


def test_constant_fold_computes_buffer_subgraphs_once() -> None:
    model = Rotary()
    gm = trace(model)
    x = torch.randn(2, 6, 8)
    expected = model(x)
    out = apply(constant_fold.constant_fold, gm)
    remaining = ops(out)
    assert torch.outer not in remaining and torch.cat not in remaining and "cos" not in remaining
    assert operator.mul in remaining  # x * table and weight * 2 still run
    assert isinstance(out._folded_constant_0, torch.Tensor) and out._folded_constant_0.shape == (6, 8)
    assert not hasattr(out, "inv_freq") and not hasattr(out, "positions")  # only the folded subgraph read them
    torch.testing.assert_close(out(x), expected, rtol=0, atol=0)


def test_constant_fold_in_a_dynamo_graph_folds_factories_not_lifted_buffers() -> None:
    class Positions(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("inv_freq", torch.rand(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            pos = torch.arange(x.shape[1], device=x.device).float() * 0.5
            return x + torch.outer(pos, self.inv_freq).sum(-1)

    model = Positions()
    x = torch.randn(2, 5)
    gm, inputs = capture(model, x)
    expected = run(gm, inputs)
    out = apply(constant_fold.constant_fold, gm)
    remaining = ops(out)
    assert torch.arange not in remaining and "float" not in remaining
    assert torch.outer in remaining  # inv_freq is a graph input: its value may change between calls
    torch.testing.assert_close(run(out, inputs), expected, rtol=0, atol=0)


class NotConstant(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4))
        self.register_buffer("counter", torch.zeros(4))
        self.register_buffer("table", torch.arange(4.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.exp()                 # a parameter: changes while training
        c = self.counter + 1                  # read, then written below
        self.counter.add_(1)
        t = self.table * x.sum()              # depends on an input
        return w + c + t + torch.ones(4, requires_grad=True) * 0


def test_constant_fold_leaves_parameters_written_buffers_inputs_and_requires_grad() -> None:
    model = NotConstant()
    gm = trace(model)
    before = ops(gm)
    out = apply(constant_fold.constant_fold, gm)
    assert ops(out) == before
    assert not any(name.startswith("_folded_constant") for name, _ in out.named_buffers())


def test_constant_fold_leaves_random_and_oversized_results(monkeypatch: pytest.MonkeyPatch) -> None:
    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x + torch.rand(4) * 0 + torch.ones(4, 4).sum(0), torch.arange(3.0).mul(2)

    gm, inputs = capture(f, torch.randn(4))
    monkeypatch.setattr(constant_fold, "MAX_FOLDED_BYTES", 64)  # ones(4, 4) is 64 bytes, its sum 16
    out = apply(constant_fold.constant_fold, copy.deepcopy(gm))
    remaining = ops(out)
    assert torch.rand in remaining
    assert torch.ones not in remaining and "sum" not in remaining
    assert out._folded_constant_0.shape == (4,)
    assert "mul" in remaining and torch.arange not in remaining  # an output is computed anew on each call
    first, second = run(out, inputs)[1], run(out, inputs)[1]
    assert first.data_ptr() != second.data_ptr()
    torch.manual_seed(0)
    got = run(out, inputs)
    torch.manual_seed(0)
    torch.testing.assert_close(got, run(gm, inputs))
    monkeypatch.setattr(constant_fold, "MAX_FOLDED_BYTES", 32)  # every step is capped, intermediates too
    assert torch.ones in ops(apply(constant_fold.constant_fold, gm))


# -- conv_bn -------------------------------------------------------------------------------------------------------
def _randomize_statistics(model: nn.Module) -> nn.Module:
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.running_mean.uniform_(-1, 1)
                m.running_var.uniform_(0.5, 2)
                if m.weight is not None:
                    m.weight.uniform_(0.5, 2)
                    m.bias.uniform_(-1, 1)
    return model


class ConvBn(nn.Module):
    def __init__(self, dims: int = 2, channels: int = 3, bias: bool = True, affine: bool = True,
                 padding_mode: str = "zeros") -> None:
        super().__init__()
        conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dims]
        bn = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}[dims]
        self.conv = conv(channels, 4, 3, padding=1, bias=bias, padding_mode=padding_mode)
        self.bn = bn(4, affine=affine)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)))


@pytest.mark.parametrize(("dims", "bias", "affine", "padding_mode"),
                         [(1, True, True, "zeros"), (2, False, True, "zeros"), (3, True, False, "zeros"),
                          (2, True, True, "reflect")])
def test_conv_bn_folds_modules(dims: int, bias: bool, affine: bool, padding_mode: str) -> None:
    torch.manual_seed(0)
    model = _randomize_statistics(ConvBn(dims, bias=bias, affine=affine, padding_mode=padding_mode)).eval()
    weight = model.conv.weight.detach().clone()
    x = torch.randn(2, 3, *(5,) * dims)
    expected = model(x)
    out = apply(conv_bn.conv_bn, torch.fx.symbolic_trace(model))
    conv = {1: torch.conv1d, 2: torch.conv2d, 3: torch.conv3d}[dims]
    assert ops(out) == ([conv] if padding_mode == "zeros" else ["fused_conv_bn_0"]) + [F.relu]
    assert not hasattr(out, "bn") and not hasattr(out, "conv")
    torch.testing.assert_close(run(out, [x]), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(model.conv.weight, weight) and isinstance(model.bn, nn.Module)  # the model is untouched


def test_conv_bn_folds_functional_calls_on_get_attr_operands() -> None:
    class Functional(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(4, 3, 3, 3))
            self.register_buffer("mean", torch.rand(4))
            self.register_buffer("var", torch.rand(4) + 0.5)
            self.gamma = nn.Parameter(torch.rand(4) + 0.5)
            self.beta = nn.Parameter(torch.randn(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = F.conv2d(x, self.weight, None, 2, 1)
            return F.batch_norm(y, self.mean, self.var, self.gamma, self.beta, False, 0.1, 1e-3)

    model = Functional()
    x = torch.randn(2, 3, 8, 8)
    expected = model(x)
    out = apply(conv_bn.conv_bn, trace(model))
    assert ops(out) == [torch.conv2d]
    torch.testing.assert_close(run(out, [x]), expected, rtol=1e-5, atol=1e-5)


def test_conv_bn_in_a_dynamo_graph_emits_the_arithmetic_and_follows_weight_changes() -> None:
    torch.manual_seed(0)
    model = _randomize_statistics(ConvBn(2, channels=2)).eval()
    x = torch.randn(4, 2, 16, 16)  # 4096 activation elements per channel group, 72 weights: folding pays
    gm, inputs = capture(model, x)
    out = apply(conv_bn.conv_bn, copy.deepcopy(gm))
    remaining = ops(out)
    assert F.batch_norm not in remaining and remaining.count(torch.conv2d) == 1
    torch.testing.assert_close(run(out, inputs), run(gm, inputs), rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # parameters and statistics are graph inputs: new values must be used
        for t in inputs:
            if isinstance(t, nn.Parameter) or t.dim() == 1:
                t.mul_(1.5)
    torch.testing.assert_close(run(out, inputs), run(gm, inputs), rtol=1e-5, atol=1e-5)


def test_conv_bn_leaves_run_time_folding_that_would_not_pay() -> None:
    model = _randomize_statistics(ConvBn(2, channels=3)).eval()
    gm, inputs = capture(model, torch.randn(1, 3, 4, 4))  # 64 output elements, 108 weights
    assert F.batch_norm in ops(apply(conv_bn.conv_bn, gm))


class TwoUsers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return self.bn(y) + y


def test_conv_bn_refuses_training_mode_shared_outputs_and_training_graphs() -> None:
    training_bn = ConvBn()  # train mode: batch statistics
    assert "bn" in ops(apply(conv_bn.conv_bn, torch.fx.symbolic_trace(training_bn)))
    assert "bn" in ops(apply(conv_bn.conv_bn, torch.fx.symbolic_trace(TwoUsers().eval())))
    training = passes.PassContext(torch.device("cpu"), training=True)
    assert "bn" in ops(apply(conv_bn.conv_bn, torch.fx.symbolic_trace(ConvBn().eval()), training))

    def batch_statistics(x: torch.Tensor, w: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(F.conv2d(x, w), m, v, training=True)

    gm = torch.fx.symbolic_trace(batch_statistics)
    assert F.batch_norm in ops(apply(conv_bn.conv_bn, gm))


# -- addmm ---------------------------------------------------------------------------------------------------------
class Affine(nn.Module):
    def __init__(self, k: int = 16, n: int = 8) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(k, n))
        self.b = nn.Parameter(torch.randn(n))

    def forward(self, x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, ...]:
        first = x @ self.w + self.b
        second = self.b + torch.mm(y, self.w)
        third = torch.matmul(z, self.w).add(self.b)
        return first, second, third


def test_addmm_replaces_matmul_plus_bias_with_equal_numerics() -> None:
    torch.manual_seed(0)
    x, y, z = torch.randn(5, 16), torch.randn(7, 16), torch.randn(2, 3, 16)
    gm, inputs = capture(Affine(), x, y, z)
    expected = run(gm, inputs)
    out = apply(addmm.addmm, gm)
    remaining = ops(out)
    assert remaining.count(torch.addmm) == 3
    assert operator.matmul not in remaining and torch.mm not in remaining and torch.matmul not in remaining
    for got, want in zip(run(out, inputs), expected):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want)  # fp32 defaults: rtol 1.3e-6, atol 1e-5


def test_addmm_with_symbolic_sizes_rewrites_matrices_only() -> None:
    class Batched(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(16, 8))
            self.b = nn.Parameter(torch.randn(8))

        def forward(self, x: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x @ self.w + self.b, z @ self.w + self.b

    graphs: list[tuple[torch.fx.GraphModule, list[Any]]] = []

    def record(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        graphs.append((gm, example_inputs))
        return gm.forward

    with torch.no_grad():
        torch.compile(Batched(), backend=record, dynamic=True)(torch.randn(5, 16), torch.randn(2, 3, 16))
    gm, inputs = graphs[0]
    expected = run(gm, inputs)
    out = apply(addmm.addmm, gm)
    remaining = ops(out)
    assert remaining.count(torch.addmm) == 1 and remaining.count(operator.matmul) == 1  # 3-D x: sizes unknown
    for got, want in zip(run(out, inputs), expected):
        torch.testing.assert_close(got, want)


def test_addmm_refuses_what_is_not_a_biased_gemm() -> None:
    class Refused(nn.Module):
        def forward(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, w3: torch.Tensor,
                    b64: torch.Tensor, big: torch.Tensor) -> tuple[torch.Tensor, ...]:
            shared = x @ w
            return (shared + b, shared * 2,           # the product has another user
                    torch.matmul(x, w3) + b,            # batched weight
                    x @ w + b64,                        # dtype promotion
                    x @ w + big,                        # the bias enlarges the result
                    torch.add(x @ w, b, alpha=2),       # not a plain sum
                    F.linear(x, w.t(), b))              # already one GEMM

    args = (torch.randn(5, 16), torch.randn(16, 8), torch.randn(8), torch.randn(3, 16, 8),
            torch.randn(8, dtype=torch.float64), torch.randn(2, 5, 8))
    gm, inputs = capture(Refused(), *args)
    before = ops(gm)
    out = apply(addmm.addmm, gm)
    assert ops(out) == before


def test_addmm_needs_recorded_shapes() -> None:
    gm = torch.fx.symbolic_trace(Affine())  # no shapes recorded
    assert torch.addmm not in ops(apply(addmm.addmm, gm))


# -- channels_last -------------------------------------------------------------------------------------------------
class SmallCnn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = F.relu(self.bn1(self.conv1(x)), inplace=True)
        features = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        return self.fc(features.view(features.size(0), -1)), features


@pytest.fixture
def prefers_channels_last(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU backend asks for channels-last whatever this host's oneDNN says."""
    monkeypatch.setattr(get_backend("cpu"), "preferred_conv_memory_format", lambda index: torch.channels_last)


def test_channels_last_converts_conv_inputs_and_keeps_outputs(prefers_channels_last: None) -> None:
    torch.manual_seed(0)
    model = _randomize_statistics(SmallCnn()).eval()
    gm, inputs = capture(model, torch.randn(2, 3, 8, 8))
    expected = run(gm, inputs)
    out = apply(channels_last.channels_last, gm)
    converted = [n for n in out.graph.nodes
                 if n.op == "call_method" and n.kwargs.get("memory_format") is torch.channels_last]
    assert len(converted) == 2
    assert all(next(iter(n.users)).target is torch.conv2d for n in converted)
    view = next(n for n in out.graph.nodes if n.op == "call_method" and n.target == "view")
    assert view.args[0].target == "contiguous"  # a view needs compatible strides
    got = run(out, inputs)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
        assert g.stride() == e.stride()


def test_channels_last_follows_the_device_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    gm, _ = capture(SmallCnn().eval(), torch.randn(2, 3, 8, 8))
    before = ops(gm)
    mps = passes.PassContext(torch.device("mps", 0), training=False)  # its backend keeps the default format
    assert ops(apply(channels_last.channels_last, gm, mps)) == before
    monkeypatch.setattr(get_backend("cpu"), "preferred_conv_memory_format", lambda index: torch.contiguous_format)
    assert ops(apply(channels_last.channels_last, gm)) == before
    unregistered = passes.PassContext(torch.device("meta"), training=False)
    assert ops(apply(channels_last.channels_last, gm, unregistered)) == before


def _stride_reader(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    y = F.conv2d(x, w)
    return y * y.stride(1)


def _write_after_reshape(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    y = F.conv2d(x, w)
    z = y.reshape(y.shape[0], -1)
    z.add_(1)  # wrote into y before the change; into a copy after it
    return y


@torch.fx.wrap
def _user_function(t: torch.Tensor) -> torch.Tensor:
    return t.view(t.shape[0], -1)


def _user_code(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return _user_function(F.conv2d(x, w))


def _permuted_output(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.conv2d(x, w).permute(0, 2, 3, 1)


@pytest.mark.parametrize("fn", [_stride_reader, _write_after_reshape, _user_code, _permuted_output])
def test_channels_last_refuses_layout_sensitive_graphs(fn: Callable[..., torch.Tensor],
                                                       prefers_channels_last: None) -> None:
    x, w = torch.randn(2, 3, 6, 6), torch.randn(4, 3, 3, 3)
    gm = torch.fx.symbolic_trace(fn)
    ShapeProp(gm).propagate(x, w)
    before = ops(gm)
    assert ops(apply(channels_last.channels_last, gm)) == before


def test_channels_last_on_a_traced_graph_with_recorded_shapes(prefers_channels_last: None) -> None:
    def plain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.relu(F.conv2d(x, w)).flatten(1)

    x, w = torch.randn(2, 3, 6, 6), torch.randn(4, 3, 3, 3)
    gm = torch.fx.symbolic_trace(plain)
    expected = gm(x, w)
    assert "contiguous" not in ops(apply(channels_last.channels_last, copy.deepcopy(gm)))  # no shapes: unknown rank
    ShapeProp(gm).propagate(x, w)
    out = apply(channels_last.channels_last, gm)
    assert ops(out).count("contiguous") == 2  # the conv's input, the output
    got = out(x, w)
    torch.testing.assert_close(got, expected)
    assert got.is_contiguous()


# -- all passes together -------------------------------------------------------------------------------------------
class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(12, 32) / 4)
        self.b1 = nn.Parameter(torch.randn(32))
        self.w2 = nn.Parameter(torch.randn(32, 5) / 6)
        self.b2 = nn.Parameter(torch.randn(5))
        self.register_buffer("freq", torch.arange(32.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(32, device=x.device).float()  # a factory: folded in dynamo's graphs
        scale = self.freq.div(32).add(0.5)  # a buffer's subgraph: folded where buffers are get_attr nodes
        h = torch.tanh(x @ self.w1 + self.b1) * (scale + pos / 64)
        return h @ self.w2 + self.b2


def _model(name: str, device: torch.device) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    if name == "cnn":
        return _randomize_statistics(SmallCnn()).eval().to(device), torch.randn(16, 3, 8, 8, device=device)
    return Mlp().to(device), torch.randn(6, 12, device=device)


@pytest.mark.parametrize("name", ["cnn", "mlp"])
def test_runner_keeps_outputs_equal(device: torch.device, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # cuDNN convolves in TF32 by default on CUDA, whose 10-bit inputs differ by ~1e-3 between the folded and the
    # unfolded weights: the comparison is of the passes' float32 arithmetic
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    model, x = _model(name, device)
    gm = trace(model, x)  # shapes recorded by ShapeProp on the device
    with torch.no_grad():
        expected = model(x)
    ctx = passes.PassContext(device, training=False, example_inputs=(x,))
    out, records = passes.run_passes(gm, ctx)
    assert not [r for r in records if r.error]
    changed = {r.name for r in records if r.changed}
    assert {"cnn": {"conv_bn"}, "mlp": {"constant_fold", "addmm"}}[name] <= changed
    got = run(out, [x])
    for g, e in zip(got if name == "cnn" else (got,), expected if name == "cnn" else (expected,), strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
        assert g.stride() == e.stride()


@pytest.mark.parametrize("name", ["cnn", "mlp"])
def test_runner_keeps_outputs_equal_on_dynamo_graphs(name: str, prefers_channels_last: None) -> None:
    model, x = _model(name, torch.device("cpu"))
    gm, inputs = capture(model, x)
    expected = run(gm, inputs)
    out, records = passes.run_passes(copy.deepcopy(gm), passes.PassContext(x.device, False, tuple(inputs)))
    assert not [r for r in records if r.error]
    changed = {r.name for r in records if r.changed}
    assert {"cnn": {"conv_bn", "channels_last"}, "mlp": {"constant_fold", "addmm"}}[name] <= changed
    for g, e in zip(run(out, inputs), expected, strict=True):  # dynamo's graphs return tuples
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
        assert g.stride() == e.stride()


@pytest.mark.parametrize("name", ["cnn", "mlp"])
def test_rewritten_dynamo_graphs_go_through_aot_autograd(name: str, prefers_channels_last: None) -> None:
    """AOTAutograd (under Inductor too) accepts the constants the passes add to dynamo's graphs."""
    model, x = _model(name, torch.device("cpu"))
    with torch.no_grad():
        expected = model(x)
        got = torch.compile(model, backend="torchport", options={"compiler": "aot_eager", "fallback": False})(x)
    for g, e in zip(got if name == "cnn" else (got,), expected if name == "cnn" else (expected,), strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
