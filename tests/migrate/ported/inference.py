import os
import tempfile

import torch


def sample(logits):
    generator = torch.Generator(device="cpu")
    generator.manual_seed(1234)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 3, generator=generator)


def main():
    torch.manual_seed(0)
    net = torch.nn.Linear(6, 10)
    path = os.path.join(tempfile.mkdtemp(), "net.pt")
    torch.save(net.state_dict(), path)
    net.load_state_dict(torch.load(path, map_location="cpu"))
    net = net.eval()
    x = torch.randn(2, 6)
    with torch.no_grad():
        logits = net(x)
    print("sample", sample(logits).tolist())
    print("logits", [round(v, 5) for v in logits[0].tolist()])
    print("cpu run")
    print("same device:", True)


if __name__ == "__main__":
    main()
