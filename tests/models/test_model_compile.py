"""``torch.compile(torchport.patch(model))``: every patched family traces with no graph break, its graph calls
torchport's custom ops, and the compiled loss, logits and gradients equal the eager patched model's (float32)."""

from __future__ import annotations

import pytest
import torch

import torchport

from tiny_models import CASES, batch, build, loss_and_grads, relative_error

# one case per family (the family table's rows), plus Gemma 2 without soft-capping (its fused loss)
FAMILY_CASES = sorted({model_type: case for case, (model_type, _) in reversed(CASES.items())}.values()) + [
    "gemma2-nocap"]
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _clean():
    torchport.unpatch()
    torch._dynamo.reset()
    yield
    torchport.unpatch()
    torch._dynamo.reset()


def _explain(fn, *args, **kwargs):
    explained = torch._dynamo.explain(fn)(*args, **kwargs)
    reasons = [f"{r.reason.splitlines()[0]} at {r.user_stack[-1] if r.user_stack else '?'}"
               for r in explained.break_reasons]
    assert explained.graph_break_count == 0, "graph breaks:\n" + "\n".join(reasons)
    return {str(node.target) for graph in explained.graphs for node in graph.graph.nodes
            if "torchport" in str(node.target)}


def _train_loss(model, input_ids, labels):
    return model(input_ids=input_ids, labels=labels).loss


@pytest.mark.parametrize("case", FAMILY_CASES)
def test_patched_model_traces_without_graph_breaks(case):
    model = torchport.patch(build(case))
    inputs = batch(CPU)
    ops = _explain(_train_loss, model, inputs["input_ids"], inputs["labels"])
    assert {"torchport.rms_norm", "torchport.rope"} <= ops, ops
    assert ops & {"torchport.swiglu", "torchport.geglu"}, ops
    loss_ops = {"torchport.fused_linear_cross_entropy", "torchport.cross_entropy"}
    assert ops & loss_ops, ops
    model.eval()
    assert "torchport.rms_norm" in _explain(model, input_ids=inputs["input_ids"])


@pytest.mark.parametrize("case", ["llama", "gemma2", "phi3-partial"])
@pytest.mark.parametrize("loss", ["fused_linear_cross_entropy", "cross_entropy"])
def test_compiled_patched_model_equals_eager(case, loss):
    flags = {"cross_entropy": loss == "cross_entropy", "fused_linear_cross_entropy": loss != "cross_entropy"}
    model = torchport.patch(build(case), **flags)
    inputs = batch(CPU)
    eager_out, eager_grads = loss_and_grads(model, inputs)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    out, grads = loss_and_grads(compiled, inputs)
    grads = {name.removeprefix("_orig_mod."): grad for name, grad in grads.items()}
    assert relative_error(out.loss, eager_out.loss) < 1e-6
    assert grads.keys() == eager_grads.keys()
    for name, grad in grads.items():
        assert relative_error(grad, eager_grads[name]) < 1e-5, name
    model.eval()
    with torch.no_grad():
        expected = model(input_ids=inputs["input_ids"]).logits
        got = torch.compile(model, backend="aot_eager", fullgraph=True)(input_ids=inputs["input_ids"]).logits
    assert relative_error(got, expected) < 1e-6
