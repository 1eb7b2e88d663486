"""CUDA-written: devices given as integers, CUDA's index 0: .to(0), cuda(0), torch.device(0), device=0."""
import torch
import torch.nn as nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)).to(0)
device = torch.device(0)
x = torch.randn(16, 8).cuda(0)
y = torch.randn(16, 1).to(0) + torch.zeros(16, 1, device=0)
bias = torch.zeros(1).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
for step in range(3):
    optimizer.zero_grad()
    loss = nn.functional.mse_loss(model(x) + bias, y)
    loss.backward()
    optimizer.step()
print(f"loss {loss.item():.6f}")
print("one device:", len({p.device for p in model.parameters()} | {x.device, y.device, bias.device}) == 1)
