"""CUDA-written: the torch.cuda runtime functions a training script calls, and the torch.backends.cuda/cudnn flags.
Prints only what holds on every device (types, signs, relations), plus one computed number."""
import torch

torch.backends.cudnn.benchmark = True
torch.backends.cudnn.deterministic = True
torch.backends.cudnn.allow_tf32 = True
torch.backends.cuda.matmul.allow_tf32 = True

print("is_available", torch.cuda.is_available())
count = torch.cuda.device_count()
print("device_count", isinstance(count, int) and count >= 1)
torch.cuda.set_device(0)
print("current_device", torch.cuda.current_device())
torch.manual_seed(0)
torch.cuda.manual_seed(0)
torch.cuda.manual_seed_all(0)

torch.cuda.reset_peak_memory_stats()
x = torch.randn(16, 16, device="cuda")
y = x @ x.T
torch.cuda.synchronize()
print(f"trace {y.trace().item():.6f}")

for name, fn in [("memory_allocated", torch.cuda.memory_allocated), ("memory_reserved", torch.cuda.memory_reserved),
                 ("max_memory_allocated", torch.cuda.max_memory_allocated),
                 ("max_memory_reserved", torch.cuda.max_memory_reserved)]:
    value = fn()
    print(name, isinstance(value, int) and value >= 0, isinstance(fn(0), int))
print("peak >= now", torch.cuda.max_memory_allocated() >= torch.cuda.memory_allocated())
del y
torch.cuda.empty_cache()

free, total = torch.cuda.mem_get_info()
print("mem_get_info", isinstance(free, int), isinstance(total, int), 0 <= free <= total)
name = torch.cuda.get_device_name(0)
print("device_name", isinstance(name, str) and len(name) > 0, isinstance(torch.cuda.get_device_name(), str))
props = torch.cuda.get_device_properties(0)
print("total_memory", isinstance(props.total_memory, int) and props.total_memory > 0)
major, minor = torch.cuda.get_device_capability()
same = torch.cuda.get_device_capability(0) == (major, minor)
print("capability", isinstance(major, int), isinstance(minor, int), same)
print("bf16", isinstance(torch.cuda.is_bf16_supported(), bool))
print("flags", torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic)
