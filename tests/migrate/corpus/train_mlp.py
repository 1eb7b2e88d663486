"""A small regression MLP written for CUDA: seeding, moves to the GPU, non_blocking copies, synchronize, memory."""
import torch
import torch.nn as nn

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def main():
    torch.manual_seed(0)
    torch.cuda.manual_seed_all(0)  # the GPU generators too
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).cuda()
    inputs = torch.randn(64, 8).cuda(non_blocking=True)
    targets = inputs.sum(dim=1, keepdim=True).sin().cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.cuda.reset_peak_memory_stats()
    for step in range(6):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        torch.cuda.synchronize()
        print(f"step {step} loss {loss.item():.6f}")
    print("on accelerator:", inputs.is_cuda, "device string ok:", device.type == "cuda")
    print("peak MiB >= 0:", torch.cuda.max_memory_allocated() / 2**20 >= 0)
    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
