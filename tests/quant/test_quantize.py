"""``torchport.quantize`` and ``QuantizedLinear`` on every device, save/load, and the errors of bad requests."""

from __future__ import annotations

import copy
import io
import logging
import pickle

import pytest
import torch
from torch import nn

import torchport
from torchport import quant
from torchport.backends import get_backend
from torchport.quant import QuantizationError, QuantizedLinear

FORMATS = ["int8", "fp8", "int4", "mxfp4", "nvfp4"]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(64, 96)
        self.down = nn.Linear(96, 32, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 64)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(32, 50, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)[..., :64].repeat(1, 1, 2)[..., :64]
        return self.head(x[..., :32])


def _model(device: torch.device, dtype: torch.dtype = torch.float32) -> Tiny:
    torch.manual_seed(0)
    return Tiny().to(device, dtype)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double().cpu() - b.double().cpu()).norm() / b.double().cpu().norm()).item()


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_linear_matches_the_dequantised_matmul(fmt, device, dtype):
    torch.manual_seed(1)
    linear = nn.Linear(256, 40).to(device, dtype)
    layer = QuantizedLinear.from_linear(linear, fmt)
    x = torch.randn(2, 3, 256, device=device, dtype=dtype)
    y = layer(x)
    ref = x.double().cpu() @ layer.dequantized_weight(torch.float64).cpu().T + linear.bias.double().cpu()
    assert y.shape == (2, 3, 40) and y.dtype == dtype and y.device.type == device.type
    assert _rel(y, ref) <= TOLERANCE[dtype]
    assert layer.bias is linear.bias


def test_quantize_replaces_the_selected_layers(device):
    model = _model(device)
    tokens = torch.randint(0, 50, (2, 5), device=device)
    before = model(tokens)
    out = torchport.quantize(model, "int8", modules="blocks.*")
    assert out is model
    assert sorted(quant.quantized_modules(model)) == ["blocks.0.down", "blocks.0.up", "blocks.1.down", "blocks.1.up"]
    assert type(model.head) is nn.Linear
    assert _rel(model(tokens), before) < 0.02
    model = _model(device)
    torchport.quantize(model, "int4", group_size=32, modules=lambda name, m: name.endswith("up"))
    assert sorted(quant.quantized_modules(model)) == ["blocks.0.up", "blocks.1.up"]
    assert model.blocks[0].up.group_size == 32


def test_a_bare_linear_layer_comes_back_quantised():
    layer = torchport.quantize(nn.Linear(64, 8), "nvfp4")
    assert isinstance(layer, QuantizedLinear) and layer.format == "nvfp4" and layer.group_size == 16
    assert quant.get_format("fp4").name == "nvfp4"


def test_memory_of_4_bit_layers():
    model = nn.Sequential(nn.Linear(1024, 1024, bias=False), nn.Linear(1024, 1024, bias=False)).to(torch.bfloat16)
    dense = quant.weight_bytes(model)
    torchport.quantize(model, "int4")
    assert quant.weight_bytes(model) / dense == pytest.approx(4.25 / 16)


def test_errors_leave_the_model_untouched():
    model = _model(torch.device("cpu"))
    with pytest.raises(QuantizationError, match=r"unknown quantisation format 'int5'; valid: int8, fp8, int4"):
        torchport.quantize(model, "int5")
    with pytest.raises(QuantizationError, match=r"layer 'blocks.0.up': group size 48 .* does not divide in_features=64"):
        torchport.quantize(model, "int4", group_size=48)
    with pytest.raises(QuantizationError, match="fixed group size of 32"):
        torchport.quantize(model, "mxfp4", group_size=64)
    with pytest.raises(QuantizationError, match=r"modules \['mlp\.\*'\] match no nn.Linear .* blocks.0.up"):
        torchport.quantize(model, "int8", modules=["mlp.*"])
    with pytest.raises(QuantizationError, match="has no nn.Linear"):
        torchport.quantize(nn.ReLU(), "int8")
    assert not quant.quantized_modules(model)
    torchport.quantize(model, "int8")
    with pytest.raises(QuantizationError, match="quantised already"):
        torchport.quantize(model, "int4")


def test_tied_weights_are_left_alone_with_a_warning(caplog):
    model = _model(torch.device("cpu"))
    model.head = nn.Linear(64, 50, bias=False)
    model.head.weight = model.embed.weight
    with caplog.at_level(logging.WARNING, logger="torchport"):
        torchport.quantize(model, "int8")
    assert "head" in caplog.text and "tied" in caplog.text
    assert type(model.head) is nn.Linear and model.head.weight is model.embed.weight


def test_a_format_the_device_cannot_run_is_an_error(monkeypatch):
    def broken(self, x):
        raise RuntimeError("no float8 kernels on this device")

    monkeypatch.setattr(quant, "_probed", {})
    monkeypatch.setattr(QuantizedLinear, "forward", broken)
    with pytest.raises(QuantizationError, match="format 'fp8' cannot run on cpu here .*no float8 kernels"):
        torchport.quantize(_model(torch.device("cpu")), "fp8")


def test_dtype_conversion_keeps_the_codes_and_moves_follow(device):
    layer = QuantizedLinear.from_linear(nn.Linear(64, 16), "fp8")
    codes = layer.qweight.clone()
    layer.half()
    assert layer.qweight.dtype == torch.float8_e4m3fn and torch.equal(layer.qweight.view(torch.uint8),
                                                                       codes.view(torch.uint8))
    assert layer.dtype == torch.float16 and layer.bias.dtype == torch.float16
    layer.to(device)
    assert layer.qweight.device.type == device.type and layer.scale.device.type == device.type
    x = torch.randn(3, 64, dtype=torch.float16, device=device)
    assert _rel(layer(x), x.double().cpu() @ layer.dequantized_weight(torch.float64).cpu().T
                + layer.bias.double().cpu()) < 2e-3


@pytest.mark.parametrize("fmt", FORMATS)
def test_safetensors_save_and_load(fmt, tmp_path, device):
    if not get_backend(device.type).dtype_works(torch.bfloat16, device.index or 0):
        pytest.skip(f"bfloat16 does not work on {device} (dtype probe)")
    model = _model(device, torch.bfloat16)
    torchport.quantize(model, fmt, modules="blocks.*")
    tokens = torch.randint(0, 50, (2, 5), device=device)
    expected = model(tokens)
    path = tmp_path / "model.safetensors"
    quant.save(model, path)
    with torch.device("meta"):
        fresh = Tiny().to(torch.bfloat16)
    quant.load(fresh, path, device=device)
    assert sorted(quant.quantized_modules(fresh)) == sorted(quant.quantized_modules(model))
    assert torch.equal(fresh(tokens), expected)
    dense = _model(device, torch.bfloat16)  # an ordinary model, on the device already
    torch.nn.init.zeros_(dense.embed.weight)
    assert torch.equal(quant.load(dense, path)(tokens), expected)


def test_torch_save_round_trip():
    model = _model(torch.device("cpu"))
    torchport.quantize(model, "int4", group_size=32)
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    other = _model(torch.device("cpu"))
    torchport.quantize(other, "int4", group_size=32)
    buffer.seek(0)
    other.load_state_dict(torch.load(buffer))
    tokens = torch.randint(0, 50, (1, 4))
    assert torch.equal(other(tokens), model(tokens))


def test_load_errors(tmp_path):
    from safetensors.torch import save_file

    plain = tmp_path / "plain.safetensors"
    save_file({"x": torch.zeros(2)}, plain)
    with pytest.raises(QuantizationError, match="not written by torchport.quant.save"):
        quant.load(_model(torch.device("cpu")), plain)
    model = _model(torch.device("cpu"))
    torchport.quantize(model, "int8")
    path = tmp_path / "q.safetensors"
    quant.save(model, path)
    wrong = nn.Sequential(nn.Linear(64, 8))
    with pytest.raises(QuantizationError, match="quantised layers the model lacks"):
        quant.load(wrong, path)
    other = _model(torch.device("cpu"))
    torchport.quantize(other, "int4", group_size=32)
    with pytest.raises(QuantizationError, match="is quantised as int4/32; the file holds int8"):
        quant.load(other, path)


def test_dequantize_gives_back_dense_layers():
    model = _model(torch.device("cpu"))
    torchport.quantize(model, "int8")
    tokens = torch.randint(0, 50, (2, 3))
    expected = model(tokens)
    quant.dequantize(model)
    assert not quant.quantized_modules(model)
    torch.testing.assert_close(model(tokens), expected, rtol=1e-5, atol=1e-6)
    torchport.quantize(model, "int4")  # dense again: it quantises


def test_activation_checkpointing_through_quantised_layers(device):
    """Non-reentrant checkpointing stops its recomputation by raising inside the op running then; a fused kernel
    between quantised layers must let that through (it used to be taken for a kernel failure)."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(3)
    gate = QuantizedLinear.from_linear(nn.Linear(64, 96, bias=False).to(device), "int4")
    up = QuantizedLinear.from_linear(nn.Linear(64, 96, bias=False).to(device), "int4")
    down = QuantizedLinear.from_linear(nn.Linear(96, 64).to(device), "int4")  # saves no tensor of its own

    def mlp(x: torch.Tensor) -> torch.Tensor:
        return down(torchport.kernels.swiglu(gate(x), up(x)))

    x = torch.randn(4, 64, device=device, requires_grad=True)
    mlp(x).sum().backward()
    expected = (x.grad.clone(), down.bias.grad.clone())
    x.grad, down.bias.grad = None, None
    checkpoint(mlp, x, use_reentrant=False).sum().backward()
    torch.testing.assert_close(x.grad, expected[0])
    torch.testing.assert_close(down.bias.grad, expected[1])


def test_dequantised_weight_cache_for_prefill(device):
    """Off by default (no dense copy held); on, more than 16 rows use one dense weight, made again after the codes
    change in place, while up to 16 rows keep the fused decode path and the same results."""
    torch.manual_seed(0)
    layer = QuantizedLinear.from_linear(nn.Linear(64, 24).to(device), "int4", 32)
    x = torch.randn(20, 64, device=device)
    y = layer(x)
    assert "dense" not in layer._cache
    layer.cache_dequantized = True
    torch.testing.assert_close(layer(x), y)
    dense = layer._cache["dense"][1]
    layer(x[:3])
    layer(x)
    assert layer._cache["dense"][1] is dense
    with torch.no_grad():
        layer.qweight.copy_(torch.flip(layer.qweight, (0,)))
    torch.testing.assert_close(layer(x), x @ layer.dequantized_weight().T + layer.bias)
    assert layer._cache["dense"][1] is not dense
    layer.cache_dequantized = False
    layer(x[:1])
    assert "dense" not in layer._cache


def test_inference_calls_keep_a_plan_until_the_layer_moves(device):
    """Calls without gradients keep the chosen implementation's decision in the layer (where the registry's choice
    can plan it); in-place updates of the codes are seen, and a dtype change or move drops the plans."""
    from torchport.kernels import registry

    torch.manual_seed(0)
    layer = QuantizedLinear.from_linear(nn.Linear(64, 24).to(device), "int4", 32)
    x = torch.randn(20, 64, device=device)
    planned = registry.select("lowbit_matmul", x.device).name in ("reference", "triton")
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(layer(x), x @ layer.dequantized_weight().T + layer.bias)
        assert ("plans" in layer._cache) == planned
        layer.qweight.copy_(torch.flip(layer.qweight, (0,)))
        torch.testing.assert_close(layer(x), x @ layer.dequantized_weight().T + layer.bias)
        assert pickle.loads(pickle.dumps(layer))._cache == {}  # copies carry the codes, not the plans
        assert copy.deepcopy(layer)._cache == {}
        layer.half()
        assert "plans" not in layer._cache
        xh = x.half()
        assert _rel(layer(xh), x.double().cpu() @ layer.dequantized_weight(torch.float64).cpu().T
                    + layer.bias.double().cpu()) < 2e-3


@pytest.mark.parametrize("fmt", ["int4", "nvfp4"])
def test_a_fresh_layer_compiles_as_one_graph(fmt, monkeypatch):
    """torch.compile(fullgraph=True) of a layer never called eagerly: its forward looks nothing up that dynamo cannot
    trace (the format registry's lock), and its graph calls the custom op with the eager result."""
    from torchport.quant import linear

    monkeypatch.setattr(linear, "_DECODERS", {})  # no format's decoder looked up yet, as in a fresh process
    torch._dynamo.reset()
    layer = QuantizedLinear.from_linear(nn.Linear(256, 64), fmt)
    x = torch.randn(2, 17, 256)
    got = torch.compile(layer, backend="eager", fullgraph=True)(x)
    torch.testing.assert_close(got, layer(x))
    assert set(layer.tensors()) == set(layer.state_dict()) - {"bias"}
    torch._dynamo.reset()
