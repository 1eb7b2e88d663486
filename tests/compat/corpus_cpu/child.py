"""CPU port of corpus/child.py."""
import torch

device = torch.device("cpu")
torch.manual_seed(0)
x = torch.randn(3, 3).to(device)
print("child available", True, "is_cuda", x.device == device)
print(f"child {(x @ x.T).trace().item():.6f}")
