"""CUDA-written: subprocess.run([sys.executable, "child.py"]) of a second CUDA-written file; its output is relayed."""
import os
import subprocess
import sys

import torch

here = os.path.dirname(os.path.abspath(__file__))
result = subprocess.run([sys.executable, "child.py"], cwd=here, capture_output=True, text=True)
sys.stderr.write(result.stderr)
print("child exit", result.returncode)
print(result.stdout, end="")

torch.manual_seed(1)
x = torch.randn(2, 2).cuda()
print(f"parent {x.sum().item():.6f}")
