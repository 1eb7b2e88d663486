"""CPU port: the same model and data on the CPU."""
import torch
import torch.nn as nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
device = torch.device("cpu")
x = torch.randn(16, 8)
y = torch.randn(16, 1) + torch.zeros(16, 1)
bias = torch.zeros(1).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
for step in range(3):
    optimizer.zero_grad()
    loss = nn.functional.mse_loss(model(x) + bias, y)
    loss.backward()
    optimizer.step()
print(f"loss {loss.item():.6f}")
print("one device:", len({p.device for p in model.parameters()} | {x.device, y.device, bias.device}) == 1)
