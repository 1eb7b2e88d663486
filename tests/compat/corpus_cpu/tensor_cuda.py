"""CPU port of corpus/tensor_cuda.py."""
import torch
import torch.nn as nn

device = torch.device("cpu")
torch.manual_seed(0)
x = torch.randn(4, 8)
a = x.to(device)
b = torch.randn(8, 3).to(device)
c = torch.randn(4, 3).to(device)
print("is_cuda", a.device == device, b.device == device, c.device == device)

model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)).to(device)
model0 = nn.Linear(8, 3).to(device)
model_to = nn.Linear(8, 3).to(device)
model_dev = nn.Linear(8, 3).to(device)
model_idiom = nn.Linear(8, 3).to(device)
models = (model, model0, model_to, model_dev, model_idiom)
print("params on gpu", all(p.device == device for m in models for p in m.parameters()))

empty = nn.Linear(8, 3, device="meta").to_empty(device=device)
empty.load_state_dict(model0.state_dict())

t1 = x.to(device)
t2 = x.to(device)
t3 = x.to(device)
t4 = x.to(device=device, dtype=torch.float64)
print(f"to {(t1 + t2 + t3).sum().item():.6f} {t4.sum().item():.6f} {t4.dtype}")

z = x.new_zeros((2, 3), device=device)
o = x.new_ones(3, device=device)
f = x.new_full((2,), 7.0, device=device)
e = x.new_empty((5,), device=device)
n = x.new_tensor([1.0, 2.0], device=device)
print("new", tuple(z.shape), o.sum().item(), f.sum().item(), tuple(e.shape), n.sum().item())

p = torch.arange(12, dtype=torch.float32).reshape(3, 4).to(device)

out = model(a) + model0(a) + model_to(t1) + model_dev(t2) + model_idiom(t3) + empty(a) + c
print(f"out {out.sum().item():.6f} {out.abs().sum().item():.6f}")
print(f"matmul {(a @ b).sum().item():.6f} pinned {p.sum().item():.6f}")

print(f"dataparallel {model(a).sum().item():.6f}")
print("back on host", out.cpu().device.type)
