"""The simulated NPU must behave like an accelerator where code under test can tell the difference."""

import copy
import gc
import io
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import torchport.compat
from torchport.backends import get_backend
from torchport.testing import SimulatedTensor

pytestmark = pytest.mark.usefixtures("sim")


@pytest.fixture
def sim(npu: torch.device) -> torch.device:
    if not hasattr(torch.npu, "_torchport_simulated"):
        pytest.skip("a real NPU is present; these tests describe the simulator")
    return npu


def test_tensors_report_the_npu_device(sim: torch.device) -> None:
    x = torch.ones(2, 3, device="npu")
    assert isinstance(x, SimulatedTensor) and x.device == sim and x.is_npu
    assert torch.zeros(3).npu().device == sim and torch.randn(2).to("npu").device.type == "npu"
    assert torch.nn.Linear(2, 2).npu().weight.device == sim
    assert x.cpu().device.type == "cpu" and type(x.cpu()) is torch.Tensor
    assert "device='npu:0'" in repr(x)
    assert x.sum().item() == 6.0 and x.tolist() == [[1.0] * 3] * 2
    with pytest.raises(TypeError, match="can't convert npu:0 device type tensor to numpy"):
        x.numpy()


def test_accelerator_api_sees_it(sim: torch.device) -> None:
    assert torch.accelerator.is_available()
    assert torch.get_device_module("npu") is torch.npu
    assert torch.npu.device_count() >= 1 and torch.npu.get_device_name(0)
    assert torch.npu.get_device_properties(0).total_memory > 0


def test_mixing_devices_fails_like_a_real_accelerator(sim: torch.device) -> None:
    x = torch.ones(4, device="npu")
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device.*cpu and npu:0"):
        x + torch.ones(4)
    assert (x + torch.tensor(2.0)).device == sim  # 0-dim host tensors are scalars, as on CUDA
    assert x[torch.tensor([0, 2])].device == sim  # host index tensors are allowed
    host = torch.zeros(4)
    host.copy_(x)
    assert torch.equal(host, torch.ones(4))


def test_in_place_ops_keep_the_tensor(sim: torch.device) -> None:
    x = torch.zeros(3, device="npu")
    y = x.add_(1)
    assert y is x and torch.equal(x.cpu(), torch.ones(3))
    view = x[1:]
    view.mul_(5)
    assert x.tolist() == [1.0, 5.0, 5.0]


def test_assigning_data_swaps_the_host_data_too(sim: torch.device) -> None:
    """``param.data = other`` (nn.Module's .half() and .to(dtype) after a move to the device) gives the tensor the
    other's dtype and values, as on a real device."""
    layer = torch.nn.Linear(8, 4).to(sim)
    bias = layer.bias
    layer.half()
    assert layer.bias is bias and bias.dtype == torch.float16 and bias._raw.dtype == torch.float16
    x = torch.randn(5, 8, device=sim).half()
    torch.testing.assert_close(layer(x).cpu(), torch.nn.functional.linear(x.cpu(), layer.weight.cpu(), bias.cpu()))
    t = torch.zeros(3, device=sim)
    t.data = torch.arange(3.0, device=sim)
    assert t.tolist() == [0.0, 1.0, 2.0]
    from torchport.testing.npu_state import state

    storages = state().storages  # the memory counters follow the host tensor now behind each one
    assert (sim.index or 0, bias._raw.untyped_storage().data_ptr()) in storages
    assert (sim.index or 0, t._raw.untyped_storage().data_ptr()) in storages
    assert copy.deepcopy(layer).bias.dtype == torch.float16


def test_memory_counters_follow_live_storages(sim: torch.device) -> None:
    gc.collect()
    torch.npu.empty_cache()
    base = torch.npu.memory_allocated()
    torch.npu.reset_peak_memory_stats()
    x = torch.empty(1000, dtype=torch.float32, device="npu")
    assert torch.npu.memory_allocated() == base + 4000
    views = [x[10:], x.view(10, 100), x.t() if x.dim() == 2 else x.unsqueeze(0)]
    assert torch.npu.memory_allocated() == base + 4000  # views share the storage
    del x, views
    gc.collect()
    assert torch.npu.memory_allocated() == base
    assert torch.npu.max_memory_allocated() == base + 4000
    assert torch.npu.memory_reserved() >= base + 4000  # freed bytes stay cached...
    torch.npu.empty_cache()
    assert torch.npu.memory_reserved() < base + 4000 or base > 0  # ...until empty_cache
    free, total = torch.npu.mem_get_info()
    assert free == total - torch.npu.memory_reserved()


def test_out_of_memory(sim: torch.device) -> None:
    torch.npu.set_per_process_memory_fraction(1e-6)
    try:
        with pytest.raises(torch.OutOfMemoryError, match="NPU out of memory .*Tried to allocate 1.00 MiB"):
            torch.empty(2**20, dtype=torch.uint8, device="npu")
    finally:
        torch.npu.set_per_process_memory_fraction(1.0)
    with pytest.raises(ValueError, match="fraction"):
        torch.npu.set_per_process_memory_fraction(0)


def test_random_numbers_have_their_own_generator(sim: torch.device) -> None:
    torch.manual_seed(0)
    a = torch.randn(5, device="npu")
    torch.npu.manual_seed(0)
    b = torch.randn(5, device="npu")
    assert torch.equal(a.cpu(), b.cpu())
    state = torch.npu.get_rng_state()
    c = torch.rand(5, device="npu")
    torch.randn(100)  # host draws do not move the device generator
    torch.npu.set_rng_state(state)
    assert torch.equal(c.cpu(), torch.rand(5, device="npu").cpu())
    assert torch.npu.initial_seed() == 0


def test_autocast_follows_cuda_policy(sim: torch.device) -> None:
    lin = torch.nn.Linear(8, 4).to("npu")
    x = torch.randn(3, 8, device="npu")
    with torch.autocast("npu", dtype=torch.bfloat16):
        y = lin(x)
        assert y.dtype == torch.bfloat16
        assert torch.softmax(y, -1).dtype == torch.float32
        assert torch.cat([y, x[:, :4]]).dtype == torch.float32
        assert (x + 1).dtype == torch.float32
    with torch.npu.amp.autocast(dtype=torch.float16):
        assert (x @ x.T).dtype == torch.float16
    y.float().sum().backward()
    assert lin.weight.grad.dtype == torch.float32


def test_grad_scaler_step(sim: torch.device) -> None:
    model = torch.nn.Linear(4, 1).to("npu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.npu.amp.GradScaler()
    before = model.weight.detach().cpu().clone()
    x = torch.randn(8, 4, device="npu")
    for _ in range(8):  # fp16 gradients overflow at the initial scale 2**16: steps are skipped, the scale backs off
        opt.zero_grad()
        with torch.autocast("npu", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    assert scaler.get_scale() < 2.0**16
    assert not torch.equal(before, model.weight.detach().cpu())


def test_events_streams_and_device_context(sim: torch.device) -> None:
    start, end = torch.npu.Event(enable_timing=True), torch.npu.Event(enable_timing=True)
    start.record()
    end.record()
    end.synchronize()
    assert start.elapsed_time(end) >= 0
    with pytest.raises(RuntimeError, match="enable_timing"):
        torch.npu.Event().elapsed_time(torch.npu.Event())
    s = torch.npu.Stream()
    with torch.npu.stream(s):
        assert torch.npu.current_stream() is s
    assert torch.npu.current_stream() is torch.npu.default_stream()
    with torch.npu.device(0):
        assert torch.npu.current_device() == 0
    with pytest.raises(RuntimeError, match="Invalid device npu:7"):
        torch.npu.set_device(7)


def test_save_and_load(sim: torch.device) -> None:
    state = torch.nn.Linear(3, 2).to("npu").state_dict()
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded = torch.load(buf)
    assert loaded["weight"].device == sim and torch.equal(loaded["weight"].cpu(), state["weight"].cpu())


def _train_step(model: torch.nn.Module, x: torch.Tensor, target: torch.Tensor) -> tuple[float, dict]:
    loss = torch.nn.functional.cross_entropy(model(x), target)
    loss.backward()
    return loss.item(), {n: p.grad.cpu() for n, p in model.named_parameters()}


def test_mlp_forward_backward_equals_cpu(sim: torch.device) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(13, 37), torch.nn.GELU(), torch.nn.LayerNorm(37),
                                torch.nn.Linear(37, 5))
    x, target = torch.randn(9, 13), torch.randint(0, 5, (9,))
    loss_cpu, grads_cpu = _train_step(copy.deepcopy(model), x, target)
    loss_npu, grads_npu = _train_step(copy.deepcopy(model).to("npu"), x.to("npu"), target.to("npu"))
    assert loss_npu == loss_cpu
    for name in grads_cpu:
        torch.testing.assert_close(grads_npu[name], grads_cpu[name], rtol=0, atol=0)


def test_tiny_llama_forward_backward_equals_cpu(sim: torch.device) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 97, (2, 11))
    cpu_model = copy.deepcopy(model)
    out_cpu = cpu_model(input_ids=ids, labels=ids)
    out_cpu.loss.backward()
    npu_model = copy.deepcopy(model).to("npu")
    out_npu = npu_model(input_ids=ids.to("npu"), labels=ids.to("npu"))
    out_npu.loss.backward()
    assert out_npu.logits.device == sim
    # Not bit-equal: scaled_dot_product_attention takes its math path for a PrivateUse1 device and the fused CPU
    # kernel for host tensors (differences seen: 7e-8 absolute).
    close = {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(out_npu.logits.cpu(), out_cpu.logits.detach(), **close)
    torch.testing.assert_close(out_npu.loss.cpu(), out_cpu.loss.detach(), **close)
    cpu_grads = {name: p.grad for name, p in cpu_model.named_parameters()}
    for name, p in npu_model.named_parameters():
        torch.testing.assert_close(p.grad.cpu(), cpu_grads[name], **close)


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=120)


def test_refuses_to_start_next_to_a_real_torch_npu() -> None:
    result = _run("""
        import sys, types
        sys.modules["torch_npu"] = types.ModuleType("torch_npu")
        import torchport.testing
        torchport.testing.simulate_npu()
    """)
    assert result.returncode != 0 and "a real torch_npu is imported" in result.stderr


def test_activated_by_environment_only() -> None:
    code = "import torch, torchport; print(torchport.device(), hasattr(torch, 'npu'))"
    assert _run(code, TORCHPORT_SIMULATE="npu").stdout.split() == ["npu:0", "True"]
    plain = _run(code, TORCHPORT_SIMULATE="")
    assert plain.returncode == 0 and plain.stdout.split()[1] == "False"


def test_several_devices_and_a_fixed_count() -> None:
    result = _run("""
        import torch, torchport, torchport.testing
        print(torchport.devices())
        x = torch.ones(2, device="npu:1")
        print(x.device, torch.npu.memory_allocated(1), torch.npu.memory_allocated(0))
        torchport.testing.simulate_npu(2)
        torchport.testing.simulate_npu(3)
    """, TORCHPORT_SIMULATE="npu", TORCHPORT_SIMULATE_DEVICES="2")
    lines = result.stdout.splitlines()
    assert "index=1" in lines[0] and lines[1] == "npu:1 8 0"
    assert "already active with 2 device(s); asked for 3" in result.stderr


def test_current_stream_is_per_thread(sim: torch.device) -> None:
    import threading

    inside, release = threading.Event(), threading.Event()
    other = torch.npu.Stream()

    def worker() -> None:
        with torch.npu.stream(other):
            inside.set()
            release.wait(5)

    thread = threading.Thread(target=worker)
    thread.start()
    try:
        assert inside.wait(5)
        assert torch.npu.current_stream() is torch.npu.default_stream()  # the worker's context is its own
    finally:
        release.set()
        thread.join()


def test_pinned_host_memory_as_torch_npu_gives_it(sim: torch.device) -> None:
    """torch_npu pins host memory with its own allocator; the simulation answers pin_memory() and is_pinned() in
    Python, so device-agnostic loading code (DataLoader(pin_memory=True), x.pin_memory().to(dev, non_blocking=True))
    runs on it as on a chip."""
    host = torch.arange(12.0).reshape(3, 4)
    assert not host.is_pinned()
    pinned = host.pin_memory()
    assert pinned.is_pinned() and pinned[1].is_pinned() and pinned.pin_memory() is pinned
    assert pinned.data_ptr() != host.data_ptr() and torch.equal(pinned, host) and not host.is_pinned()
    assert torch.equal(pinned.to(sim, non_blocking=True).cpu(), host)
    strided = host.t().pin_memory()
    assert strided.stride() == host.t().stride() and torch.equal(strided, host.t())
    with pytest.raises(RuntimeError, match="only dense CPU tensors can be pinned"):
        torch.ones(2, device=sim).pin_memory()
    moved = torch.ones(4).pin_memory()
    moved.set_(torch.zeros(4))  # other memory now: its old address is no longer pinned memory of a live tensor
    assert not moved.is_pinned() and not torch.zeros(4).is_pinned()
    buffer = get_backend("npu").empty_pinned(64)  # torchport's own pinned buffers (offload)
    assert buffer.is_pinned() and buffer[8:16].is_pinned() and buffer.dtype == torch.uint8
    data = torch.utils.data.TensorDataset(torch.arange(8.0), torch.arange(8))
    for shim in (False, True):  # alone, and under the shim, which pins as the device does
        if shim:
            torchport.compat.patch(sim)
        try:
            assert torch.ones(2).pin_memory().is_pinned()
            for workers in (0, 2):
                batches = list(torch.utils.data.DataLoader(data, batch_size=3, pin_memory=True, num_workers=workers))
                assert all(x.is_pinned() and y.is_pinned() for x, y in batches)
                assert torch.equal(torch.cat([x for x, _ in batches]), torch.arange(8.0))
        finally:
            if shim:
                torchport.compat.unpatch()
