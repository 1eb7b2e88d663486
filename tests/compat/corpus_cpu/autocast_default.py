"""CPU port of corpus/autocast_default.py (CPU autocast in bfloat16 where the CUDA script used float16)."""
import torch
import torch.nn as nn

device = torch.device("cpu")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to(device)
x = torch.randn(8, 16).to(device)
w = torch.randn(16, 5).to(device)


def show(name, y):
    low = y.dtype in (torch.float16, torch.bfloat16)
    y = y.float()
    print(name, "low precision", low, f"{y.abs().mean().item():.6f} {y.pow(2).mean().item():.6f}")


with torch.autocast("cpu", dtype=torch.bfloat16):
    show("amp.autocast", model(x))

with torch.autocast("cpu", dtype=torch.bfloat16):
    show("autocast", model(x))

with torch.autocast("cpu", dtype=torch.bfloat16):
    show("cuda.amp.autocast", x @ w)


@torch.autocast("cpu", dtype=torch.bfloat16)
def forward(inp):
    return model(inp)


show("cuda.amp decorator", forward(x))

y = model(x)
print("disabled", y.dtype, f"{y.abs().mean().item():.6f}")
