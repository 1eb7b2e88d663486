"""The op specs: every consumer sees every op, and every op, built from its spec alone, matches a float64 reference
forward and backward with each implementation that runs on the device."""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any

import pytest
import torch

import torchport.kernels
from torchport.compile import passes
from torchport.kernels import registry
from torchport.kernels.spec import SIZES

from kernel_cases import relative_error

SPECS = registry.list_specs()
BENCHMARKS = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")


def _bench_kernels() -> Any:
    spec = importlib.util.spec_from_file_location("bench_kernels", os.path.join(BENCHMARKS, "bench_kernels.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_every_consumer_sees_every_op() -> None:
    from torchport.kernels import library
    from torchport.ui import kernels as ui_kernels

    ops = set(SPECS)
    assert ops == set(registry.list_kernels())  # every registered op has a spec
    exports = {name for spec in SPECS.values() for name in spec.exports}
    assert exports <= set(torchport.kernels.__all__)
    assert all(getattr(torchport.kernels, name) is not None for name in exports)
    assert all(f"``{op}``" in torchport.kernels.__doc__ for op in ops)
    assert set(ui_kernels.benchmarkable_ops()) == ops
    assert all(ui_kernels.describe_size(op, size) for op in ops for size in ui_kernels.SIZES)
    assert set(_bench_kernels().OPS) == ops
    with_custom_op = {op for op, spec in SPECS.items() if spec.custom_op is not None}
    assert set(library.OPS) == with_custom_op | {f"{op}_backward" for op in with_custom_op}
    assert {p.name for p in passes.list_passes() if p.fusion} <= with_custom_op
    modes = set(registry.kernel_modes())
    assert all(set(registry.list_kernels()[op]) <= modes for op in ops)


@pytest.mark.parametrize("op", list(SPECS))
def test_every_size_makes_inputs_of_the_bytes_counted(op: str) -> None:
    spec = SPECS[op]
    for size in SIZES:
        with torch.device("meta"):
            args = spec.inputs(size)
        assert spec.bytes_moved(*args) > 0 and (spec.flops is None or spec.flops(*args) > 0)
        assert len(args) >= spec.differentiable


def _run(spec: Any, mode: str, args: list[Any], gen: torch.Generator) -> list[torch.Tensor]:
    """Outputs, then the gradients of the differentiable inputs, of ``spec.call`` forced to ``mode``."""
    leaves = [a.detach().clone().requires_grad_() if i < spec.differentiable else a for i, a in enumerate(args)]
    with torchport.settings.override(kernels=f"{spec.name}={mode}"):
        out = spec.call(*leaves)
        outs = list(out) if isinstance(out, tuple) else [out]
        grads = [torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.device, o.dtype) for o in outs]
        torch.autograd.backward(outs, grads)
    return [o.detach() for o in outs] + [leaf.grad for leaf in leaves[:spec.differentiable]]


@pytest.mark.parametrize("op", list(SPECS))
def test_against_float64_reference(op: str, device: torch.device, dtype: torch.dtype, impl: str) -> None:
    spec = SPECS[op]
    if impl not in registry.list_kernels()[op]:
        pytest.skip(f"{op} has no {impl} implementation")
    chosen = registry.implementation(op, impl)
    if not chosen.serves(device.type) or chosen.unavailable_reason(device) is not None:
        pytest.skip(f"{op}: {impl} does not run on {device}")
    host = spec.inputs("test", torch.Generator().manual_seed(0))
    rounded = [t.to(dtype) if t.is_floating_point() else t for t in host]  # both sides see the same inputs
    expected = _run(spec, "reference", [t.double() if t.is_floating_point() else t for t in rounded],
                    torch.Generator().manual_seed(1))
    try:
        got = _run(spec, impl, [t.to(device) for t in rounded], torch.Generator().manual_seed(1))
    except registry.KernelError as exc:
        if isinstance(exc.__cause__, registry.Unsupported):  # outside a vendor operator's limits on this chip
            pytest.skip(str(exc))
        raise
    for index, (out, ref) in enumerate(zip(got, expected)):
        assert out is not None and out.shape == ref.shape, f"{op} output/gradient {index}"
        error = relative_error(out, ref)
        assert error <= spec.tolerance[dtype], f"{op} {impl} output/gradient {index}: {error:.3g} ({dtype})"


@pytest.mark.parametrize("op", list(SPECS))
def test_forward_and_backward_replay_in_a_cuda_graph(op: str, device: torch.device) -> None:
    """Each op, forward and backward, captured in a CUDA graph (what ``torch.compile(mode="reduce-overhead")``
    does): nothing on its path reads the device from the host, and replays with new input values give what an
    eager call gives."""
    if device.type != "cuda":
        pytest.skip("CUDA graphs need a CUDA device")
    spec = SPECS[op]
    args = [t.to(device) for t in spec.inputs("test", torch.Generator().manual_seed(0))]
    leaves = [a.detach().clone().requires_grad_() if i < spec.differentiable else a for i, a in enumerate(args)]

    def run(inputs: list[Any]) -> list[torch.Tensor]:
        out = spec.call(*inputs)
        outs = list(out) if isinstance(out, tuple) else [out]
        grads = torch.autograd.grad(outs, inputs[:spec.differentiable], [torch.ones_like(o) for o in outs])
        return [o.detach() for o in outs] + list(grads)

    run(leaves)  # compiles and tunes the kernels, off the graph
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        run(leaves)  # CUDA graphs want a warm-up on a side stream
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run(leaves)
    for step in range(2):
        with torch.no_grad():
            for leaf, base in zip(leaves[:spec.differentiable], args):
                leaf.copy_(base * (0.5 + step))
        graph.replay()
        fresh = [a.detach().clone().requires_grad_() for a in leaves[:spec.differentiable]]
        expected = run(fresh + leaves[spec.differentiable:])
        for index, (got, want) in enumerate(zip(captured, expected)):
            assert relative_error(got, want) <= 1e-6, f"{op} replay {step}, output/gradient {index}"
