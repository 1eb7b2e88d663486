"""The direct Triton launch (``kernels/triton/launch.py``): its key separates exactly what Triton compiles apart, a
bound kernel gets the arguments Triton's own launch passes, and what cannot be bound keeps Triton's path.

Compiled kernels need a GPU, so on the CPU a recording fake stands in for Triton's launch and its compiled kernel;
on CUDA the real kernels run through the direct path, repeatedly, at new alignments and under CUDA-graph capture.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import triton.language as tl
from triton import knobs
from triton.runtime.jit import JITFunction

from torchport.backends import get_backend
from torchport.kernels import registry
from torchport.kernels.triton import launch


def _kernel(X, Y, n, scale, BLOCK: tl.constexpr, FLAG: tl.constexpr):  # never compiled here
    pass


def _interleaved(X, BLOCK: tl.constexpr, n):
    pass


# -- the specialisation key ----------------------------------------------------------------------------------------
def _triton_class(value):
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend

    return native_specialize_impl(CUDABackend, value, False, True, True)


def test_equal_keys_mean_equal_triton_specialisations():
    """Two arguments with one key always get one specialisation from Triton (so one compiled kernel serves both)."""
    base = torch.zeros(64)
    values = [0, 1, 2, 15, 16, 17, 32, -1, -16, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, -(2**31), -(2**31) - 16,
              2**40, 2**63 - 16, 2**63, 0.0, 1.0, 1e-6, True, False, None,
              base, base[1:], base[4:], base[8:], base[4:], base.to(torch.bfloat16), base.to(torch.bfloat16)[8:],
              base.to(torch.float16)[1:], base.to(torch.int32), base.to(torch.int64)[2:], base.to(torch.int64)[4:]]
    for a, b in itertools.combinations_with_replacement(values, 2):
        if launch.specialisation((a,)) == launch.specialisation((b,)):
            assert _triton_class(a) == _triton_class(b), (a, b, launch.specialisation((a,)))
    # what a compiled kernel depends on gets its own key (1 vs True vs 1.0: the same value, three specialisations)
    keys = {launch.specialisation((v,)) for v in (1, True, 1.0, base, base[1:], base.half())}
    assert len(keys) == 6


# -- binding, with a fake Triton -----------------------------------------------------------------------------------
class _Compiled:
    """Stands in for Triton's CompiledKernel: records every direct launch."""

    function = "cu-function"
    packed_metadata = ("packed",)

    def __init__(self, calls):
        self.calls = calls

    def run(self, *args):
        self.calls.append(("direct", args))


class _Driver:
    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return 1234


@pytest.fixture
def fake_triton(monkeypatch):
    """Triton's launch replaced by a recorder; returns the list of calls (("triton", grid, args, meta) or
    ("direct", launcher args))."""
    calls = []
    compiled = _Compiled(calls)

    def run(self, *args, grid, warmup, **kwargs):
        calls.append(("triton", grid, args, kwargs))
        return compiled

    monkeypatch.setattr(JITFunction, "run", run)
    monkeypatch.setattr(launch.driver, "_active", _Driver())
    return calls


def test_a_specialisation_launches_through_triton_once_then_directly(fake_triton):
    kernel = launch.Kernel(JITFunction(_kernel))
    x, y = torch.zeros(32), torch.zeros(32)
    kernel.launch((3,), x, y, 32, 0.5, BLOCK=16, FLAG=True, num_warps=4)
    assert fake_triton == [("triton", (3,), (x, y, 32, 0.5), {"BLOCK": 16, "FLAG": True, "num_warps": 4})]
    fake_triton.clear()
    x2, y2 = torch.zeros(48), torch.zeros(48)
    kernel.launch((5, 2), x2, y2, 32, 0.5, BLOCK=16, FLAG=True, num_warps=4)
    # grid, current stream, the compiled function and metadata, no launch metadata or hooks, then every
    # parameter in order: the runtime arguments and the constexprs' values
    assert fake_triton == [("direct", (5, 2, 1, 1234, "cu-function", ("packed",), None, None, None,
                                       x2, y2, 32, 0.5, 16, True))]


@pytest.mark.parametrize("change", ["alignment", "dtype", "int is 1", "int value", "constexpr", "num_warps"])
def test_a_new_specialisation_goes_through_triton_again(fake_triton, change):
    kernel = launch.Kernel(JITFunction(_kernel))
    x, y = torch.zeros(64), torch.zeros(64)
    args, meta = [x, y, 32, 0.5], {"BLOCK": 16, "FLAG": True, "num_warps": 4}
    kernel.launch((1,), *args, **meta)
    if change == "alignment":
        args[0] = x[1:]
    elif change == "dtype":
        args[1] = y.half()
    elif change == "int is 1":
        args[2] = 1
    elif change == "int value":
        args[2] = 48
    elif change == "constexpr":
        meta["FLAG"] = False
    else:
        meta["num_warps"] = 8
    fake_triton.clear()
    kernel.launch((1,), *args, **meta)
    assert [c[0] for c in fake_triton] == ["triton"]
    fake_triton.clear()
    kernel.launch((1,), *args, **meta)
    assert [c[0] for c in fake_triton] == ["direct"]


def test_launch_hooks_and_unbindable_kernels_keep_tritons_path(fake_triton, monkeypatch):
    x = torch.zeros(8)
    interleaved = launch.Kernel(JITFunction(_interleaved))  # a constexpr before a runtime parameter
    for _ in range(2):
        interleaved.launch((1,), x, 8, BLOCK=8)
    kernel = launch.Kernel(JITFunction(_kernel))
    for _ in range(2):
        kernel.launch((1,), x, x, 8, 1.0, BLOCK=8)  # FLAG not given: nothing bound (it might have a default)
    assert [c[0] for c in fake_triton] == ["triton"] * 4
    fake_triton.clear()
    kernel.launch((1,), x, x, 8, 1.0, BLOCK=8, FLAG=False)

    def hook(metadata):
        return None

    knobs.runtime.launch_exit_hook.add(hook)  # a profiler's hook sees every launch
    try:
        kernel.launch((1,), x, x, 8, 1.0, BLOCK=8, FLAG=False)
    finally:
        knobs.runtime.launch_exit_hook.remove(hook)
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", hook)  # a hook set the old way
    kernel.launch((1,), x, x, 8, 1.0, BLOCK=8, FLAG=False)
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", None)
    kernel.launch((1,), x, x, 8, 1.0, BLOCK=8, FLAG=False)
    assert [c[0] for c in fake_triton] == ["triton", "triton", "triton", "direct"]


def test_a_pre_run_hook_keeps_tritons_path(fake_triton):
    """A kernel's pre-run hooks (``add_pre_run_hook``) run only inside Triton's launch: while it has any, neither
    the bound nor a prepared launch is taken."""
    fn = JITFunction(_kernel)
    kernel = launch.Kernel(fn)
    x = torch.zeros(8)
    kernel.launch((1,), x, x, 8, 1.0, BLOCK=8, FLAG=False)
    prepared = kernel.prepare((1,), x, x, 8, 1.0, BLOCK=8, FLAG=False)
    assert prepared is not None
    fn.add_pre_run_hook(lambda *args, **kwargs: None)
    kernel.launch((1,), x, x, 8, 1.0, BLOCK=8, FLAG=False)
    assert not prepared.launch((x, x, 8, 1.0))
    fn.pre_run_hooks.clear()
    kernel.launch((1,), x, x, 8, 1.0, BLOCK=8, FLAG=False)
    assert prepared.launch((x, x, 8, 1.0))
    assert [c[0] for c in fake_triton] == ["triton", "triton", "direct", "direct"]


def test_a_prepared_launch_calls_the_launcher_with_the_new_arguments(fake_triton, monkeypatch):
    kernel = launch.Kernel(JITFunction(_kernel))
    x, y = torch.zeros(32), torch.zeros(32)
    meta = {"BLOCK": 16, "FLAG": True, "num_warps": 4}
    assert kernel.prepare((3,), x, y, 32, 0.5, **meta) is None  # nothing compiled for it yet
    kernel.launch((3,), x, y, 32, 0.5, **meta)
    assert kernel.prepare((3,), x, y, 48, 0.5, **meta) is None  # another specialisation
    prepared = kernel.prepare((3, 2), x, y, 32, 0.5, **meta)
    fake_triton.clear()
    x2, y2 = torch.zeros(64), torch.zeros(64)
    assert prepared.launch((x2, y2, 32, 0.5))
    assert fake_triton == [("direct", (3, 2, 1, 1234, "cu-function", ("packed",), None, None, None,
                                       x2, y2, 32, 0.5, 16, True))]
    fake_triton.clear()

    def hook(metadata):
        return None

    knobs.runtime.launch_enter_hook.add(hook)  # a profiler installed since: the caller must launch through Triton
    try:
        assert not prepared.launch((x2, y2, 32, 0.5))
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    monkeypatch.setattr(_Driver, "get_current_device", lambda self: 1)  # another current device
    assert not prepared.launch((x2, y2, 32, 0.5))
    assert fake_triton == []
    interleaved = launch.Kernel(JITFunction(_interleaved))
    interleaved.launch((1,), x, 8, BLOCK=8)
    assert interleaved.prepare((1,), x, 8, BLOCK=8) is None  # a kernel that keeps Triton's path


# -- the real kernels on CUDA --------------------------------------------------------------------------------------
def _cuda() -> torch.device:
    if not get_backend("cuda").is_available():
        pytest.skip("the direct launch runs compiled kernels: CUDA only (the interpreter keeps Triton's path)")
    return torch.device("cuda")


def _rope(impl):
    def run(x, w):
        heads = x.view(1, x.shape[0], 1, -1)  # [batch 1, rows as heads, seq 1, n]
        table = w.detach().view(1, 1, -1)
        return registry.implementation("rope", impl).fn(heads, heads * 2, table.cos(), table.sin())

    return run


def _ops(impl):
    return {
        "rms_norm": lambda x, w: (registry.implementation("rms_norm", impl).fn(x, w, 1e-6, 0.0),),
        "layer_norm": lambda x, w: (registry.implementation("layer_norm", impl).fn(x, w, w * 0.5, 1e-5),),
        "swiglu": lambda x, w: (registry.implementation("swiglu", impl).fn(x, x * w),),
        "rope": _rope(impl),
    }


def _grads(fn, x, w):
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    outs = fn(x, w)
    sum(o.float().square().sum() for o in outs).backward()
    return [*(o.detach() for o in outs), x.grad, w.grad]


@pytest.mark.parametrize("op", sorted(_ops("reference")))
def test_repeated_calls_at_new_alignments_and_sizes_match_the_reference(op):
    """Each call after the first of a specialisation is a direct launch: new data, a misaligned view (a new
    specialisation), one row (an integer equal to 1), then the first ones again."""
    device = _cuda()
    gen = torch.Generator(device=device).manual_seed(0)
    storage = torch.empty(8 * 64 + 1, device=device)
    for rows, offset in [(8, 0), (8, 0), (8, 1), (8, 1), (1, 0), (1, 0), (1, 1), (8, 0)]:
        storage.normal_(generator=gen)
        x = storage[offset:offset + rows * 64].view(rows, 64)
        w = torch.randn(64, device=device, generator=gen)
        got, want = _grads(_ops("triton")[op], x, w), _grads(_ops("reference")[op], x, w)
        assert len(got) == len(want)
        for g, r in zip(got, want):
            assert (g is None) == (r is None)
            if g is not None:
                torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-4)


def test_directly_launched_kernels_replay_in_a_cuda_graph():
    device = _cuda()
    x = torch.randn(16, 64, device=device)
    w = torch.randn(64, device=device)
    names = sorted(_ops("triton"))
    ops = [_ops("triton")[name] for name in names]
    for _ in range(3):  # compile, bind, launch directly
        for op in ops:
            op(x, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [op(x, w) for op in ops]
    x.copy_(torch.randn_like(x))
    w.copy_(torch.randn_like(w))
    graph.replay()
    torch.cuda.synchronize()
    for name, out in zip(names, outs):
        for o, r in zip(out, _ops("reference")[name](x, w)):
            torch.testing.assert_close(o, r, rtol=1e-4, atol=1e-4)
