"""CUDA-written: fp32 training loops with torch.amp.GradScaler("cuda") (with unscale_ and gradient clipping) and
torch.cuda.amp.GradScaler(). Scaling by a power of two is exact, so the losses equal an unscaled loop's."""
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
x = torch.randn(32, 10).cuda()
y = torch.randn(32, 1).cuda()

model = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 1)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
scaler = torch.amp.GradScaler("cuda")
for step in range(4):
    opt.zero_grad(set_to_none=True)
    loss = F.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    scaler.step(opt)
    scaler.update()
    print(f"amp.GradScaler step {step} loss {loss.item():.6f} norm {norm.item():.6f}")

model = nn.Linear(10, 1).cuda()
opt = torch.optim.Adam(model.parameters(), lr=0.05)
scaler = torch.cuda.amp.GradScaler()
for step in range(4):
    opt.zero_grad()
    loss = F.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    print(f"cuda.amp.GradScaler step {step} loss {loss.item():.6f}")
print(f"weights {model.weight.sum().item():.6f} {model.bias.item():.6f}")
