"""cuda_flag.py ported by hand to the CPU (called without --cuda)."""
import argparse

import torch
import torch.nn as nn

parser = argparse.ArgumentParser(description="a tiny super-resolution-style net")
parser.add_argument("--seed", type=int, default=123, help="random seed to use")
opt = parser.parse_args()

torch.manual_seed(opt.seed)
device = torch.device("cpu")
model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.Tanh(), nn.Conv2d(4, 1, 3, padding=1)).to(device)
criterion = nn.MSELoss()
optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
low, high = torch.randn(4, 1, 8, 8).to(device), torch.randn(4, 1, 8, 8).to(device)
for epoch in range(3):
    loss = criterion(model(low), high)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(f"epoch {epoch} loss {loss.item():.6f}")
