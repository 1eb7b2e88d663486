"""CUDA-written, as timm's train.py is: the program hands its --device ("cuda", "cuda:0") to a library's own
device helper, which asserts torch.cuda.is_available() before torch.device(device); the library then trains the
model on that device. The library (timm/ beside this script, a stand-in) asking on its own gets torch's answer."""
import argparse

import torch
import torch.nn as nn

import timm

parser = argparse.ArgumentParser()
parser.add_argument("--device", default="cuda")
args = parser.parse_args()

device = timm.setup_device(args.device)
indexed = timm.setup_device("cuda:0")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 1)).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
batches = [(torch.randn(16, 5), torch.randn(16, 1)) for _ in range(4)]
for epoch in range(2):
    losses = timm.train(model, batches, optimizer, device)
    print(f"epoch {epoch} loss {sum(losses) / len(losses):.6f}")
print("model on the device", next(model.parameters()).device == torch.ones(1, device=indexed).device)
print("library asking on its own", timm.has_cuda())
