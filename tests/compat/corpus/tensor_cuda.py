"""CUDA-written: .cuda() in its spellings on tensors and modules, the availability idiom, torch.device("cuda", 0),
Tensor.to / Module.to / Module.to_empty, new_* with device=, pin_memory, is_cuda, DataParallel(device_ids=[0])."""
import torch
import torch.nn as nn

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
x = torch.randn(4, 8)
a = x.cuda()
b = torch.randn(8, 3).cuda(0)
c = torch.randn(4, 3).cuda(non_blocking=True)
print("is_cuda", a.is_cuda, b.is_cuda, c.is_cuda)

model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)).cuda()
model0 = nn.Linear(8, 3).cuda(0)
model_to = nn.Linear(8, 3).to("cuda")
model_dev = nn.Linear(8, 3).to(torch.device("cuda", 0))
model_idiom = nn.Linear(8, 3).to(device)
models = (model, model0, model_to, model_dev, model_idiom)
print("params on gpu", all(p.is_cuda for m in models for p in m.parameters()))

empty = nn.Linear(8, 3, device="meta").to_empty(device="cuda")
empty.load_state_dict(model0.state_dict())

t1 = x.to("cuda")
t2 = x.to("cuda:0", non_blocking=True)
t3 = x.to(torch.device("cuda", 0))
t4 = x.to(device=device, dtype=torch.float64)
print(f"to {(t1 + t2 + t3).sum().item():.6f} {t4.sum().item():.6f} {t4.dtype}")

z = x.new_zeros((2, 3), device="cuda")
o = x.new_ones(3, device="cuda:0")
f = x.new_full((2,), 7.0, device=torch.device("cuda", 0))
e = x.new_empty((5,), device="cuda")
n = x.new_tensor([1.0, 2.0], device="cuda")
print("new", tuple(z.shape), o.sum().item(), f.sum().item(), tuple(e.shape), n.sum().item())

pinned = torch.arange(12, dtype=torch.float32).reshape(3, 4).pin_memory()
p = pinned.cuda(non_blocking=True)
torch.cuda.synchronize()

out = model(a) + model0(a) + model_to(t1) + model_dev(t2) + model_idiom(t3) + empty(a) + c
print(f"out {out.sum().item():.6f} {out.abs().sum().item():.6f}")
print(f"matmul {(a @ b).sum().item():.6f} pinned {p.sum().item():.6f}")

dp = nn.DataParallel(model, device_ids=[0])
print(f"dataparallel {dp(a).sum().item():.6f}")
print("back on host", out.cpu().device.type)
