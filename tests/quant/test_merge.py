"""Merged sibling layers (``torchport.quant.merge``): one kernel per sibling set at one row, outputs equal to the
layers run one by one, memory unchanged, and the cases where merging must stop or re-join the codes."""

from __future__ import annotations

import copy
import gc
import io
import logging
import weakref

import pytest
import torch
from torch import nn

import torchport
from torchport import quant
from torchport.quant import QuantizationError, merge

FORMATS = ["int8", "fp8", "int4", "mxfp4", "nvfp4"]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}


class Layer(nn.Module):
    """A Llama-shaped decoder layer in miniature: q/k/v with biases (Qwen-style), o, gate/up, down."""

    def __init__(self, hidden: int = 256, kv: int = 64, inter: int = 160) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(hidden, n) for n in (hidden, kv, kv))
        self.o_proj = nn.Linear(hidden, hidden, bias=False)
        self.gate_proj, self.up_proj = (nn.Linear(hidden, inter, bias=False) for _ in range(2))
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        kv = x if memory is None else memory  # cross-attention: keys and values read another tensor
        q, k, v = self.q_proj(x), self.k_proj(kv), self.v_proj(kv)
        h = x + self.o_proj(q * (k.mean(-1, keepdim=True) + v.mean(-1, keepdim=True)))
        return h + self.down_proj(torch.nn.functional.silu(self.gate_proj(h)) * self.up_proj(h))


def _pair(fmt: str, device: torch.device, dtype: torch.dtype = torch.float32, *,
          train: bool = False) -> tuple[nn.Module, nn.Module]:
    """The same layer quantised merged and one by one (for nvfp4 the one-by-one layers get the merged layers'
    global scale, so that both hold the same codes); for inference (``train=False``) the biases need no gradient,
    since where autograd records the layers run on their own."""
    torch.manual_seed(0)
    dense = Layer().to(device, dtype)
    merged = quant.quantize(copy.deepcopy(dense), fmt)
    alone = quant.quantize(dense, fmt, merge=False)
    if fmt == "nvfp4":
        for name, layer in quant.quantized_modules(merged).items():
            alone.get_submodule(name).load_state_dict(layer.state_dict())
    merged.requires_grad_(train)
    alone.requires_grad_(train)
    return merged, alone


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double().cpu() - b.double().cpu()).norm() / b.double().cpu().norm()).item()


def _count_calls(monkeypatch) -> list[int]:
    calls = []
    original = merge.lowbit_linear

    def counted(x, t, *args, **kwargs):
        calls.append(t["qweight"].shape[0])
        return original(x, t, *args, **kwargs)

    monkeypatch.setattr(merge, "lowbit_linear", counted)
    return calls


@pytest.mark.parametrize("fmt", FORMATS)
@torch.no_grad()  # the biases require gradients: where autograd records, each layer runs on its own
def test_one_row_runs_each_sibling_set_as_one_kernel(fmt, device, monkeypatch):
    merged, alone = _pair(fmt, device)
    assert quant.merged_groups(merged) == [("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")]
    assert quant.merged_groups(alone) == []
    assert "merged=3" in repr(merged.k_proj) and "merged=2" in repr(merged.up_proj) and "merged" not in repr(
        merged.o_proj)
    calls = _count_calls(monkeypatch)
    for shape in [(1, 256), (1, 1, 256), (256,)]:
        x = torch.randn(shape, device=device)
        calls.clear()
        y = merged(x)
        assert calls == [256 + 64 + 64, 160 + 160]  # o and down run through QuantizedLinear, not the group
        assert y.shape == x.shape and _rel(y, alone(x)) <= TOLERANCE[torch.float32]
        assert merged.q_proj._group._pending is None  # every slice was taken
    x = torch.randn(2, 3, 256, device=device)  # several rows: each layer on its own
    calls.clear()
    assert _rel(merged(x), alone(x)) <= TOLERANCE[torch.float32]
    assert calls == []


def test_bf16_outputs_and_slices(device, dtype):
    merged, alone = _pair("int4", device, dtype)
    x = torch.randn(1, 1, 256, device=device, dtype=dtype)
    q, k, v = merged.q_proj(x), merged.k_proj(x), merged.v_proj(x)
    for got, name in zip((q, k, v), ("q_proj", "k_proj", "v_proj")):
        want = alone.get_submodule(name)(x)
        assert got.shape == want.shape and got.dtype == dtype and got.is_contiguous()
        assert _rel(got, want) <= TOLERANCE.get(dtype, 2e-3)
    assert _rel(merged(x), alone(x)) <= 3 * TOLERANCE.get(dtype, 2e-3)


def test_memory_is_unchanged_and_codes_are_slices_of_one_tensor(device):
    merged, alone = _pair("int4", device)
    assert quant.weight_bytes(merged) == quant.weight_bytes(alone) == sum(
        t.numel() * t.element_size() for t in [*alone.buffers(), *alone.parameters()])
    q, k, v = merged.q_proj.qweight, merged.k_proj.qweight, merged.v_proj.qweight
    assert q._base is not None and q._base is k._base is v._base  # slices of one tensor
    assert k.storage_offset() == q.numel() and v.storage_offset() == q.numel() + k.numel()
    for name in ("q_proj", "gate_proj"):
        for key, t in merged.get_submodule(name).tensors().items():
            assert torch.equal(t.cpu(), alone.get_submodule(name).tensors()[key].cpu()), (name, key)


@torch.no_grad()
def test_siblings_reading_different_inputs_stop_merging(device, monkeypatch, caplog):
    merged, alone = _pair("int8", device)
    calls = _count_calls(monkeypatch)
    x, memory = torch.randn(1, 256, device=device), torch.randn(1, 256, device=device)
    with caplog.at_level(logging.INFO, logger="torchport"):
        for _ in range(3):
            assert _rel(merged(x, memory), alone(x, memory)) <= TOLERANCE[torch.float32]
    assert "do not read one input" in caplog.text
    assert not merged.q_proj._group.shared and merged.gate_proj._group.shared
    calls.clear()
    merged(x, memory)
    assert calls == [160 + 160]  # gate/up still merged; q, k, v on their own


def test_an_input_changed_in_place_between_siblings_is_not_reused(device):
    merged, alone = _pair("int4", device)
    x = torch.randn(1, 256, device=device)
    merged.q_proj(x)
    x.mul_(2)  # same object, new version: k must see the new values
    assert _rel(merged.k_proj(x), alone.k_proj(x)) <= TOLERANCE[torch.float32]
    assert not merged.q_proj._group.shared  # v never took its slice of the first call


@torch.no_grad()
def test_codes_moved_or_replaced_are_joined_again(device):
    torch.manual_seed(0)
    dense = Layer()
    model = quant.quantize(copy.deepcopy(dense), "mxfp4")  # quantised on the CPU, then moved: each slice alone
    alone = quant.quantize(dense, "mxfp4", merge=False)
    model.to(device)
    alone.to(device)
    x = torch.randn(1, 256, device=device)
    assert _rel(model(x), alone(x)) <= TOLERANCE[torch.float32]
    q, v = model.q_proj.qweight, model.v_proj.qweight
    assert q.device.type == device.type and q._base is not None and q._base is v._base
    model.k_proj.qweight = model.k_proj.qweight.clone()  # a new tensor for one layer
    model.k_proj.load_state_dict(alone.k_proj.state_dict())  # and new values (same codes here)
    assert _rel(model(x), alone(x)) <= TOLERANCE[torch.float32]
    q, k = model.q_proj.qweight, model.k_proj.qweight  # joined again: one new tensor
    assert k.storage_offset() == q.numel() and q._base is not None and k._base is q._base
    # a sibling whose codes have no data now (an offloading hook's meta tensor): the others run on their own
    model.v_proj.qweight = torch.empty_like(model.v_proj.qweight, device="meta")
    assert model.q_proj._group.tensors() is None
    assert _rel(model.q_proj(x), alone.q_proj(x)) <= TOLERANCE[torch.float32]
    model.v_proj.qweight = alone.v_proj.qweight.clone()
    assert _rel(model(x), alone(x)) <= TOLERANCE[torch.float32] and model.q_proj._group.shared


def test_training_runs_each_layer_on_its_own(device, monkeypatch):
    """Where autograd records, outputs that were views of one tensor would share a version counter (an in-place
    write to q would fail k's backward): the layers run on their own, and gradients equal the unmerged model's."""
    merged, alone = _pair("int4", device, train=True)
    calls = _count_calls(monkeypatch)
    grads = []
    for model in (merged, alone):
        x = torch.randn(1, 256, generator=torch.Generator().manual_seed(3)).to(device).requires_grad_()
        model(x).square().sum().backward()
        grads.append((x.grad, model.q_proj.bias.grad, model.v_proj.bias.grad))
        k = model.k_proj(x)
        loss = k.square().sum()
        model.q_proj(x).mul_(0.125)  # an in-place write to a sibling's output
        loss.backward()
    assert calls == []
    for got, want in zip(*grads):
        assert _rel(got, want) <= 1e-4
    with torch.no_grad():  # no gradient recorded: merged again
        merged(torch.randn(1, 256, device=device))
    assert calls == [256 + 64 + 64, 160 + 160]


def test_save_load_and_copies_keep_the_groups(tmp_path, device):
    merged, _ = _pair("nvfp4", device)
    x = torch.randn(1, 256, device=device)
    want = merged(x)
    path = tmp_path / "layer.safetensors"
    quant.save(merged, path)
    loaded = quant.load(Layer(), path, device=device)
    assert quant.merged_groups(loaded) == quant.merged_groups(merged)
    again = quant.load(quant.quantize(Layer().to(device), "nvfp4"), path)  # into a model quantised and merged
    assert quant.merged_groups(again) == quant.merged_groups(merged) and torch.equal(again(x), want)
    other = quant.quantize(Layer().to(device), "nvfp4", merge=[("k_proj", "v_proj")])
    quant.load(other, path)  # merged otherwise: its own groups stay
    assert quant.merged_groups(other) == [("k_proj", "v_proj"), ("gate_proj", "up_proj")]  # gate/up: the file's
    assert _rel(other.k_proj(x), merged.k_proj(x)) <= TOLERANCE[torch.float32]
    saved = io.BytesIO()
    torch.save(merged, saved)
    saved.seek(0)
    for other in (loaded, copy.deepcopy(merged), torch.load(saved, weights_only=False)):
        assert other.q_proj._group is other.v_proj._group is not merged.q_proj._group
        assert torch.equal(other(x), want)


def test_merge_siblings_on_a_quantised_model():
    torch.manual_seed(0)
    model = quant.quantize(Layer(), "int4", merge=False)
    x = torch.randn(1, 256)
    want = model(x)
    assert quant.merge_siblings(model, [("gate_proj", "up_proj")]) == [("gate_proj", "up_proj")]
    assert torch.equal(model(x), want)
    with pytest.raises(QuantizationError, match=r"layer 'gate_proj' is merged already"):
        quant.merge_siblings(model)
    separate = quant.quantize(Layer(), "nvfp4", merge=False)  # each layer has its own global scale
    assert quant.merge_siblings(separate) == []


def test_sets_that_cannot_merge_stay_separate(caplog):
    layer = Layer()
    layer.k_proj = nn.Linear(256, 64, bias=False)  # q and v have biases
    with caplog.at_level(logging.INFO, logger="torchport"):
        quant.quantize(layer, "int8")
    assert quant.merged_groups(layer) == [("gate_proj", "up_proj")]
    assert "not merged" in caplog.text and "bias" in caplog.text
    names = ["a.q_proj", "a.k_proj", "b.q_proj", "b.o_proj", "b.gate_proj", "c.w1", "c.w3", "d.up_proj"]
    assert merge.sibling_sets(names) == [("a.q_proj", "a.k_proj"), ("c.w1", "c.w3")]


def test_bad_merge_requests_are_errors_naming_what_is_allowed():
    for bad, message in [("q_proj", "got the string 'q_proj'"), ([("q_proj",)], r"two or more child names"),
                         ([("mlp.up", "mlp.gate")], r"no dots"),
                         ([("q_proj", "k_proj"), ("k_proj", "v_proj")], r"\['k_proj'\] appear in two sibling sets")]:
        layer = Layer()
        with pytest.raises(QuantizationError, match=message):
            quant.quantize(layer, "int4", merge=bad)
        assert not quant.quantized_modules(layer)


def test_a_compiled_model_calls_the_custom_op_per_layer_with_no_graph_break(device):
    merged, alone = _pair("int8", device, train=True)
    x = torch.randn(1, 256, device=device)
    if device.type != "npu":  # the simulated NPU's tensors are a Python subclass, which dynamo does not trace
        explained = torch._dynamo.explain(merged)(x)
        assert explained.graph_break_count == 0, [r.reason for r in explained.break_reasons]
        called = [str(node.target) for graph in explained.graphs for node in graph.graph.nodes]
        assert called.count("torchport.lowbit_matmul") == 7  # q, k, v, o, gate, up, down
        torch._dynamo.reset()
    backend = "eager" if device.type == "npu" else "aot_eager"  # aot_eager: the custom op's own backward
    compiled = torch.compile(merged, backend=backend)
    leaf = x.clone().requires_grad_()
    got = compiled(leaf)
    got.square().sum().backward()
    want = alone(x.clone().requires_grad_())
    assert _rel(got, want) <= TOLERANCE[torch.float32]
    x.requires_grad_()
    alone(x).square().sum().backward()
    assert _rel(leaf.grad, x.grad) <= 1e-4 and _rel(merged.v_proj.bias.grad, alone.v_proj.bias.grad) <= 1e-4
    assert merged.q_proj._group.shared and merged.q_proj._group._pending is None
    torchport_quantize = torchport.quantize  # the top-level name takes merge= too
    assert quant.merged_groups(torchport_quantize(Layer(), "int8", merge=[("gate_proj", "up_proj")])) == [
        ("gate_proj", "up_proj")]


def test_a_merged_weight_past_the_fused_kernels_limits_runs_layer_by_layer(npu, monkeypatch, caplog):
    # torch_npu's weight-quant matmul takes at most 65535 output features: two layers of 40000 each fit, as one
    # weight they would not, and the merged call would fall back to the reference
    torch.manual_seed(0)
    mlp = nn.Module()
    mlp.gate_proj, mlp.up_proj = (nn.Linear(64, 40000, bias=False) for _ in range(2))
    mlp = mlp.to(npu, torch.bfloat16)
    alone = quant.quantize(copy.deepcopy(mlp), "int4", merge=False)
    quant.quantize(mlp, "int4")
    assert quant.merged_groups(mlp) == [("gate_proj", "up_proj")]
    calls = _count_calls(monkeypatch)
    x = torch.randn(1, 64, device=npu, dtype=torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="torchport"):
        for name in ("gate_proj", "up_proj"):
            assert torch.equal(mlp.get_submodule(name)(x), alone.get_submodule(name)(x))
    assert calls == []
    assert "run on their own" in caplog.text and "65535" in caplog.text
    assert "using the reference" not in caplog.text


def test_merged_layers_under_inference_mode(device, monkeypatch):
    """Inference tensors keep no version count; merged calls still run, and so do layers quantised inside
    ``torch.inference_mode`` (their codes are inference tensors)."""
    if type(torch.empty(0, device=device)) is not torch.Tensor:
        pytest.skip("the simulated NPU's tensor wrapper takes no views under inference_mode (torch refuses to share "
                    "a version counter with an inference wrapper): a limit of the simulation")
    merged, alone = _pair("int4", device)
    calls = _count_calls(monkeypatch)
    with torch.inference_mode():
        x = torch.randn(1, 256, device=device)
        assert _rel(merged(x), alone(x)) <= TOLERANCE[torch.float32]
        assert calls == [256 + 64 + 64, 160 + 160]
        assert merged.q_proj._group.shared and merged.q_proj._group._pending is None
        torch.manual_seed(0)
        inside = quant.quantize(Layer().to(device), "int4")
        # the codes are normal tensors, so that in-place updates to them are counted
        assert not inside.q_proj.qweight.is_inference() and quant.merged_groups(inside)
        calls.clear()
        assert _rel(inside(x), alone(x)) <= TOLERANCE[torch.float32]
        assert calls == [256 + 64 + 64, 160 + 160]


def test_layers_moved_inside_inference_mode_keep_counted_tensors_and_their_caches(device, monkeypatch):
    """A quantised model emptied (or moved) and loaded inside ``torch.inference_mode`` holds normal tensors, not
    inference tensors, which keep no count of in-place writes and so would make the merged weights and the launch
    plans be built again at every call; an in-place load is still seen by the next call."""
    if type(torch.empty(0, device=device)) is not torch.Tensor:
        pytest.skip("the simulated NPU's tensor wrapper takes no views under inference_mode: a limit of the "
                    "simulation (see test_merged_layers_under_inference_mode)")
    merged, alone = _pair("int4", device)
    state = merged.state_dict()
    x = torch.randn(1, 256, device=device)
    with torch.inference_mode():
        model = copy.deepcopy(merged).to("meta").to_empty(device=device)
        model.load_state_dict(state)
        layers = quant.quantized_modules(model).values()
        assert not any(t.is_inference() for layer in layers for t in layer.tensors().values())
        assert _rel(model(x), alone(x)) <= TOLERANCE[torch.float32]
        group = model.q_proj._group
        kept = group.tensors()
        assert not any(t.is_inference() for t in kept.values())
        assert not any(t.is_inference() for layer in layers for t in layer.tensors().values())
        calls = _count_calls(monkeypatch)
        assert _rel(model(x), alone(x)) <= TOLERANCE[torch.float32]
        assert group.tensors() is kept and calls == [256 + 64 + 64, 160 + 160]
        # a state-dict load in place (other codes) is counted: the next call merges the new codes
        other = quant.quantize(Layer().to(device), "int4")
        model.load_state_dict(other.state_dict())
        assert group.tensors() is not kept
        assert _rel(model(x), other(x)) <= TOLERANCE[torch.float32]


@torch.no_grad()
def test_copies_offloaded_biases_and_deleted_models(device, monkeypatch):
    merged, alone = _pair("int8", device)
    calls = _count_calls(monkeypatch)
    x = torch.randn(1, 256, device=device)
    # a shallow copy of a layer (nn.DataParallel's replicas) shares the group but is not one of its members
    replica = copy.copy(merged.k_proj)
    assert replica._group is merged.k_proj._group and torch.equal(replica(x), alone.k_proj(x))
    assert calls == []
    # a bias left on the meta device by an offloading hook until its layer's own call: that call runs on its own
    bias = merged.v_proj.bias
    merged.v_proj.bias = nn.Parameter(torch.empty_like(bias, device="meta"))
    assert _rel(merged.q_proj(x), alone.q_proj(x)) <= TOLERANCE[torch.float32] and calls == []
    merged.v_proj.bias = bias
    # a bias changed in place is seen by the next merged call (no copy of it is kept)
    merged.k_proj.bias.add_(1.0)
    alone.k_proj.bias.add_(1.0)
    assert _rel(merged(x), alone(x)) <= TOLERANCE[torch.float32] and len(calls) == 2
    # moving the layers lets go of the merged tensors at once
    assert merged.q_proj._group._merged
    merged.to(torch.float64)
    assert not merged.q_proj._group._merged
    # the layers and their group form no reference cycle: a deleted model is freed at once
    layer = weakref.ref(merged.q_proj)
    group = weakref.ref(merged.q_proj._group)
    gc.disable()
    try:
        del merged, replica, bias
        assert layer() is None and group() is None
    finally:
        gc.enable()
