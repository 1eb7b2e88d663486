"""Graphs compiled for TorchAir (the Ascend graph engine): no ``torchport::`` op reaches them.

TorchAir's default GE graph mode converts each op of the graph through an Ascend converter registered for it, and
torchport's custom ops have none: the fusion passes stay off before it, and naming one is an error that says why.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from torchport.compile import passes


def _graph() -> tuple[torch.fx.GraphModule, list]:
    graphs = []

    def record(gm, example_inputs):
        graphs.append((gm, list(example_inputs)))
        return gm.forward

    def block(x, w, g, u):
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype), F.silu(g) * u

    torch._dynamo.reset()
    torch.compile(block, backend=record, fullgraph=True)(torch.randn(3, 8), torch.randn(8), torch.randn(3, 4),
                                                         torch.randn(3, 4))
    return graphs[0]


def _ctx(compiler: str) -> passes.PassContext:
    return passes.PassContext(torch.device("cpu"), training=True, compiler=compiler)


def test_fusion_passes_stay_off_before_torchair():
    gm, _ = _graph()
    after, records = passes.run_passes(copy.deepcopy(gm), _ctx("torchair"))
    assert not any(n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
                   and n.target.namespace == "torchport" for n in after.graph.nodes)
    fusions = {p.name for p in passes.list_passes() if p.fusion}
    assert not {r.name for r in records} & fusions
    # the same graph for eager compilation gets them
    after_eager, _ = passes.run_passes(copy.deepcopy(gm), _ctx("eager"))
    assert any(getattr(n.target, "namespace", None) == "torchport" for n in after_eager.graph.nodes)


def test_naming_a_fusion_pass_for_torchair_is_an_error_that_says_why():
    gm, _ = _graph()
    with pytest.raises(ValueError, match=r"rms_norm, swiglu would put torchport ops into a graph for torchair: "
                                         r"TorchAir's GE graph mode .* compiler='eager'"):
        passes.run_passes(copy.deepcopy(gm), _ctx("torchair"), {"rms_norm": True, "swiglu": True})
    # switching them off explicitly is fine
    passes.run_passes(copy.deepcopy(gm), _ctx("torchair"), {"rms_norm": False})
