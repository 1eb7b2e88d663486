"""CUDA-written: the usual mixed-precision loop, torch.cuda.amp.autocast() + torch.cuda.amp.GradScaler(), then
torch.amp.autocast("cuda") + torch.amp.GradScaler("cuda"), on a small classifier."""
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
x = torch.randn(16, 12).cuda()
labels = torch.randint(0, 4, (16,)).cuda()
model = nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 4)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.2)

scaler = torch.cuda.amp.GradScaler()
for step in range(3):
    opt.zero_grad()
    with torch.cuda.amp.autocast():
        loss = F.cross_entropy(model(x), labels)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    print(f"cuda.amp step {step} loss {loss.float().item():.6f}")

scaler = torch.amp.GradScaler("cuda")
for step in range(3):
    opt.zero_grad()
    with torch.amp.autocast("cuda"):
        loss = F.cross_entropy(model(x), labels)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    print(f"amp step {step} loss {loss.float().item():.6f}")

print(f"weights {sum(p.abs().sum() for p in model.parameters()).item():.6f}")
