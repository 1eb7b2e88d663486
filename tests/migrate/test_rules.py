"""Golden before/after pairs, at least one per rule of torchport.migrate, and the rule registry's shape."""

from __future__ import annotations

import re

import pytest

from torchport.migrate import get_rule, list_rules, migrate_source, register_rule

HEADER = 'DEVICE = torch.accelerator.current_accelerator(check_available=True) or torch.device("cpu")'

# (rule id, before, after): each `before` follows "import torch" (and the imports it names itself); `after` is the
# code after the imports and the DEVICE definition.
GOLDEN = [
    ("tensor-cuda", "x = t.cuda()", "x = t.to(DEVICE)"),
    ("tensor-cuda", "m = Net().cuda(1)", "m = Net().to(torch.device(DEVICE.type, 1))"),
    ("tensor-cuda", "x = t.cuda(non_blocking=True)", "x = t.to(DEVICE, non_blocking=True)"),
    ("tensor-cuda", "x = t.cuda(rank, True)", "x = t.to(torch.device(DEVICE.type, rank), non_blocking=True)"),
    ("tensor-cuda", 'x = t.cuda("cuda:1")', 'x = t.to(f"{DEVICE.type}:1")'),
    ("device-string", 'x = t.to("cuda")', "x = t.to(DEVICE.type)"),
    ("device-string", "y = torch.zeros(2, device='cuda:0')", "y = torch.zeros(2, device=f'{DEVICE.type}:0')"),
    ("device-string", 'd = torch.device("cuda", 1)', "d = torch.device(DEVICE.type, 1)"),
    ("device-string", 'device = "cuda" if torch.cuda.is_available() else "cpu"',
     'device = DEVICE.type if torch.accelerator.is_available() else "cpu"'),
    ("device-string", 'g = torch.Generator("cuda")', "g = torch.Generator(DEVICE.type)"),
    ("device-string", 's = torch.load(p, map_location="cuda")', "s = torch.load(p, map_location=DEVICE.type)"),
    ("device-string", 'with torch.autocast("cuda"):\n    pass', "with torch.autocast(DEVICE.type):\n    pass"),
    ("device-string", 'def f(x, device="cuda"):\n    pass', "def f(x, device=DEVICE.type):\n    pass"),
    ("device-string", 'p.add_argument("--device", default="cuda")', 'p.add_argument("--device", default=DEVICE.type)'),
    ("device-fstring", 'x = t.to(f"cuda:{rank}")', 'x = t.to(f"{DEVICE.type}:{rank}")'),
    ("device-check", 'ok = "cuda" in device', 'ok = "cpu" not in device'),
    ("device-check", "ok = x.device.type == 'cuda'", "ok = x.device.type != 'cpu'"),
    ("device-check", 'ok = device != "cuda"', 'ok = device == "cpu"'),
    ("is-cuda", "ok = x.is_cuda", 'ok = x.device.type != "cpu"'),
    ("is-cuda", "ok = x.is_cuda == flag", 'ok = (x.device.type != "cpu") == flag'),
    ("cuda-query", "n = torch.cuda.device_count()", "n = torch.accelerator.device_count()"),
    ("cuda-query", "ok = torch.cuda.is_available()", "ok = torch.accelerator.is_available()"),
    ("cuda-query", "i = torch.cuda.current_device()", "i = torch.accelerator.current_device_index()"),
    ("cuda-query", "f = torch.cuda.set_device", "f = torch.accelerator.set_device_index"),
    ("cuda-set-device", "torch.cuda.set_device(rank)",
     "if torch.accelerator.is_available():\n    torch.accelerator.set_device_index(rank)"),
    ("cuda-set-device", "x = f(torch.cuda.set_device(0))",
     "x = f((torch.accelerator.set_device_index(0) if torch.accelerator.is_available() else None))"),
    ("cuda-device-module", "f = torch.cuda.synchronize", "f = torch.get_device_module(DEVICE).synchronize"),
    ("cuda-memory", "s = torch.cuda.memory_stats()",
     "s = (torch.accelerator.memory_stats() if torch.accelerator.is_available() else {})"),
    ("cuda-memory", "torch.cuda.reset_max_memory_allocated(0)",
     "if torch.accelerator.is_available():\n    torch.accelerator.reset_peak_memory_stats(0)"),
    ("cuda-memory", "torch.cuda.synchronize()",
     "if torch.accelerator.is_available():\n    torch.accelerator.synchronize()"),
    ("cuda-device-module", "s = torch.cuda.current_stream()", "s = torch.get_device_module(DEVICE).current_stream()"),
    ("cuda-device-module", "n = torch.cuda.get_device_name(0)", "n = torch.get_device_module(DEVICE).get_device_name(0)"),
    ("cuda-memory", "m = torch.cuda.memory_allocated() / 2**20",
     "m = (torch.accelerator.memory_allocated() if torch.accelerator.is_available() else 0) / 2**20"),
    ("cuda-memory", "m = torch.cuda.max_memory_reserved(device=0)",
     "m = (torch.accelerator.max_memory_reserved(0) if torch.accelerator.is_available() else 0)"),
    ("cuda-memory", "torch.cuda.empty_cache()  # free",
     "if torch.accelerator.is_available():\n    torch.accelerator.empty_cache()  # free"),
    ("cuda-memory", "torch.cuda.reset_peak_memory_stats()",
     "if torch.accelerator.is_available():\n    torch.accelerator.reset_peak_memory_stats()"),
    ("cuda-seed", "torch.cuda.manual_seed_all(0)",
     "if torch.accelerator.is_available():\n    torch.get_device_module(DEVICE).manual_seed_all(0)"),
    ("cuda-seed", "torch.cuda.manual_seed(3)",
     "if torch.accelerator.is_available():\n    torch.get_device_module(DEVICE).manual_seed(3)"),
    ("cuda-event", "e = torch.cuda.Event(enable_timing=True)",
     "e = (torch.Event(enable_timing=True) if torch.accelerator.is_available() else HostEvent(enable_timing=True))"),
    ("cuda-event", "e = torch.cuda.Event(True, False)",
     "e = (torch.Event(enable_timing=True, blocking=False) if torch.accelerator.is_available() else "
     "HostEvent(enable_timing=True, blocking=False))"),
    ("device-index", "y = x.to(0)", "y = x.to(torch.device(DEVICE.type, 0))"),
    ("device-index", "y = torch.ones(2, device=1)", "y = torch.ones(2, device=torch.device(DEVICE.type, 1))"),
    ("device-index", 's = torch.load(f, map_location={"cuda:0": 1})',
     's = torch.load(f, map_location={"cuda:0": torch.device(DEVICE.type, 1)})'),
    ("device-index", 'm = load(p, device_map={"": 0})', 'm = load(p, device_map={"": torch.device(DEVICE.type, 0)})'),
    ("device-index-name", "m = net.to(local_rank)", "m = net.to(torch.device(DEVICE.type, local_rank))"),
    ("device-index-name", "i = r % torch.cuda.device_count()\ny = x.to(i)",
     "i = r % max(torch.accelerator.device_count(), 1)\ny = x.to(torch.device(DEVICE.type, i))"),
    ("device-index-attribute", "m = net.to(args.gpu)", "m = net.to(torch.device(DEVICE.type, args.gpu))"),
    ("device-int", "d = torch.device(0)", "d = torch.device(DEVICE.type, 0)"),
    ("device-int", "d = torch.device(local_rank)", "d = torch.device(DEVICE.type, local_rank)"),
    ("device-count-modulo", "i = rank % torch.cuda.device_count()",
     "i = rank % max(torch.accelerator.device_count(), 1)"),
    ("device-fstring", 's = torch.load(f, map_location={"cuda:0": f"cuda:{rank}"})',
     's = torch.load(f, map_location={"cuda:0": f"{DEVICE.type}:{rank}"})'),
    ("cuda-stream", "s = torch.cuda.Stream(priority=-1)", "s = torch.Stream(DEVICE, priority=-1)"),
    ("cuda-stream", "s = torch.cuda.Stream()", "s = torch.Stream(DEVICE)"),
    ("amp-autocast", "with torch.cuda.amp.autocast():\n    pass", "with torch.amp.autocast(DEVICE.type):\n    pass"),
    ("amp-autocast", "with torch.cuda.amp.autocast(True, torch.bfloat16):\n    pass",
     "with torch.amp.autocast(DEVICE.type, enabled=True, dtype=torch.bfloat16):\n    pass"),
    ("amp-gradscaler", "s = torch.cuda.amp.GradScaler(init_scale=1024)",
     "s = torch.amp.GradScaler(DEVICE.type, init_scale=1024)"),
    ("amp-import", "from torch.cuda.amp import autocast, GradScaler\ns = GradScaler()",
     "s = GradScaler(DEVICE.type)"),
    ("dist-backend", "import torch.distributed as dist\ndist.init_process_group('nccl')",
     "dist.init_process_group(dist.get_default_backend_for_device(DEVICE))"),
    ("dist-backend", 'torch.distributed.init_process_group(backend="nccl", rank=r)',
     "torch.distributed.init_process_group(backend=torch.distributed.get_default_backend_for_device(DEVICE), "
     "rank=r)"),
    ("dist-backend", "import torch.distributed as dist\ndist.init_process_group(backend=args.dist_backend)",
     'dist.init_process_group(backend=dist.get_default_backend_for_device(DEVICE) if args.dist_backend == "nccl" '
     "else args.dist_backend)"),
    ("dist-backend", "import torch.distributed as dist\ndist.init_process_group(cfg['backend'], rank=r)",
     "dist.init_process_group(dist.get_default_backend_for_device(DEVICE) if cfg['backend'] == \"nccl\" "
     "else cfg['backend'], rank=r)"),
    ("legacy-tensor-type", "a = torch.cuda.FloatTensor(2, 3)",
     "a = torch.empty(2, 3, dtype=torch.float32, device=DEVICE)"),
    ("legacy-tensor-type", "v = torch.cuda.FloatTensor(x.size(0), 1).fill_(1.0)",
     "v = torch.empty(x.size(0), 1, dtype=torch.float32, device=DEVICE).fill_(1.0)"),
    ("legacy-tensor-type", "b = torch.cuda.ByteTensor(x.size())",
     "b = torch.empty(x.size(), dtype=torch.uint8, device=DEVICE)"),
    ("legacy-tensor-type", "e = torch.cuda.HalfTensor()", "e = torch.empty(0, dtype=torch.float16, device=DEVICE)"),
    ("legacy-tensor-type", "c = torch.cuda.FloatTensor([1.0, 2.0])",
     "c = torch.tensor([1.0, 2.0], dtype=torch.float32, device=DEVICE)"),
    ("legacy-tensor-type", "import numpy as np\nz = torch.cuda.FloatTensor(np.random.normal(0, 1, (4, 2)))",
     "z = torch.tensor(np.random.normal(0, 1, (4, 2)), dtype=torch.float32, device=DEVICE)"),
    ("legacy-tensor-type", "y = torch.cuda.LongTensor(rng.integers(0, 3, 16))",
     "y = torch.tensor(rng.integers(0, 3, 16), dtype=torch.int64, device=DEVICE)"),
    ("legacy-tensor-type", "r = torch.cuda.FloatTensor(data[i:j])",
     "r = torch.tensor(data[i:j], dtype=torch.float32, device=DEVICE)"),
    ("legacy-tensor-type", "n = torch.cuda.LongTensor(k)",
     "n = (torch.empty(k, dtype=torch.int64, device=DEVICE) if isinstance(k, torch.Size) or "
     "not hasattr(k, \"__len__\") else torch.tensor(k, dtype=torch.int64, device=DEVICE))"),
    ("tensor-type", "y = x.type(torch.cuda.FloatTensor)", "y = x.to(DEVICE, torch.float32)"),
    ("tensor-type", "y = x.type('torch.cuda.HalfTensor', non_blocking=True)",
     "y = x.to(DEVICE, torch.float16, non_blocking=True)"),
    ("tensor-type", "m = Net().type(dtype=torch.cuda.DoubleTensor)", "m = Net().to(DEVICE, torch.float64)"),
    ("ddp-device-ids", "from torch.nn.parallel import DistributedDataParallel as DDP\nm = DDP(m, device_ids=[r])",
     'm = DDP(m, device_ids=None if DEVICE.type == "cpu" else [r])'),
]


def _after_imports(code: str) -> str:
    code = re.sub(r"\nclass HostEvent:\n(    .*\n|\n)*", "\n", code)  # cuda-event's helper, tested on its own
    lines = code.splitlines()
    body = [line for line in lines if not line.startswith(("import ", "from ")) and line != HEADER]
    return "\n".join(body).strip()


@pytest.mark.parametrize(("rule", "before", "after"), GOLDEN, ids=[f"{r}-{i}" for i, (r, _, _) in enumerate(GOLDEN)])
def test_golden(rule: str, before: str, after: str) -> None:
    result = migrate_source(f"import torch\n{before}\n")
    assert _after_imports(result.code) == after
    assert rule in {change.rule for change in result.changes}
    assert result.unconverted == []
    assert migrate_source(result.code).code == result.code  # idempotent
    compile(result.code, "<golden>", "exec")
    assert "torchport" not in result.code


def test_amp_import_is_rewritten_to_torch_amp() -> None:
    code = migrate_source("from torch.cuda.amp import autocast, GradScaler\nwith autocast():\n    pass\n").code
    assert code.startswith("from torch.amp import autocast, GradScaler\nimport torch\n")
    assert "with autocast(DEVICE.type):" in code


def test_every_rule_has_a_docstring_and_a_golden_pair() -> None:
    covered = {rule for rule, _, _ in GOLDEN}
    for rule_id in list_rules():
        assert get_rule(rule_id).doc, rule_id
        assert rule_id in covered, f"rule {rule_id} has no golden pair"


@pytest.mark.parametrize("value", ["None", '"gloo"', "dist.get_default_backend_for_device(DEVICE)"])
def test_a_backend_that_is_no_cuda_one_stays(value: str) -> None:
    code = f"import torch\nimport torch.distributed as dist\ndist.init_process_group(backend={value})\n"
    result = migrate_source(code)
    assert result.code == code and result.unconverted == []


def test_a_backend_from_a_call_is_reported() -> None:
    result = migrate_source("import torch.distributed as dist\ndist.init_process_group(backend=pick())\n")
    assert "backend=pick()" in result.code
    assert [u.what for u in result.unconverted] == ["init_process_group(backend=<expression>)"]


@pytest.mark.parametrize(("code", "what", "dtype"), [
    ("t = torch.cuda.FloatTensor(make(x))", "FloatTensor(<expression>)", "torch.float32"),
    ("t = torch.cuda.FloatTensor(x, device=0)", "FloatTensor(...) with keywords or *args", "torch.float32"),
    ("T = torch.cuda.FloatTensor if cuda else torch.FloatTensor", "torch.cuda.FloatTensor used as a value",
     "torch.float32"),
    ("ok = isinstance(x, torch.cuda.LongTensor)", "isinstance(t, torch.cuda.LongTensor)", "torch.int64"),
    ("torch.set_default_tensor_type(torch.cuda.HalfTensor)", "torch.set_default_tensor_type(torch.cuda.HalfTensor)",
     "torch.float16"),
])
def test_legacy_types_migrate_cannot_rewrite_are_reported(code: str, what: str, dtype: str) -> None:
    result = migrate_source(f"import torch\n{code}\n")
    assert f"{code}\n" in result.code
    assert [u.what for u in result.unconverted] == [what]
    assert dtype in result.unconverted[0].hint


def test_strings_that_name_no_device_stay() -> None:
    code = 'import torch\nprint("cuda")\nname = "cuda"\nopts = {"backend": "cuda"}\n'
    assert migrate_source(code).code == code


def test_registry_rejects_duplicates_and_names_what_exists() -> None:
    with pytest.raises(ValueError, match="already registered"):
        register_rule("tensor-cuda", object)(lambda original, updated, ctx: None)
    with pytest.raises(ValueError, match=r"'nope' is not a migrate rule; registered: .*tensor-cuda"):
        get_rule("nope")


def test_the_host_event_times_with_the_host_clock() -> None:
    # the module's own name "time" (a float here) does not shadow the helper's clock
    source = "import torch\ntime = 0.0\ns, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)\n"
    code = migrate_source(source).code
    assert code.count("class HostEvent:") == 1
    namespace: dict = {}
    exec(compile(code.replace("torch.accelerator.is_available()", "False"), "<migrated>", "exec"), namespace)
    start, end = namespace["s"], namespace["e"]
    start.record()
    end.record()
    end.synchronize()
    assert start.query() and 0 <= start.elapsed_time(end) < 1000
    assert migrate_source(code).code == code  # a second run keeps the one helper


def test_a_name_also_bound_to_a_device_is_no_index() -> None:
    code = "import torch\ndevice_id = torch.device('cpu')\ny = x.to(device_id)\nz = torch.device(rank)\n"
    result = migrate_source(code).code
    assert "x.to(device_id)" in result and "torch.device(DEVICE.type, rank)" in result
    assert "device_id = 0\n" in migrate_source("import torch\ndevice_id = 0\n").code


def test_a_flag_the_module_assigns_is_not_the_tensor_property() -> None:
    code = "import torch\nclass L:\n    def __init__(self, d):\n        self.is_cuda = d.type == 'cuda'\n" \
           "    def go(self):\n        return self.is_cuda\n"
    migrated = migrate_source(code).code
    assert "self.is_cuda = d.type != 'cpu'" in migrated and "return self.is_cuda\n" in migrated


# torch.accelerator's functions in every PyTorch the migrated code must run on (its __all__ in 2.8; 2.12 added
# Graph, get_device_capability, get_memory_info...): code migrate writes may use these only
ACCELERATOR_EVERYWHERE = frozenset({
    "current_accelerator", "current_device_index", "current_stream", "empty_cache", "device_count", "device_index",
    "is_available", "max_memory_allocated", "max_memory_reserved", "memory_allocated", "memory_reserved",
    "memory_stats", "reset_accumulated_memory_stats", "reset_peak_memory_stats", "set_device_index", "set_stream",
    "synchronize",
})


def test_migrated_code_uses_only_the_torch_accelerator_of_every_supported_pytorch() -> None:
    import torch

    written = {name for _, _, after in GOLDEN for name in re.findall(r"torch\.accelerator\.(\w+)", after)}
    written |= set(re.findall(r"torch\.accelerator\.(\w+)", HEADER))
    assert written and written <= ACCELERATOR_EVERYWHERE, written - ACCELERATOR_EVERYWHERE
    assert all(hasattr(torch.accelerator, name) for name in written)
