"""CPU port of corpus/autocast_bf16.py."""
import torch
import torch.nn as nn

device = torch.device("cpu")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4)).to(device)
x = torch.randn(8, 16).to(device)

with torch.autocast("cpu", dtype=torch.bfloat16):
    y1 = model(x)
print("amp.autocast", y1.dtype, f"{y1.float().sum().item():.6f} {y1.float().abs().sum().item():.6f}")

with torch.autocast("cpu", dtype=torch.bfloat16):
    y2 = model(x)
print("autocast", y2.dtype, torch.equal(y1, y2))

loss = y2.float().pow(2).mean()
loss.backward()
grads = [p.grad.float().abs().sum().item() for p in model.parameters()]
print(f"loss {loss.item():.6f} grads " + " ".join(f"{g:.6f}" for g in grads))


@torch.autocast("cpu", dtype=torch.bfloat16)
def project(a, b):
    return a @ b


w = torch.randn(16, 5).to(device)
p = project(x, w)
print("decorator", p.dtype, f"{p.float().sum().item():.6f}")

with torch.autocast("cpu", dtype=torch.bfloat16):
    with torch.autocast("cpu", enabled=False):
        full = x @ w
print("disabled", full.dtype, f"{full.sum().item():.6f}")
