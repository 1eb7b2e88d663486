import os
import sys
import tempfile

import torch

DEVICE_NAME = "cuda:0"


def sample(logits, rank=0):
    generator = torch.Generator(device=f"cuda:{rank}")
    generator.manual_seed(1234)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 3, generator=generator)


def main():
    torch.manual_seed(0)
    net = torch.nn.Linear(6, 10)
    path = os.path.join(tempfile.mkdtemp(), "net.pt")
    torch.save(net.state_dict(), path)
    state = torch.load(path, map_location="cuda")
    net.load_state_dict(state)
    net = net.to(DEVICE_NAME).eval()
    x = torch.randn(2, 6).to(torch.device("cuda", 0))
    with torch.no_grad():
        logits = net(x)
    print("sample", sample(logits).tolist())
    print("logits", [round(v, 5) for v in logits[0].tolist()])
    if "cuda" in DEVICE_NAME:
        print("accelerator run on", torch.cuda.device_count() >= 0)
    else:
        print("cpu run")
    print("same device:", logits.device == x.device, file=sys.stdout)


if __name__ == "__main__":
    main()
