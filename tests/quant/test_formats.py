"""The formats' quantise -> dequantise round trips against float64: exact on representable values, bounded otherwise."""

from __future__ import annotations

import pytest
import torch

from torchport.quant import formats
from torchport.quant.formats import QuantizationError, e2m1_decode, e2m1_encode, get_format

E2M1 = torch.tensor(formats.E2M1_VALUES, dtype=torch.float64)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _round_trip(name: str, weight: torch.Tensor, group: int | None = None) -> torch.Tensor:
    fmt = get_format(name)
    return fmt.dequantize(fmt.quantize(weight, fmt.group_size(group, weight.shape[1])), torch.float64)


def test_e2m1_codes_decode_and_encode_back():
    codes = torch.arange(16, dtype=torch.uint8)
    values = e2m1_decode(codes, torch.float64)
    assert values[:8].tolist() == list(formats.E2M1_VALUES)
    assert values[8:].tolist() == [-v for v in formats.E2M1_VALUES]
    expected = codes.clone()
    expected[8] = 0  # -0 is encoded as +0
    assert torch.equal(e2m1_encode(values), expected)


def test_e2m1_rounds_to_nearest_ties_to_even():
    midpoints = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float64)
    expected = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0], dtype=torch.float64)
    assert torch.equal(e2m1_decode(e2m1_encode(midpoints), torch.float64), expected)
    assert torch.equal(e2m1_decode(e2m1_encode(-midpoints), torch.float64), -expected)
    assert e2m1_decode(e2m1_encode(torch.tensor([7.9, 100.0])), torch.float64).tolist() == [6.0, 6.0]  # saturates


def test_nibbles_pack_and_unpack():
    codes = torch.randint(0, 16, (5, 12), generator=_gen(), dtype=torch.uint8)
    packed = formats.pack_nibbles(codes)
    assert packed.shape == (5, 6) and packed.dtype == torch.uint8
    assert torch.equal(packed[0, 0], codes[0, 0] | (codes[0, 1] << 4))
    assert torch.equal(formats.unpack_nibbles(packed), codes)


def test_int8_exact_on_representable_values():
    scale = torch.tensor([[2.0**-7], [3.0 / 1024]], dtype=torch.float64)
    q = torch.randint(-127, 128, (2, 96), generator=_gen(), dtype=torch.int64).double()
    q[:, 5] = 127  # the row maximum fixes the scale
    w = (q * scale).float()
    assert torch.equal(_round_trip("int8", w), w.double())


def test_fp8_exact_on_representable_values():
    codes = torch.randint(0, 256, (3, 64), generator=_gen(), dtype=torch.uint8).view(torch.float8_e4m3fn).double()
    codes = torch.nan_to_num(codes, nan=1.0)
    codes[:, 0] = 448.0
    w = (codes * torch.tensor([[1.0], [2.0**-10], [2.0**5]], dtype=torch.float64)).float()
    assert torch.equal(_round_trip("fp8", w), w.double())


def test_int4_exact_on_representable_values():
    group = 32
    q = torch.randint(-8, 8, (4, 128), generator=_gen(), dtype=torch.int64).double()
    q[:, ::group] = -8  # every group spans the whole code range, so its min/max give back scale and offset
    q[:, 1::group] = 7
    scale = 2.0 ** -torch.randint(3, 9, (4, 4), generator=_gen(1)).double()
    offset = torch.randint(-3, 4, (4, 4), generator=_gen(2)).double()
    w = ((q.reshape(4, 4, group) + offset[..., None]) * scale[..., None]).reshape(4, 128)
    assert torch.equal(_round_trip("int4", w.float(), group), w)
    assert torch.equal(_round_trip("int4", w.to(torch.bfloat16), group), w)  # scales stored in bf16, still exact


def test_mxfp4_exact_on_representable_values():
    codes = torch.randint(0, 16, (2, 64), generator=_gen(), dtype=torch.uint8)
    values = e2m1_decode(codes, torch.float64)
    values[:, ::32] = 6.0  # each block's largest magnitude fixes its power-of-two scale
    w = values * torch.tensor([[2.0**-6], [2.0**3]], dtype=torch.float64)
    assert torch.equal(_round_trip("mxfp4", w.float()), w)


def test_nvfp4_exact_on_representable_values():
    codes = torch.randint(0, 16, (2, 64), generator=_gen(), dtype=torch.uint8)
    values = e2m1_decode(codes, torch.float64)
    values[:, ::16] = 6.0
    block = torch.tensor([[448.0, 2.0, 0.5, 104.0], [12.0, 448.0, 1.125, 64.0]], dtype=torch.float64)  # e4m3 values
    tensor_scale = 2.0**-12
    w = (values.reshape(2, 4, 16) * block[..., None] * tensor_scale).reshape(2, 64)
    assert torch.equal(_round_trip("nvfp4", w.float()), w)


# bound on |dequantised - w| per element, as a fraction of the element's scale: half a step (int), the widest
# half-gap of e2m1 (1.0, between 4 and 6) plus saturation of a block maximum in [6, 8) (mxfp4)
@pytest.mark.parametrize("name, steps", [("int8", 0.5), ("int4", 0.5), ("mxfp4", 2.0), ("nvfp4", 1.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_error_is_bounded_by_the_format_step(name, steps, dtype):
    w = (torch.randn(16, 256, generator=_gen(3)) * 0.05).to(dtype)
    fmt = get_format(name)
    t = fmt.quantize(w, fmt.group_size(None, 256))
    err = (fmt.dequantize(t, torch.float64) - w.double()).abs()
    scale = t["scale"].double()
    if name == "mxfp4":
        scale = torch.exp2(scale - 127)
    elif name == "nvfp4":
        scale = t["scale"].float().double() * t["global_scale"].double()
    per_element = scale.repeat_interleave(256 // scale.shape[1], dim=1)
    slack = 1e-2 if dtype == torch.bfloat16 and name == "int4" else 1e-6  # bf16-rounded scale and offset
    assert (err <= per_element * (steps + slack) + 1e-12).all()


@pytest.mark.parametrize("name, limit", [("int8", 0.01), ("fp8", 0.04), ("int4", 0.12), ("mxfp4", 0.16),
                                         ("nvfp4", 0.12)])
def test_relative_error_on_gaussian_weights(name, limit):
    w = torch.randn(64, 512, generator=_gen(4)) * 0.02
    err = (_round_trip(name, w) - w.double()).norm() / w.double().norm()
    assert err < limit


def test_zero_and_constant_rows_survive():
    w = torch.zeros(3, 64)
    w[1] = 0.25
    for name in formats.FORMATS:
        assert torch.equal(_round_trip(name, w), w.double()), name


def test_names_and_group_sizes():
    assert get_format("fp4").name == "nvfp4"
    assert formats.list_formats() == ["int8", "fp8", "int4", "mxfp4", "nvfp4", "fp4"]
    with pytest.raises(QuantizationError, match="unknown quantisation format 'int3'; valid: int8, fp8"):
        get_format("int3")
    assert get_format("int4").group_size(None, 4096) == 128
    assert get_format("int4").group_size(None, 64) == 64  # the default adapts to narrow layers...
    assert get_format("int4").group_size(None, 200) == 100
    assert get_format("int4").group_size(None, 30) == 30
    assert get_format("int8").group_size(None, 96) == 96
    with pytest.raises(QuantizationError, match="does not divide in_features=100"):
        get_format("int4").group_size(128, 100)  # ...an explicit one does not
    with pytest.raises(QuantizationError, match="fixed group size of 32"):
        get_format("mxfp4").group_size(64, 256)
    with pytest.raises(QuantizationError, match="one scale per output channel"):
        get_format("int8").group_size(32, 256)
    with pytest.raises(QuantizationError, match="positive integer"):
        get_format("int4").group_size(0, 256)
    with pytest.raises(QuantizationError, match="must be even"):
        get_format("int4").group_size(3, 99)
    with pytest.raises(ValueError, match="already exists"):
        formats.register_format(get_format("int8"))
