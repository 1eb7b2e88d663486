"""CPU port of corpus/subprocess_child.py."""
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
x = torch.randn(2, 2)
print(f"parent {x.sum().item():.6f}")
