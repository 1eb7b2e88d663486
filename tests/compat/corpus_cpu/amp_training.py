"""CPU port of corpus/amp_training.py: bfloat16 autocast, plain backward and step."""
import torch
import torch.nn as nn
import torch.nn.functional as F

device = torch.device("cpu")
torch.manual_seed(0)
x = torch.randn(16, 12).to(device)
labels = torch.randint(0, 4, (16,)).to(device)
model = nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 4)).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.2)

for step in range(3):
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x), labels)
    loss.backward()
    opt.step()
    print(f"cuda.amp step {step} loss {loss.float().item():.6f}")

for step in range(3):
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x), labels)
    loss.backward()
    opt.step()
    print(f"amp step {step} loss {loss.float().item():.6f}")

print(f"weights {sum(p.abs().sum() for p in model.parameters()).item():.6f}")
