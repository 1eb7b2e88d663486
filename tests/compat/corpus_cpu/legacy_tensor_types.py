"""CPU port of corpus/legacy_tensor_types.py: torch.tensor/torch.empty with a dtype, Tensor.to(dtype)."""
import numpy as np
import torch
import torch.nn as nn

device = torch.device("cpu")

rng = np.random.default_rng(0)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(device, torch.float32)
optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
for step in range(4):
    x = torch.tensor(rng.normal(size=(16, 6)), dtype=torch.float32, device=device)
    y = torch.tensor(rng.integers(0, 3, 16), dtype=torch.int64, device=device)
    weight = torch.empty(16, device=device).fill_(1.0)
    weight[: 4 * (step + 1)] = 0.5
    loss = (nn.functional.cross_entropy(model(x), y, reduction="none") * weight).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(f"step {step} loss {loss.item():.6f}")

a = torch.empty(2, 3, device=device)
b = torch.empty(4, dtype=torch.int64, device=device)
c = torch.tensor([1.0, 2.0], device=device)
d = torch.empty(torch.Size([3, 1]), device=device)
e = torch.tensor(np.arange(3), dtype=torch.float64, device=device)
f = (torch.tensor([0.5], dtype=torch.float16), torch.empty(2, dtype=torch.bfloat16),
     torch.tensor([1, 255], dtype=torch.uint8))
g = (torch.tensor([7], dtype=torch.int32), torch.empty(1, dtype=torch.int16), torch.tensor([-1], dtype=torch.int8),
     torch.tensor([1, 0], dtype=torch.bool))
for name, t in (("sizes", a), ("long", b), ("list", c), ("size", d)):
    print(name, tuple(t.shape), t.dtype)
print("list", c.tolist(), "array", e.dtype, e.tolist(), [t.dtype for t in (*f, *g)], g[3].tolist())

host = torch.arange(4)
as_float = host.to(device, torch.float32)
as_half = host.to(device, torch.float16)
as_long = as_float.to(device, torch.int64, non_blocking=True)
print("type", as_float.dtype, as_half.dtype, as_long.dtype, as_float.sum().item(), as_half.sum().item())
print("same device", len({t.device for t in (x, a, b, c, e, as_float, as_half, as_long,
                                              next(model.parameters()))}) == 1)
print("isinstance", x.dtype == torch.float32, y.dtype == torch.int64, y.dtype == torch.float32,
      as_half.dtype == torch.float16)
print("already", as_float.to(device, torch.float32) is as_float)
torch.set_default_dtype(torch.float64)
made = torch.ones(2)
print("default", made.dtype, made.device == x.device)
