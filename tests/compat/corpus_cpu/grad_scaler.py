"""CPU port of corpus/grad_scaler.py: plain backward and step where the CUDA script used a GradScaler."""
import torch
import torch.nn as nn
import torch.nn.functional as F

device = torch.device("cpu")
torch.manual_seed(0)
x = torch.randn(32, 10).to(device)
y = torch.randn(32, 1).to(device)

model = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 1)).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
for step in range(4):
    opt.zero_grad(set_to_none=True)
    loss = F.mse_loss(model(x), y)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    opt.step()
    print(f"amp.GradScaler step {step} loss {loss.item():.6f} norm {norm.item():.6f}")

model = nn.Linear(10, 1).to(device)
opt = torch.optim.Adam(model.parameters(), lr=0.05)
for step in range(4):
    opt.zero_grad()
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    print(f"cuda.amp.GradScaler step {step} loss {loss.item():.6f}")
print(f"weights {model.weight.sum().item():.6f} {model.bias.item():.6f}")
