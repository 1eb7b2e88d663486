"""The shim as a library: patch/unpatch, what it redirects, and who gets the real answer."""

import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import torchport.compat as compat
from torchport.backends import get_backend
from torchport.compat.redirect import Target
from torchport.compat.report import Recorder


def _snapshot() -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils import cpp_extension

    owners = [torch, torch.Tensor, torch.nn.Module, torch.cuda, torch.cuda.amp, torch.cuda.nvtx, torch.amp,
              torch.amp.autocast_mode, dist, DistributedDataParallel, DeviceMesh, torch.nn.DataParallel,
              torch.profiler.profile, cpp_extension]
    # identity, not equality (torch.nan != torch.nan); torch's private caches (_cached_device_count...) may fill in
    # while the shim looks at the devices, and are not the shim's to restore
    return {(id(o), name): id(o.__dict__.get(name)) for o in owners for name in list(vars(o))
            if not (name.startswith("_") and not name.startswith("__"))}


def test_unpatch_restores_every_attribute(device: torch.device) -> None:
    torch.ones(1, device=device)  # a device's lazy initialisation adds module attributes of its own
    get_backend(device.type).synchronize(0)
    before = _snapshot()
    meta_path = list(sys.meta_path)
    compat.patch(device)
    assert compat.is_patched() and compat.target().type == device.type
    compat.unpatch()
    assert _snapshot() == before and sys.meta_path == meta_path
    assert not compat.is_patched() and compat.target() is None
    compat.unpatch()  # a second unpatch is harmless


def test_patch_is_idempotent_and_thread_safe(shim: torch.device) -> None:
    patched = len(compat._state["patcher"].patched())
    results = []
    threads = [threading.Thread(target=lambda: results.append(compat.patch(shim))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(map(str, results))) == 1 and len(compat._state["patcher"].patched()) == patched


def test_cuda_names_land_on_the_target(shim: torch.device) -> None:
    kind = shim.type
    assert torch.ones(2, device="cuda").device.type == kind
    assert torch.zeros(2, device=torch.device("cuda", 0)).device.type == kind
    assert torch.randn(3).cuda().device.type == kind and torch.randn(3).to("cuda:0").device.type == kind
    assert torch.empty(2).new_zeros(3, device="cuda").device.type == kind
    assert torch.full_like(torch.ones(2), 3, device="cuda").device.type == kind
    assert torch.nn.Linear(2, 2).cuda().weight.device.type == kind
    assert torch.nn.Linear(2, 2).to("cuda").weight.device.type == kind
    assert torch.ones(2).cuda().is_cuda
    assert torch.cuda.is_available() and torch.cuda.device_count() >= 1
    assert isinstance(torch.cuda.memory_allocated(), int) and isinstance(torch.cuda.get_device_name(), str)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    with torch.cuda.amp.autocast():
        assert (torch.ones(2, 2, device="cuda") @ torch.ones(2, 2, device="cuda")).dtype in (torch.float16,
                                                                                           torch.bfloat16)
    g = torch.Generator("cuda")
    assert isinstance(g, torch.Generator)
    with torch.cuda.nvtx.range("region"):
        torch.cuda.nvtx.range_push("x")
        torch.cuda.nvtx.range_pop()
    names = {row["api"] for row in compat.report()["redirected"]}
    assert {"torch.ones(device=cuda)", "Tensor.cuda", "Module.cuda", "torch.cuda.synchronize"} <= names


def test_libraries_get_the_real_answers(shim: torch.device) -> None:
    # torch (or transformers, accelerate...) asking must not be told CUDA exists: it would pick CUDA-only paths.
    real = torch.cuda._is_compiled() and torch.cuda.device_count.__wrapped__()  # type: ignore[attr-defined]
    library = {"__name__": "transformers.modeling_utils", "torch": torch}
    exec("answer = torch.cuda.is_available()", library)  # noqa: S102 - a library's frame, made on purpose
    assert library["answer"] == bool(real)
    user = {"__name__": "__main__", "torch": torch}
    exec("answer = torch.cuda.is_available()", user)  # noqa: S102
    assert user["answer"] is True
    # torch's lazy seeding asks is_initialized(): told "yes" on a GPU machine, it indexed CUDA generators that
    # do not exist yet (seen on an H100)
    library = {"__name__": "torch.cuda.random", "torch": torch}
    exec("answer = torch.cuda.is_initialized()", library)  # noqa: S102
    assert library["answer"] == torch.cuda.is_initialized.__wrapped__()  # type: ignore[attr-defined]
    torch.manual_seed(0)


def test_a_library_checking_a_cuda_device_the_program_handed_it_is_told_what_the_program_is(
        shim: torch.device) -> None:
    real = torch.cuda.is_available.__wrapped__()  # type: ignore[attr-defined]
    library = {"__name__": "timm.utils.distributed", "torch": torch}
    code = textwrap.dedent("""
        def check(device="cuda"):
            return torch.cuda.is_available(), torch.cuda.device_count()
        def check_any(*args, **kwargs):
            return torch.cuda.is_available()
        def setup(options):
            return check(options["device"])
        def on_its_own():
            return torch.cuda.is_available()
    """)
    exec(code, library)  # noqa: S102 - a library's frames, made on purpose
    assert library["check"]("cuda")[0] is True and library["check"]("cuda")[1] >= 1
    assert library["check"](torch.device("cuda", 0))[0] is True and library["check"]()[0] is True
    assert library["check_any"]("cuda:1") is True and library["check_any"](device="cuda") is True
    assert library["setup"]({"device": "cuda"})[0] is True  # handed down through the library's own frames
    assert library["check"]("cpu")[0] == real and library["check_any"](3, device="meta") == real
    assert library["on_its_own"]() == real
    # torch itself is never told: it maps device names at its API and asks only to pick CUDA-only internals
    inside_torch = {"__name__": "torch.distributed.fake", "torch": torch}
    exec("def check(device):\n    return torch.cuda.is_available()", inside_torch)  # noqa: S102
    assert inside_torch["check"]("cuda") == real


def test_device_count_counts_the_ranks_that_share_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    compat.patch("cpu")
    try:
        assert torch.cuda.device_count() == 1
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun --nproc-per-node 4: four ranks on the one CPU
        assert torch.cuda.device_count() == 4
    finally:
        compat.unpatch()


def test_legacy_tensor_types_are_made_on_the_target(shim: torch.device) -> None:
    import numpy as np

    kind = shim.type
    made = torch.cuda.FloatTensor(np.ones((2, 2)))
    assert made.device.type == kind and made.dtype == torch.float32 and made.sum().item() == 4
    assert torch.cuda.LongTensor(3).shape == (3,) and torch.cuda.LongTensor(3).dtype == torch.int64
    assert torch.cuda.HalfTensor(2, np.int64(3)).shape == (2, 3)
    assert torch.cuda.ByteTensor(torch.Size([4])).shape == (4,) and torch.cuda.BoolTensor().shape == (0,)
    assert torch.cuda.FloatTensor([1.0, 2.0]).tolist() == [1.0, 2.0]
    assert torch.cuda.IntTensor((2, 3)).tolist() == [2, 3]  # a tuple is data, as in torch's constructor
    array = np.zeros(2, dtype=np.float32)
    copied = torch.cuda.FloatTensor(array)
    array[0] = 1.0
    assert copied.tolist() == [0.0, 0.0]  # copied, as onto a GPU
    assert torch.cuda.FloatTensor(made) is made
    host = torch.arange(3)
    for converted, dtype in ((host.type(torch.cuda.DoubleTensor), torch.float64),
                             (host.type("torch.cuda.BFloat16Tensor"), torch.bfloat16),
                             (host.type(dtype=torch.cuda.CharTensor, non_blocking=True), torch.int8)):
        assert converted.device.type == kind and converted.dtype == dtype
    assert host.type() == "torch.LongTensor" and host.type(torch.float16).dtype == torch.float16
    assert isinstance(made, torch.cuda.FloatTensor) and not isinstance(made, torch.cuda.DoubleTensor)
    assert not isinstance(np.ones(1), torch.cuda.FloatTensor)
    with pytest.raises(TypeError, match=r"torch.cuda.FloatTensor\(...\) takes sizes"):
        torch.cuda.FloatTensor([1.0], [2.0])
    counts = {row["api"]: row["count"] for row in compat.report()["redirected"]}
    assert counts["torch.cuda.FloatTensor"] >= 3 and counts["Tensor.type(torch.cuda)"] == 3


def test_a_legacy_cuda_type_as_the_default_tensor_type_sets_dtype_and_device(shim: torch.device) -> None:
    try:
        torch.set_default_tensor_type(torch.cuda.HalfTensor)
        made = torch.ones(2)
        assert made.dtype == torch.float16 and made.device.type == shim.type
        torch.set_default_tensor_type("torch.cuda.DoubleTensor")
        assert torch.nn.Linear(2, 2).weight.dtype == torch.float64
        with pytest.raises(TypeError, match="floating-point"):
            torch.set_default_tensor_type(torch.cuda.LongTensor)  # as torch refuses it
    finally:
        torch.set_default_dtype(torch.float32)
        torch.set_default_device(None)


def test_grad_scaler_follows_the_autocast_dtype(shim: torch.device) -> None:
    backend = get_backend(shim.type)
    fp16 = backend.autocast_dtype(torch.float16, 0) == torch.float16
    assert torch.amp.GradScaler("cuda").is_enabled() == fp16
    assert torch.cuda.amp.GradScaler().is_enabled() == fp16

    class MyScaler(torch.cuda.amp.GradScaler):  # code that subclasses CUDA's classes keeps working
        pass

    assert isinstance(MyScaler(), torch.amp.GradScaler) and MyScaler().is_enabled() == fp16
    with torch.cuda.amp.autocast() as ctx:
        assert isinstance(ctx, torch.amp.autocast)
        assert torch.get_autocast_dtype(shim.type) == backend.autocast_dtype(torch.float16, 0)
    counts = {row["api"]: row["count"] for row in compat.report()["redirected"]}
    assert counts["torch.cuda.amp.GradScaler"] == 3 and "torch.amp.GradScaler" in counts
    assert counts["torch.cuda.amp.autocast"] == 1 and "torch.autocast" not in counts


def test_cuda_only_imports_fail_with_a_hint(shim: torch.device) -> None:
    with pytest.raises(ImportError, match="flash_attn is CUDA-only and cannot run on .*scaled_dot_product_attention"):
        import flash_attn  # noqa: F401
    imported = "cupy" in sys.modules  # imported before the shim: nothing can refuse it now, the report names it
    if not imported:
        with pytest.raises(ImportError, match="cupy is CUDA-only"):
            import cupy  # noqa: F401
    found = {row["name"] for row in compat.report()["cuda_only"]}
    assert {"flash_attn", "cupy"} <= found
    # a library probing for the package (transformers does, at import) is told it is absent, not given an error
    import importlib.util

    assert importlib.util.find_spec("flash_attn") is None
    assert imported or importlib.util.find_spec("cupyx") is None


def test_stream_and_event_stay_types(shim: torch.device) -> None:
    stream, event = torch.cuda.Stream(), torch.cuda.Event(enable_timing=True)
    assert isinstance(stream, torch.cuda.Stream) and isinstance(event, torch.cuda.Event)
    assert not isinstance(event, torch.cuda.Stream) and not isinstance(1, torch.cuda.Event)
    assert (torch.cuda.Stream | None).__args__ == (torch.cuda.Stream, type(None))  # annotations in transformers
    counts = {row["api"]: row["count"] for row in compat.report()["redirected"]}
    assert counts["torch.cuda.Stream"] >= 1 and counts["torch.cuda.Event"] >= 1


def test_cuda_extension_builds_fail_clearly(shim: torch.device, tmp_path) -> None:
    from torch.utils import cpp_extension

    with pytest.raises(RuntimeError, match="builds a CUDA extension, which cannot run on"):
        cpp_extension.load("my_kernels", sources=[str(tmp_path / "k.cu")])


def test_device_map() -> None:
    target = Target(get_backend("cpu"), Recorder())
    assert target.map("cuda") == "cpu" and target.map("cuda:1") == "cpu" and target.map("meta") == "meta"
    assert target.map(torch.device("cuda", 0)) == torch.device("cpu") and target.map(3) == 3
    assert target.map_index(0) == torch.device("cpu")
    assert target.map("cuda", "api") == "cpu" and target.recorder.counts == {"api": 1}


def test_bad_target() -> None:
    with pytest.raises(ValueError, match="'gpu' is not a device type; registered"):
        compat.patch("gpu")
    assert not compat.is_patched()


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TORCHPORT_")}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env={**clean, **env}, timeout=120)


def test_import_auto_patches() -> None:
    result = _run("""
        import torchport.auto, torch
        print(torch.ones(1, device="cuda").device.type, torch.cuda.is_available())
    """, TORCHPORT_SHIM="cpu")
    assert result.stdout.split() == ["cpu", "True"], result.stderr


def test_distributed_init_on_cpu_with_nccl_asked() -> None:
    result = _run("""
        import torch, torch.distributed as dist, torchport, torchport.distributed, torchport.compat
        print(torchport.distributed.backend_name("cpu"))
        device = torchport.distributed.init("cpu", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
        print(device, dist.get_backend())
        dist.destroy_process_group()
        torchport.compat.patch("cpu")
        dist.init_process_group("nccl", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
        t = torch.ones(2).cuda(); dist.all_reduce(t); print(dist.get_backend(), t.tolist())
    """, LOCAL_RANK="0")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:3] == ["gloo", "cpu gloo", "gloo [1.0, 1.0]"]


def test_a_device_mesh_without_a_backend_starts_the_cpu_targets_group() -> None:
    """``init_device_mesh("cuda", ...)`` starts the default group itself, with no backend named, through its own
    binding of ``init_process_group``: torch would then pick the machine's accelerator backend (NCCL alone on a GPU
    machine, which serves no CPU tensor). On the CPU target the group gets the CPU's backend; the recorder stands
    where the GPU machine's default would differ, so the test is the same on every machine."""
    result = _run("""
        import os
        import torch.distributed as dist
        from torch.distributed import device_mesh, distributed_c10d
        seen = []
        original = distributed_c10d.init_process_group
        def record(backend=None, *args, **kwargs):
            seen.append(backend)
            return original(backend, *args, **kwargs)
        dist.init_process_group = distributed_c10d.init_process_group = device_mesh.init_process_group = record
        import torchport.compat
        torchport.compat.patch("cpu")
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
        mesh = device_mesh.init_device_mesh("cuda", (1,))
        print(seen, mesh.device_type, dist.get_backend())
        dist.destroy_process_group()
        distributed_c10d.init_process_group()  # the binding FSDP2's fully_shard and others reach
        print(seen, dist.get_backend())
        dist.destroy_process_group()
    """, LOCAL_RANK="0")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.split("\n")[:2]
    assert lines == ["['gloo'] cpu gloo", "['gloo', 'gloo'] gloo"], result.stdout + result.stderr


def test_integer_devices_land_on_the_target(shim: torch.device) -> None:
    # an int is a CUDA index to torch: torch.device(0) is the accelerator's device 0, an error on a host alone
    for made in (torch.ones(2).to(0), torch.ones(2).cuda(0), torch.ones(2, device=0), torch.zeros(1).new_ones(
            2, device=0), torch.nn.Linear(2, 2).to(0).weight):
        assert made.device.type == shim.type
    assert torch.device(0).type == shim.type
    assert isinstance(torch.device(0), torch.device) and torch.device("cpu", 0) == torch.device("cpu:0")
    assert torch.device("cuda", 0).type == "cuda"  # a CUDA device object is mapped where it is used
    assert torch.ones(1).to(torch.device("cuda", 0)).device.type == shim.type


@pytest.mark.slow  # on the CPU, Inductor builds C++ for each compiled function
def test_torch_compile_takes_the_targets_compiler(shim: torch.device) -> None:
    """``torch.compile(fn)`` means Inductor; where Inductor generates no code for the target (the simulated NPU),
    it compiles with torchport's backend, which hands the graph to the target's compiler. The decorator forms,
    ``backend=None``, an explicit ``"inductor"`` and ``Module.compile`` all go that way; a backend the program names
    is kept, and on a target Inductor compiles for (the CPU) torch.compile is left as it is."""
    def fn(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(x) * 2 + 1

    x = torch.randn(5, 7, device="cuda")
    inductor = get_backend(shim.type).inductor_compiles()
    module = torch.nn.Linear(7, 3).to("cuda")
    want = module(x)
    torch._dynamo.reset()
    try:
        torch.testing.assert_close(torch.compile(fn, options={"max_autotune": False})(x), fn(x))
        if hasattr(torch._dynamo.backends.registry, "get_default_backend"):  # backend=None: torch >= 2.12
            torch.testing.assert_close(torch.compile(fn, backend=None)(x), fn(x))
        else:
            torch.testing.assert_close(torch.compile(fn)(x), fn(x))
        torch.testing.assert_close(torch.compile(mode="default")(fn)(x), fn(x))
        torch.testing.assert_close(torch.compile(fn, backend="inductor")(x), fn(x))
        module.compile()
        torch.testing.assert_close(module(x), want)
        torch.testing.assert_close(torch.compile(fn, backend="aot_eager")(x), fn(x))
    finally:
        torch._dynamo.reset()
    calls = {entry["api"]: entry["count"] for entry in compat.report()["redirected"]}
    assert calls.get("torch.compile(backend=inductor)") == (None if inductor else 5)


def test_a_trainer_written_for_cuda_runs_on_the_host_target(tmp_path) -> None:
    """Hugging Face's TrainingArguments refuses bf16 without a GPU unless use_cpu=True; on the host target the
    Trainer runs on the CPU, so the shim sets it (and says so in the report). The adaptation is undone by unpatch, and
    a target that is a device is left to transformers' own checks."""
    transformers = pytest.importorskip("transformers")
    arguments = transformers.TrainingArguments
    original = arguments.__post_init__
    compat.patch("cpu")
    try:
        made = arguments(output_dir=str(tmp_path), bf16=True, report_to=[], save_strategy="no")
        assert made.use_cpu and made.bf16
        explicit = arguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], save_strategy="no")
        assert explicit.use_cpu
        calls = {entry["api"]: entry for entry in compat.report()["redirected"]}
        assert calls["TrainingArguments(use_cpu=True)"]["count"] == 1
        assert calls["TrainingArguments(use_cpu=True)"]["first_site"].startswith("tests")
    finally:
        compat.unpatch()
    assert arguments.__post_init__ is original
    from types import SimpleNamespace

    from torchport.compat.libraries import hooks
    from torchport.compat.redirect import Patcher

    assert hooks(SimpleNamespace(host=False), Patcher()) == {}  # an accelerator: transformers checks it itself


def test_the_import_guard_adapts_a_module_once_the_program_imports_it(tmp_path, monkeypatch) -> None:
    """A module named in ``after`` is adapted when the program imports it, and at once when it is already loaded."""
    from torchport.compat import cuda_only
    from torchport.compat.redirect import Patcher

    (tmp_path / "tp_adapted_probe.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "tp_adapted_probe", raising=False)
    seen: list[int] = []
    target, patcher = Target(get_backend("cpu"), Recorder()), Patcher()
    guard = cuda_only.install(target, patcher, {"tp_adapted_probe": lambda module: seen.append(module.VALUE)})
    try:
        assert seen == []
        import tp_adapted_probe  # noqa: F401
        assert seen == [1]
    finally:
        sys.meta_path.remove(guard)
        patcher.restore()
    again = cuda_only.install(target, patcher, {"tp_adapted_probe": lambda module: seen.append(module.VALUE + 1)})
    sys.meta_path.remove(again)
    patcher.restore()
    assert seen == [1, 2]


def test_a_lightning_trainer_asking_for_a_gpu_runs_on_the_host_target() -> None:
    """Lightning's Trainer(accelerator="gpu") and Fabric(accelerator="cuda") ask CUDA themselves and stop on a
    machine without it; on the host target they get the CPU accelerator, a process per GPU asked for."""
    lightning = pytest.importorskip("lightning")
    from torchport.compat.libraries import _cpu_devices

    assert [_cpu_devices(d) for d in (1, 2, -1, [0, 1], (3,), "0,1", "-1", "2", "auto")] == [1, 2, 1, 2, 1, 2, 1, 2,
                                                                                            "auto"]
    trainer_init, fabric_init = lightning.Trainer.__init__, lightning.Fabric.__init__
    compat.patch("cpu")
    try:
        trainer = lightning.Trainer(accelerator="gpu", devices=[0, 1], logger=False, enable_checkpointing=False,
                                    enable_progress_bar=False, max_steps=1)
        assert type(trainer.accelerator).__name__ == "CPUAccelerator" and trainer.num_devices == 2
        fabric = lightning.Fabric(accelerator="cuda", devices=1)
        assert fabric.device.type == "cpu"
        mine = lightning.Trainer(accelerator="cpu", logger=False)  # the program's own choice stays
        assert type(mine.accelerator).__name__ == "CPUAccelerator"
        calls = {entry["api"]: entry["count"] for entry in compat.report()["redirected"]}
        assert calls["Trainer(accelerator='gpu')"] == 1 and calls["Fabric(accelerator='cuda')"] == 1
    finally:
        compat.unpatch()
    assert lightning.Trainer.__init__ is trainer_init and lightning.Fabric.__init__ is fabric_init
