"""CUDA-written: autocast with the default dtype (float16 on CUDA): torch.amp.autocast("cuda"),
torch.autocast(device_type="cuda"), and torch.cuda.amp.autocast() as a context and as a decorator."""
import torch
import torch.nn as nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).cuda()
x = torch.randn(8, 16).cuda()
w = torch.randn(16, 5).cuda()


def show(name, y):
    low = y.dtype in (torch.float16, torch.bfloat16)
    y = y.float()
    print(name, "low precision", low, f"{y.abs().mean().item():.6f} {y.pow(2).mean().item():.6f}")


with torch.amp.autocast("cuda"):
    show("amp.autocast", model(x))

with torch.autocast(device_type="cuda"):
    show("autocast", model(x))

with torch.cuda.amp.autocast():
    show("cuda.amp.autocast", x @ w)


@torch.cuda.amp.autocast()
def forward(inp):
    return model(inp)


show("cuda.amp decorator", forward(x))

with torch.cuda.amp.autocast(enabled=False):
    y = model(x)
print("disabled", y.dtype, f"{y.abs().mean().item():.6f}")
