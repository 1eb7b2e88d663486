"""``lowbit_matmul``: every implementation against a float64 matmul with the dequantised weight, per format."""

from __future__ import annotations

import itertools
import os

import pytest
import torch

from torchport.kernels.lowbit_matmul import lowbit_linear
from torchport.quant.formats import get_format
from torchport.testing import npu_fused_ops

from kernel_cases import call, check_close, forced, needs_dtype, needs_fused, on_chip

FORMATS = ["int8", "fp8", "int4", "mxfp4", "nvfp4"]
# (rows, out_features, in_features): one row (the batch-1 decode kernel), a few rows (the tensor-core decode
# kernel), many rows (dequantise + dense matmul); feature counts that are no multiple of the blocks
SHAPES = [(1, 40, 256), (3, 33, 512), (19, 24, 128), (1, 16, 1024)]
NPU_FORMATS = {"int8", "int4"}


def _case(fmt: str, rows: int, n: int, k: int, device: torch.device, dtype: torch.dtype, group: int | None = None):
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    spec = get_format(fmt)
    group = spec.group_size(group if fmt == "int4" else None, k)
    weight = torch.randn(n, k, generator=gen, dtype=torch.float64) * 0.05
    t = {name: v.to(device) for name, v in spec.quantize(weight.to(dtype), group).items()}
    x = torch.randn(rows, k, generator=gen, dtype=torch.float64)
    bias = torch.randn(n, generator=gen, dtype=torch.float64)
    dense = spec.dequantize({name: v.cpu() for name, v in t.items()}, torch.float64)
    return spec, group, t, x, bias, dense


def _need_triton(device: torch.device) -> None:
    if not (device.type == "cuda" or (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")):
        pytest.skip(f"Triton kernels run on cuda, or on the cpu under TRITON_INTERPRET=1; not on {device.type} here")
    pytest.importorskip("triton")


def _skip(impl: str, fmt: str, dtype: torch.dtype, n: int = 8) -> None:
    if impl == "npu" and (fmt not in NPU_FORMATS or dtype == torch.float32):
        pytest.skip(f"npu_weight_quant_batchmatmul takes int8/int4 weights and fp16/bf16 activations, not {fmt}/{dtype}")
    if impl == "npu" and fmt == "int4" and n % 8:
        pytest.skip("torch_npu packs int4 weights eight output features at a time")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_forward_against_float64(fmt, shape, device, dtype, impl):
    rows, n, k = shape
    _skip(impl, fmt, dtype, n)
    spec, group, t, x64, bias64, dense = _case(fmt, rows, n, k, device, dtype)
    calls = npu_fused_ops.calls["npu_weight_quant_batchmatmul"]
    y = call("lowbit_matmul", impl, x64.to(device, dtype), t, spec.name, group, bias64.to(device, dtype),
             spec.dequantize, {})
    if impl == "npu":
        assert npu_fused_ops.calls["npu_weight_quant_batchmatmul"] == calls + 1
    assert y.dtype == dtype and y.device.type == device.type
    check_close("y", y, x64 @ dense.T + bias64, dtype)


@pytest.mark.parametrize("fmt", FORMATS)
def test_backward_against_float64(fmt, device, dtype):
    """Gradients of the input and the bias through the dequantised weight (the codes get none)."""
    spec, group, t, x64, bias64, dense = _case(fmt, 5, 24, 256, device, dtype)
    x = x64.reshape(5, 1, 256).to(device, dtype).requires_grad_()
    bias = bias64.to(device, dtype).requires_grad_()
    dy = torch.randn(5, 1, 24, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    y = lowbit_linear(x, t, spec.name, group, bias, dequantize=spec.dequantize)
    y.backward(dy.to(device, dtype))
    check_close("y", y, x64.reshape(5, 1, 256) @ dense.T + bias64, dtype)
    check_close("dx", x.grad, dy @ dense, dtype)
    check_close("dbias", bias.grad, dy.sum((0, 1)), dtype)


@pytest.mark.parametrize("group", [32, 64, 256])
def test_int4_group_sizes(group, device, impl):
    """Several groups per K block and blocks inside one group; leading dimensions of the input kept."""
    _skip(impl, "int4", torch.bfloat16)
    needs_dtype(device, torch.bfloat16)
    spec, group, t, x64, bias64, dense = _case("int4", 6, 24, 512, device, torch.bfloat16, group)
    x = x64.reshape(2, 3, 512).to(device, torch.bfloat16)
    for rows in (x[:1, :1], x):
        y = call("lowbit_matmul", impl, rows.reshape(-1, 512), t, "int4", group, None, spec.dequantize, {})
        check_close("y", y, rows.reshape(-1, 512).double().cpu() @ dense.T, torch.bfloat16)
        y = lowbit_linear(rows, t, "int4", group, None, dequantize=spec.dequantize)
        assert y.shape == (*rows.shape[:-1], 24)
        check_close("y", y, rows.double().cpu() @ dense.T, torch.bfloat16)


@pytest.mark.parametrize("fmt", FORMATS)
def test_triton_decode_kernels_every_launch_configuration(fmt, device):
    """The one-row kernels, the 2-16-row choices and prefill's under each autotuning candidate (the tuner would time
    them on a GPU), on feature counts that fill no block evenly."""
    _need_triton(device)
    from torchport.kernels.triton import lowbit, lowbit_tuning

    # (3 rows: bucket 4, where all the decode kernels compete; 19 rows: prefill's)
    for rows, n, k in ((1, 20, 512), (3, 20, 512), (1, 16, 1024), (19, 20, 256)):
        spec, group, t, x64, bias64, dense = _case(fmt, rows, n, k, device, torch.float32)
        x, bias = x64.to(device, torch.float32), bias64.to(device, torch.float32)
        tensor_cores = {lowbit_tuning.INT4_MMA} if fmt == "int4" else set()  # groups of 128 here
        if rows == 1:
            configs, launch = lowbit_tuning.gemv_candidates(fmt, n, k, group), lowbit._launch_gemv
            expected = {lowbit_tuning.GEMV, lowbit_tuning.GEMV_TILED} | tensor_cores
        elif rows <= lowbit_tuning.DECODE_ROWS:
            configs, launch = lowbit_tuning.candidates(fmt, rows, n, k, group), lowbit._launch
            expected = {lowbit_tuning.GEMM, lowbit_tuning.MMA, lowbit_tuning.ROWS, lowbit_tuning.DENSE} | tensor_cores
        else:
            configs, launch = lowbit_tuning.prefill_candidates(fmt, rows, n, k, group), lowbit._launch
            expected = {lowbit_tuning.GEMM, lowbit_tuning.DENSE}
        kernels = {config.get("KERNEL") for config in configs}
        assert kernels == expected, kernels
        for config in configs:
            y = launch(config, x, t, fmt, group, bias)
            check_close(f"{fmt} {config}", y, x64 @ dense.T + bias64, torch.float32)


@pytest.mark.parametrize("fmt", FORMATS)
def test_triton_split_k_sums_every_partial(fmt, device):
    """K split over programs, the last one of each output tile summing the partials: uneven ranges (K not a multiple
    of the split), output features that fill no block, several rows, and calls repeated on the same workspace (the
    tile counters must be back at zero after each launch)."""
    _need_triton(device)
    from torchport.kernels.triton import lowbit, lowbit_tuning

    for rows, n, k in ((1, 21, 640), (3, 13, 384)):
        spec, group, t, x64, bias64, dense = _case(fmt, rows, n, k, device, torch.float32)
        x, bias = x64.to(device, torch.float32), bias64.to(device, torch.float32)
        expected = x64 @ dense.T + bias64
        configs = [{"KERNEL": lowbit_tuning.GEMV, "BLOCK_N": 8, "BLOCK_W": 32, "num_warps": 4, "SPLIT": split,
                    "PREFETCH": prefetch} for split, prefetch in ((3, 0), (4, 1), (8, 0))]
        configs += [{"KERNEL": lowbit_tuning.GEMM, "BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 64, "num_warps": 4}]
        for config in configs:
            for _ in range(2):
                y = lowbit._launch_words(config, x, t, fmt, group, bias) if config["KERNEL"] == lowbit_tuning.GEMV else \
                    lowbit._launch_gemm(config, x, t, fmt, group, bias)
                check_close(f"{fmt} {config}", y, expected, torch.float32)
    for _, counters in lowbit._WORKSPACES.values():
        assert not counters.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_triton_int4_tensor_core_kernel(dtype, device):
    """The int4 tensor-core kernel (codes decoded in pairs, its own K order for both operands, the decode offset
    undone per group) on 1, 3 and 16 rows, groups of 64-256, output features that fill no block, with and without a
    bias, K split unevenly and calls repeated on the same workspace; every candidate the tuner would time."""
    _need_triton(device)
    needs_dtype(device, dtype)
    from torchport.kernels.triton import lowbit, lowbit_tuning

    for rows, n, k, group in ((1, 40, 512, 128), (3, 33, 768, 64), (16, 20, 1024, 256)):
        spec, group, t, x64, bias64, dense = _case("int4", rows, n, k, device, dtype, group)
        x, bias = x64.to(device, dtype), bias64.to(device, dtype)
        configs = lowbit_tuning.int4_mma_candidates("int4", n, k, group)
        assert {c["SPLIT"] for c in configs} >= {1, 2} and {c["KERNEL"] for c in configs} == {lowbit_tuning.INT4_MMA}
        for config in configs:
            for with_bias in (True, False):
                y = lowbit._launch_int4_mma(config, x, t, group, bias if with_bias else None)
                expected = x.double().cpu() @ dense.T + (bias.double().cpu() if with_bias else 0)
                check_close(f"{dtype} {rows}x{n}x{k} g{group} {config} bias={with_bias}", y, expected, dtype)
    for _, counters in lowbit._WORKSPACES.values():
        assert not counters.any()
    assert lowbit_tuning.int4_mma_candidates("int4", 64, 512, 32) == []  # a dot over K = 8: no tensor-core shape
    assert lowbit_tuning.int4_mma_candidates("mxfp4", 64, 512, 32) == []


def test_int4_tensor_core_kernel_is_the_heuristic_on_nvidia_gpus_only(monkeypatch):
    """2-16 rows of int4 in groups of 64-256: on an NVIDIA GPU the tensor-core kernel is the untimed choice, its K
    split giving about four programs per multiprocessor (8 for the q/o, k/v and down layers of an 8B model on 132
    multiprocessors, 2 for gate/up merged, 1 for the LM head); elsewhere, for longer groups and for the other
    formats, the GEMM stays first."""
    pytest.importorskip("triton")
    from torchport.kernels.triton import lowbit_tuning

    splits = {(n, k): lowbit_tuning.int4_mma_heuristic(n, k, 128, 132)["SPLIT"]
              for n, k in ((4096, 4096), (1024, 4096), (4096, 14336), (28672, 4096), (14336, 4096), (128256, 4096),
                           (4096, 512))}
    assert splits == {(4096, 4096): 8, (1024, 4096): 8, (4096, 14336): 8, (28672, 4096): 2, (14336, 4096): 4,
                      (128256, 4096): 1, (4096, 512): 2}
    # always one of the timed candidates (so a cached choice and the untimed one are checked alike)
    for n, k, group, sms in itertools.product((16, 1024, 4096, 28672, 131072), (128, 512, 4096, 16384),
                                              (64, 128, 256), (8, 132, 144)):
        if k >= group:
            assert lowbit_tuning.int4_mma_heuristic(n, k, group, sms) in \
                lowbit_tuning.int4_mma_candidates("int4", n, k, group), (n, k, group, sms)
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(lowbit_tuning, "multiprocessor_count", lambda device: 132)
    monkeypatch.setattr(lowbit_tuning, "nvidia", lambda device: False)  # a ROCm GPU, also called cuda
    assert lowbit_tuning.candidates("int4", 4, 4096, 4096, 128, gpu)[0]["KERNEL"] == lowbit_tuning.GEMM
    monkeypatch.setattr(lowbit_tuning, "nvidia", lambda device: device.type == "cuda")
    first = lowbit_tuning.candidates("int4", 4, 28672, 4096, 128, gpu)
    assert first[0] == lowbit_tuning.int4_mma_heuristic(28672, 4096, 128, 132)
    assert sorted(map(str, first)) == sorted(map(str, lowbit_tuning.candidates("int4", 4, 28672, 4096, 128)))
    assert lowbit_tuning.candidates("int4", 4, 4096, 4096, 32, gpu)[0]["KERNEL"] == lowbit_tuning.GEMM  # K = 8 dots
    assert lowbit_tuning.candidates("int4", 4, 4096, 4096, 1024, gpu)[0]["KERNEL"] == lowbit_tuning.GEMM  # untimed
    assert lowbit_tuning.candidates("mxfp4", 4, 4096, 4096, 32, gpu)[0]["KERNEL"] == lowbit_tuning.GEMM
    assert lowbit_tuning.candidates("int4", 4, 4096, 4096, 128, torch.device("cpu"))[0]["KERNEL"] == \
        lowbit_tuning.GEMM


def test_triton_split_k_replays_in_a_cuda_graph(device):
    """A split-K launch captured in a CUDA graph gives the right output on every replay, for new inputs too: the
    counters are reset by the kernel itself, with no fill kernel in the graph."""
    if device.type != "cuda":
        pytest.skip("CUDA graphs need a CUDA device")
    from torchport.kernels.triton import lowbit, lowbit_tuning

    spec, group, t, x64, _, dense = _case("int4", 1, 1024, 4096, device, torch.bfloat16)
    x = x64.to(device, torch.bfloat16)
    for config in ({"KERNEL": lowbit_tuning.GEMV, "BLOCK_N": 4, "BLOCK_W": 64, "num_warps": 4, "SPLIT": 4,
                    "PREFETCH": 1},
                   {"KERNEL": lowbit_tuning.INT4_MMA, "BLOCK_N": 64, "num_warps": 4, "SPLIT": 8, "PREFETCH": 1}):
        x.copy_(x64.to(device, torch.bfloat16))
        lowbit._launch_gemv(config, x, t, "int4", group, None)  # compiles, makes the workspace
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = lowbit._launch_gemv(config, x, t, "int4", group, None)
        for step in range(3):
            x.copy_(x64.to(device, torch.bfloat16) * (step + 1))
            graph.replay()
            check_close(f"{config} replay {step}", y, (x.double().cpu() @ dense.T), torch.bfloat16)


def test_triton_dequantize_matches_reference(device, monkeypatch):
    _need_triton(device)
    from torchport.kernels.triton import lowbit_dense

    # 17 x 384: the small tiles; 1030 x 2176: the wide 4-bit tiles (16 x 512, nvfp4 on 8 warps), taken where they
    # make 8 programs per multiprocessor (here: one multiprocessor counted, on any device), with a last block of rows
    # and of columns cut short
    monkeypatch.setattr(lowbit_dense, "multiprocessor_count", lambda device: 1)
    for fmt in FORMATS:
        for n, k in ((17, 384), (1030, 2176)):
            spec, group, t, *_ = _case(fmt, 1, n, k, device, torch.bfloat16)
            block_k = lowbit_dense.dequantize_launch(t, fmt, group)[5]["BLOCK_K"]
            if fmt not in ("int8", "fp8") and (device.type == "cpu" or lowbit_dense.nvidia(device)):
                assert block_k == (128 if n == 17 else 512), (fmt, n, k, block_k)
            dense = lowbit_dense.dequantize(t, fmt, group, torch.float32)
            expected = spec.dequantize({name: v.cpu() for name, v in t.items()}, torch.float32)
            torch.testing.assert_close(dense.cpu(), expected, rtol=1e-6, atol=0, msg=f"{fmt} {n} x {k}")


@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
def test_triton_dense_route_in_slices_matches_the_whole_weight(with_bias, device, monkeypatch):
    """A weight whose dense copy passes the dense route's limit is dequantised and multiplied in slices of output
    features (130 features in slices of 32: four whole slices and a short one) with the same result."""
    _need_triton(device)
    from torchport.kernels.triton import lowbit_dense

    monkeypatch.setattr(lowbit_dense, "CHUNK_BYTES", 40 * 256 * 4)  # 40 rows of 256 float32 weights
    monkeypatch.setattr(lowbit_dense, "CHUNK_ALIGN", 16)  # so 32-feature slices
    whole = lowbit_dense.dequantize
    slices = []
    monkeypatch.setattr(lowbit_dense, "dequantize",
                        lambda t, *args: slices.append(t["qweight"].shape[0]) or whole(t, *args))
    for fmt in FORMATS:
        spec, group, t, x, bias, dense = _case(fmt, 20, 130, 256, device, torch.float32)
        x, b = x.to(device, torch.float32), bias.to(device, torch.float32) if with_bias else None
        slices.clear()
        y = lowbit_dense.dense(x, t, fmt, group, b)
        assert slices == [32, 32, 32, 32, 2]
        want = torch.nn.functional.linear(x, whole(t, fmt, group, torch.float32), b)
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{fmt}: {m}")


@pytest.mark.parametrize("rows", [1, 3, 20])
def test_a_call_with_a_cache_is_planned_and_answers_as_the_registry(rows, device):
    """Inference through a cache (a QuantizedLinear's): the chosen implementation's decision is kept per row count,
    dtype and device, and every later call gives what the registry's path gives, on every format."""
    from torchport.kernels import registry

    for fmt in FORMATS:
        spec, group, t, x, bias, dense = _case(fmt, rows, 40, 256, device, torch.float32)
        x, b = x.to(device, torch.float32), bias.to(device, torch.float32)
        want = lowbit_linear(x, t, fmt, group, b, dequantize=spec.dequantize)  # no cache: the registry's path
        cache: dict = {}
        with torch.no_grad():
            got = [lowbit_linear(x, t, fmt, group, b, dequantize=spec.dequantize, cache=cache) for _ in range(3)]
        for y in got:  # split-K sums in float32 atomics: equal up to their order
            torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{fmt}: {m}")
        check_close(fmt, got[-1], x @ dense.to(x.device, torch.float32).T + b, torch.float32)
        if registry.select("lowbit_matmul", x.device).name in ("reference", "triton"):
            assert list(cache["plans"]) == [(rows, torch.float32, x.device)], fmt
        else:  # the vendor's operator keeps the registry's path
            assert "plans" not in cache, fmt


def test_a_plan_follows_the_tensors_and_the_registry_and_steps_aside(device, monkeypatch):
    """A plan is made again for new tensor objects, a new storage behind one, or another implementation object, and
    kept for an equal decoder; a call that needs a gradient takes the registry's path; a plan that fails to be made
    or to run leaves that signature to the registry, and the call still answers."""
    import dataclasses

    from torchport.kernels import lowbit_matmul, registry

    spec, group, t, x, bias, dense = _case("int4", 20, 24, 128, device, torch.float32)
    x, want = x.to(device, torch.float32), x.float() @ dense.float().T
    key = (20, torch.float32, x.device)
    with forced("lowbit_matmul=reference"), torch.no_grad():
        cache: dict = {}
        lowbit_linear(x, t, "int4", group, None, dequantize=spec.dequantize, cache=cache)
        lowbit_linear(x[:3], t, "int4", group, None, dequantize=spec.dequantize, cache=cache)
        first = cache["plans"][key]
        assert first.tensors[0] is t["qweight"] and len(cache["plans"]) == 2
        copy = {name: v.clone() for name, v in t.items()}
        y = lowbit_linear(x, copy, "int4", group, None, dequantize=spec.dequantize, cache=cache)
        assert cache["plans"][key].tensors[0] is copy["qweight"]
        assert list(cache["plans"]) == [key]  # the other signature's plan held the old tensors: dropped
        torch.testing.assert_close(y.cpu(), want, rtol=1e-5, atol=1e-5)
        made = cache["plans"][key]
        # a decoder that compares equal (a bound method is a new object at each access) keeps the plan
        decoders = type("Decoders", (), {"int4": lambda self, t, dtype: spec.dequantize(t, dtype)})()
        lowbit_linear(x, copy, "int4", group, None, dequantize=decoders.int4, cache=cache)
        made = cache["plans"][key]
        lowbit_linear(x, copy, "int4", group, None, dequantize=decoders.int4, cache=cache)
        assert cache["plans"][key] is made
        # a new storage behind the same tensor object
        flipped = copy["qweight"].flip(0).clone()
        copy["qweight"].data = flipped
        y = lowbit_linear(x, copy, "int4", group, None, dequantize=decoders.int4, cache=cache)
        assert cache["plans"][key] is not made
        want_flipped = x.cpu() @ spec.dequantize({n: v.cpu() for n, v in copy.items()}, torch.float32).T
        torch.testing.assert_close(y.cpu(), want_flipped, rtol=1e-5, atol=1e-5)
        chosen = registry.select("lowbit_matmul", x.device)
        other = dataclasses.replace(chosen)
        monkeypatch.setattr(registry, "select", lambda *args, **kwargs: other)
        lowbit_linear(x, copy, "int4", group, None, dequantize=spec.dequantize, cache=cache)
        assert cache["plans"][key].impl is other
        monkeypatch.undo()

        made_plans = []

        def broken(*args):
            made_plans.append(args)

            def run(x, t, bias):
                raise RuntimeError("a launch that fails")
            return run

        def unplannable(*args):
            made_plans.append(args)
            raise RuntimeError("a plan that cannot be made")

        for planner in (broken, unplannable):
            monkeypatch.setitem(lowbit_matmul._PLANNERS, "reference", planner)
            made_plans.clear()
            failing: dict = {}
            for _ in range(3):
                y = lowbit_linear(x, t, "int4", group, None, dequantize=spec.dequantize, cache=failing)
                torch.testing.assert_close(y.cpu(), want, rtol=1e-5, atol=1e-5)
            assert len(made_plans) == 1 and failing["plans"][key].run is None, planner.__name__
    with forced("lowbit_matmul=reference"):
        trained: dict = {}
        xg = x.clone().requires_grad_()
        y = lowbit_linear(xg, t, "int4", group, None, dequantize=spec.dequantize, cache=trained)
        assert "plans" not in trained and y.grad_fn is not None
        y.sum().backward()
        torch.testing.assert_close(xg.grad.cpu(), dense.float().sum(0).expand(20, -1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 3, 20])
def test_triton_plan_launches_what_matmul_launches(rows, device, monkeypatch):
    """``lowbit.plan`` once the tuner has chosen: the same kernels as ``matmul``, twice (the second launch of the
    dense route's dequantise and of the one-row kernel goes through its prepared launcher on a GPU), with another
    bias or row stride, and after the codes change in place."""
    _need_triton(device)
    from torchport.kernels.triton import lowbit

    for fmt in FORMATS:
        spec, group, t, x, bias, dense = _case(fmt, rows, 40, 256, device, torch.float32)
        x, b = x.to(device, torch.float32), bias.to(device, torch.float32)
        want = lowbit.matmul(x, t, fmt, group, b)
        run = lowbit.plan(x, t, fmt, group, b)
        assert run is not None, fmt
        for _ in range(2):
            torch.testing.assert_close(run(x, t, b), want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{fmt}: {m}")
        # another bias, none, and rows that are a strided view: launched as matmul launches them
        torch.testing.assert_close(run(x.clone(), t, None), lowbit.matmul(x, t, fmt, group, None), rtol=1e-5,
                                   atol=1e-5, msg=lambda m: f"{fmt}, no bias: {m}")
        other_bias = lowbit.matmul(x, t, fmt, group, 2 * b)
        if isinstance(run, lowbit._WordsPlan):  # another bias tensor of the plan's dtype: the plan's own launch
            monkeypatch.setattr(lowbit._WordsPlan, "launch", None)
        torch.testing.assert_close(run(x, t, 2 * b), other_bias, rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"{fmt}, another bias tensor: {m}")
        monkeypatch.undo()
        rows_view = torch.zeros(rows, x.shape[1] + 16, device=device)[:, :x.shape[1]]
        rows_view.copy_(x)  # another row stride
        torch.testing.assert_close(run(rows_view, t, b), lowbit.matmul(x, t, fmt, group, b), rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"{fmt}, another row stride: {m}")
        with torch.no_grad():
            t["qweight"].copy_(t["qweight"].flip(0))
        flipped = lowbit.matmul(x, t, fmt, group, b)
        assert not torch.allclose(flipped, want)
        torch.testing.assert_close(run(x, t, b), flipped, rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"{fmt}, codes changed in place: {m}")


def test_triton_declines_groups_its_tiles_cannot_take(device):
    from torchport.kernels import registry

    pytest.importorskip("triton")
    spec = get_format("int4")
    t = spec.quantize(torch.randn(8, 96), 24)
    x = torch.randn(2, 96)
    with pytest.raises(registry.Unsupported, match="power-of-two group"):
        registry.implementation("lowbit_matmul", "triton").fn(x, t, "int4", 24, None, spec.dequantize, {})
    # the public path still answers, through the reference
    with forced("lowbit_matmul=reference"):
        y = lowbit_linear(x, t, "int4", 24, None, dequantize=spec.dequantize)
    torch.testing.assert_close(y, x @ spec.dequantize(t, torch.float32).T)


def test_npu_repacks_int4_once_per_weight(npu):
    needs_dtype(npu, torch.bfloat16)
    needs_fused(npu, "npu_convert_weight_to_int4pack")
    spec = get_format("int4")
    t = {n: v.to(npu) for n, v in spec.quantize(torch.randn(16, 128, dtype=torch.bfloat16), 64).items()}
    x = torch.randn(3, 128, dtype=torch.bfloat16).to(npu)
    cache: dict = {}
    packs = npu_fused_ops.calls["npu_convert_weight_to_int4pack"]
    matmuls = npu_fused_ops.calls["npu_weight_quant_batchmatmul"]
    with forced("lowbit_matmul=npu"):
        for _ in range(3):
            lowbit_linear(x, t, "int4", 64, None, dequantize=spec.dequantize, cache=cache)
    assert npu_fused_ops.calls["npu_convert_weight_to_int4pack"] == packs + 1
    assert npu_fused_ops.calls["npu_weight_quant_batchmatmul"] == matmuls + 3


def test_feature_mismatch_is_an_error():
    spec = get_format("int8")
    t = spec.quantize(torch.randn(8, 64), 64)
    with pytest.raises(ValueError, match="x has 32 features, the weight takes 64"):
        lowbit_linear(torch.randn(2, 32), t, "int8", 64, None, dequantize=spec.dequantize)


def test_triton_decodes_every_code_exactly(device):
    """All 16 e2m1 codes, all finite e4m3 bytes (subnormals included) and all int8/int4 codes, through the kernels'
    integer decoders, against the reference decoders, in float32."""
    _need_triton(device)
    from torchport.kernels.triton import lowbit

    every_byte = torch.arange(256, dtype=torch.int64)
    cases = {
        "int8": {"qweight": (every_byte - 128).to(torch.int8).reshape(8, 32), "scale": torch.ones(8, 1)},
        "fp8": {"qweight": every_byte[every_byte % 128 != 127].to(torch.uint8).view(torch.float8_e4m3fn)
                [:224].reshape(7, 32), "scale": torch.ones(7, 1)},
        "int4": {"qweight": every_byte.to(torch.uint8).reshape(4, 64), "scale": torch.ones(4, 1),
                 "offset": torch.zeros(4, 1)},
        "mxfp4": {"qweight": every_byte.to(torch.uint8).reshape(4, 64), "scale": torch.full((4, 4), 127, dtype=torch.uint8)},
        "nvfp4": {"qweight": every_byte.to(torch.uint8).reshape(4, 64),
                  "scale": torch.ones(4, 8).to(torch.float8_e4m3fn), "global_scale": torch.ones(())},
    }
    groups = {"int8": 32, "fp8": 32, "int4": 128, "mxfp4": 32, "nvfp4": 16}
    for fmt, t in cases.items():
        t = {name: v.to(device) for name, v in t.items()}
        ref = get_format(fmt).dequantize({n: v.cpu() for n, v in t.items()}, torch.float32)
        got = lowbit.dequantize(t, fmt, groups[fmt], torch.float32).cpu()
        assert torch.equal(got, ref), fmt
        eye = torch.eye(ref.shape[1], device=device)
        for column in (*range(16), ref.shape[1] - 1):  # every byte / nibble position of a word, read back one by one
            got = lowbit.matmul(eye[column:column + 1], t, fmt, groups[fmt], None).cpu()[0]
            assert torch.equal(got, ref[:, column]), (fmt, column)


def test_npu_repacks_after_the_weights_change_in_place(npu):
    """A state-dict load copies new codes into the same storage: the cached repacked weight must not outlive them."""
    needs_dtype(npu, torch.bfloat16)
    needs_fused(npu, "npu_convert_weight_to_int4pack")
    spec = get_format("int4")
    first = spec.quantize(torch.randn(16, 128, dtype=torch.bfloat16), 64)
    second = spec.quantize(torch.randn(16, 128, dtype=torch.bfloat16), 64)
    t = {n: v.to(npu) for n, v in first.items()}
    x = torch.randn(3, 128, dtype=torch.bfloat16).to(npu)
    cache: dict = {}
    with forced("lowbit_matmul=npu"):
        lowbit_linear(x, t, "int4", 64, None, dequantize=spec.dequantize, cache=cache)
        for name, value in second.items():
            t[name].copy_(value.to(npu))
        y = lowbit_linear(x, t, "int4", 64, None, dequantize=spec.dequantize, cache=cache)
    check_close("y", y, x.cpu().double() @ spec.dequantize(second, torch.float64).T, torch.bfloat16)


def test_npu_layers_outside_the_operator_take_the_reference_alone(npu):
    """npu_weight_quant_batchmatmul takes K and N within [1, 65535] and int4 groups of 32·j within [32, K - 1]: a
    layer outside that (a 128256-word LM head, groups of 100) takes the reference with one warning, while the other
    layers keep the operator, and nothing is marked broken."""
    from torchport.kernels import registry

    needs_dtype(npu, torch.bfloat16)
    registry.refresh()
    calls = npu_fused_ops.calls["npu_weight_quant_batchmatmul"]
    x = torch.randn(2, 200, dtype=torch.bfloat16)
    int4 = get_format("int4")
    odd = {n: v.to(npu) for n, v in int4.quantize(torch.randn(16, 200, dtype=torch.bfloat16), 100).items()}
    with pytest.warns(RuntimeWarning, match="takes groups of a multiple of 32 inputs .at least 32., not 100"):
        y = lowbit_linear(x.to(npu), odd, "int4", 100, None, dequantize=int4.dequantize)
    check_close("y", y, x.double() @ int4.dequantize({n: v.cpu() for n, v in odd.items()}, torch.float64).T,
                torch.bfloat16)
    int8 = get_format("int8")
    head = {n: v.to(npu) for n, v in int8.quantize(torch.randn(65536, 32, dtype=torch.bfloat16), 32).items()}
    with pytest.warns(RuntimeWarning, match=r"takes in and out features within \[1, 65535\], not 32 and 65536"):
        y = lowbit_linear(torch.randn(1, 32, dtype=torch.bfloat16).to(npu), head, "int8", 32, None,
                          dequantize=int8.dequantize)
    assert y.shape == (1, 65536) and npu_fused_ops.calls["npu_weight_quant_batchmatmul"] == calls
    fine = {n: v.to(npu) for n, v in int4.quantize(torch.randn(16, 256, dtype=torch.bfloat16), 64).items()}
    lowbit_linear(torch.randn(2, 256, dtype=torch.bfloat16).to(npu), fine, "int4", 64, None,
                  dequantize=int4.dequantize)
    assert npu_fused_ops.calls["npu_weight_quant_batchmatmul"] == calls + 1 and not registry._broken
    with pytest.raises(RuntimeError, match=r"antiquant_group_size must be 0 or a multiple of 32 within \[32, K - 1"):
        npu_fused_ops.npu_weight_quant_batchmatmul(
            x.to(npu), torch.zeros(200, 16, dtype=torch.int8).to(npu), torch.ones(2, 16, dtype=torch.bfloat16).to(npu),
            antiquant_group_size=100)


def test_npu_310p_runs_int8_in_fp16_only(npu):
    int8, int4 = get_format("int8"), get_format("int4")
    w8 = {n: v.to(npu) for n, v in int8.quantize(torch.randn(16, 64), 64).items()}
    w4 = {n: v.to(npu) for n, v in int4.quantize(torch.randn(16, 64, dtype=torch.float16), 32).items()}
    x = torch.randn(2, 64, dtype=torch.float16)
    with on_chip("Ascend310P3"):
        calls = npu_fused_ops.calls["npu_weight_quant_batchmatmul"]
        lowbit_linear(x.to(npu), w8, "int8", 64, None, dequantize=int8.dequantize)
        assert npu_fused_ops.calls["npu_weight_quant_batchmatmul"] == calls + 1
        with pytest.warns(RuntimeWarning, match="takes no int4 weights on Ascend310P3"):
            y = lowbit_linear(x.to(npu), w4, "int4", 32, None, dequantize=int4.dequantize)
        check_close("y", y, x.double() @ int4.dequantize({n: v.cpu() for n, v in w4.items()}, torch.float64).T,
                    torch.float16)
        assert npu_fused_ops.calls["npu_weight_quant_batchmatmul"] == calls + 1


@pytest.mark.parametrize("vendor, expected", [("NVIDIA", True), ("AMD", False), (None, False)])
def test_the_ptx_decode_is_only_for_nvidia_gpus(vendor, expected, monkeypatch):
    """The int4 tensor-core kernel's ``lop3`` is PTX: ROCm devices, which torch also calls ``cuda``, and the host
    take its integer decode."""
    pytest.importorskip("triton")
    from torchport.backends import get_backend
    from torchport.kernels import triton as kernels_triton

    props = {} if vendor is None else {"vendor": vendor}
    monkeypatch.setattr(get_backend("cuda"), "properties", lambda index: props)
    kernels_triton._vendor.cache_clear()
    try:
        assert kernels_triton.nvidia(torch.device("cuda", 0)) is expected
        assert kernels_triton.nvidia(torch.device("cpu")) is False
    finally:
        kernels_triton._vendor.cache_clear()
