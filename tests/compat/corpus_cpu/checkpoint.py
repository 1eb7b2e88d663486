"""CPU port of corpus/checkpoint.py."""
import os
import tempfile

import torch
import torch.nn as nn

device = torch.device("cpu")


def make_model():
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))


torch.manual_seed(0)
model = make_model().to(device)
opt = torch.optim.Adam(model.parameters(), lr=0.01)
x = torch.randn(5, 6).to(device)
loss = model(x).pow(2).mean()
loss.backward()
opt.step()
print(f"trained {loss.item():.6f}")

with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "ckpt.pt")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": 1}, path)
    for location in (device, device, device, None):
        ckpt = torch.load(path, map_location=location)
        print("map_location", location is not None, "on gpu", all(v.device == device for v in ckpt["model"].values()))
        fresh = make_model().to(device)
        fresh.load_state_dict(ckpt["model"])
        fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.01)
        fresh_opt.load_state_dict(ckpt["opt"])
        loss = fresh(x).pow(2).mean()
        loss.backward()
        fresh_opt.step()
        print(f"resumed step {ckpt['step']} loss {loss.item():.6f} {fresh(x).sum().item():.6f}")
    host = torch.load(path, map_location="cpu")
    model.load_state_dict(host["model"])
    print(f"from host copy {model(x).sum().item():.6f}")
