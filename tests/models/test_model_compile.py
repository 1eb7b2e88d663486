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


def _sdpa_calls(model, **inputs):
    """``(has a mask tensor, is_causal)`` of each SDPA call in the graph dynamo traces for ``model(**inputs)``."""
    explained = torch._dynamo.explain(model)(**inputs)
    assert explained.graph_break_count == 0
    calls = [node for graph in explained.graphs for node in graph.graph.nodes
             if "scaled_dot_product_attention" in str(node.target)]
    assert calls, "no SDPA call in the traced graph"
    return {(node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None) is not None,
             node.kwargs.get("is_causal")) for node in calls}


def test_compiled_causal_mask_is_left_to_sdpa_is_causal():
    from transformers import masking_utils

    inputs = batch(CPU)
    model = build("llama", attention="sdpa")
    unpatched = _sdpa_calls(model, input_ids=inputs["input_ids"])  # a mask tensor with torch < 2.14 (transformers)
    torchport.patch(model)
    assert _sdpa_calls(model, input_ids=inputs["input_ids"]) == {(False, True)}
    # padding: the mask stays a tensor (its values decide it); causal_mask=False leaves transformers' choice
    padding = torch.ones_like(inputs["input_ids"])
    padding[0, :3] = 0
    assert _sdpa_calls(model, input_ids=inputs["input_ids"], attention_mask=padding) == {(True, False)}
    torchport.patch(model, causal_mask=False)
    assert _sdpa_calls(model, input_ids=inputs["input_ids"]) == unpatched
    torchport.patch(model)
    torchport.unpatch(model)
    assert masking_utils.ALL_MASK_ATTENTION_FUNCTIONS["sdpa"] is masking_utils.sdpa_mask
    assert "sdpa" not in masking_utils.ALL_MASK_ATTENTION_FUNCTIONS._local_mapping


def test_sdpa_mask_wrapper_skips_only_the_plain_causal_mask(monkeypatch):
    from transformers import masking_utils

    from torchport.models import ops

    asked = []

    class Table(dict):
        pass

    table = Table(sdpa=lambda **kwargs: asked.append(kwargs) or "mask")
    wrapped = ops.make_sdpa_masks({}, table, masking_utils.causal_mask_function)["sdpa"]
    plain = dict(batch_size=2, q_length=12, kv_length=12, q_offset=0, kv_offset=0,
                 mask_function=masking_utils.causal_mask_function, attention_mask=None, allow_is_causal_skip=True)
    assert wrapped(**plain) == "mask"  # eager mode: transformers decides
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert wrapped(**plain) is None
    others = [dict(attention_mask=torch.ones(2, 12)), dict(kv_length=20), dict(q_length=1, kv_length=1),
              dict(q_offset=4), dict(q_offset=torch.tensor(0)), dict(local_size=4), dict(allow_is_causal_skip=False),
              dict(mask_function=masking_utils.and_masks(masking_utils.causal_mask_function))]
    for change in others:
        asked.clear()
        assert wrapped(**{**plain, **change}) == "mask", change
        assert asked and asked[0] == {**plain, **change}


@pytest.mark.parametrize("padded", [False, True])
def test_compiled_sdpa_model_equals_eager(padded):
    model = torchport.patch(build("llama", attention="sdpa"))
    inputs = batch(CPU)
    padding = torch.ones_like(inputs["input_ids"])
    if padded:
        padding[1, :4] = 0
    eager_out, eager_grads = loss_and_grads(model, {**inputs, "attention_mask": padding})
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    out, grads = loss_and_grads(compiled, {**inputs, "attention_mask": padding})
    assert relative_error(out.loss, eager_out.loss) < 1e-6
    for name, grad in grads.items():
        assert relative_error(grad, eager_grads[name.removeprefix("_orig_mod.")]) < 1e-5, name


def test_trainer_token_count_tensor_compiles_without_a_graph_break():
    """Hugging Face Trainer passes ``num_items_in_batch`` as a tensor under gradient accumulation: the compiled
    patched model divides by it on the device (no host read, no graph break) and matches the eager patched model."""
    model = torchport.patch(build("llama", attention="sdpa"))
    inputs = {**batch(CPU), "num_items_in_batch": torch.tensor(17)}
    explained = torch._dynamo.explain(model)(**inputs)
    assert explained.graph_break_count == 0, [r.reason for r in explained.break_reasons]
    eager_out, eager_grads = loss_and_grads(model, inputs)
    out, grads = loss_and_grads(torch.compile(model, backend="aot_eager", fullgraph=True), inputs)
    assert relative_error(out.loss, eager_out.loss) < 1e-6
    for name, grad in grads.items():
        assert relative_error(grad, eager_grads[name.removeprefix("_orig_mod.")]) < 1e-5, name


def test_quantised_patched_model_compiles_with_a_custom_op_per_linear():
    """A model quantised by ``torchport.quantize`` (merged q/k/v and gate/up included) and patched: one graph, each
    linear layer a ``torchport.lowbit_matmul`` call, logits equal to eager's."""
    from torchport import quant

    model = torchport.patch(quant.quantize(build("llama"), "int4")).eval()
    assert quant.merged_groups(model)
    input_ids = batch(CPU)["input_ids"]
    explained = torch._dynamo.explain(model)(input_ids=input_ids)
    assert explained.graph_break_count == 0, [r.reason for r in explained.break_reasons]
    calls = [str(n.target) for g in explained.graphs for n in g.graph.nodes].count("torchport.lowbit_matmul")
    assert calls == len(quant.quantized_modules(model))
    torch._dynamo.reset()
    with torch.no_grad():
        want = model(input_ids=input_ids).logits
        got = torch.compile(model, backend="aot_eager")(input_ids=input_ids).logits
    assert relative_error(got, want) < 1e-5
