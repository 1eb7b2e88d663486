"""CUDA-written helper run by subprocess_child.py as a second python process (not a corpus entry of its own)."""
import torch

torch.manual_seed(0)
x = torch.randn(3, 3).cuda()
print("child available", torch.cuda.is_available(), "is_cuda", x.is_cuda)
print(f"child {(x @ x.T).trace().item():.6f}")
