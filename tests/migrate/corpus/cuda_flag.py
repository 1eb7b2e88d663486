"""Written for CUDA as PyTorch's super-resolution example is: --cuda asks for the GPU, the script refuses to start when
it finds none, and the device follows the flag. On a CPU the migrated script is called without --cuda, as migrate's
report says; three Adam steps of a small convolutional net."""
import argparse

import torch
import torch.nn as nn

parser = argparse.ArgumentParser(description="a tiny super-resolution-style net")
parser.add_argument("--cuda", action="store_true", help="use cuda?")
parser.add_argument("--seed", type=int, default=123, help="random seed to use")
opt = parser.parse_args()

if opt.cuda and not torch.cuda.is_available():
    raise Exception("No GPU found, please run without --cuda")

torch.manual_seed(opt.seed)
device = torch.device("cuda" if opt.cuda else "cpu")
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
