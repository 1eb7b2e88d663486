import torch

torch.manual_seed(0)
x = torch.randn(4, 4)
y = x @ x.T
print("trace", round(y.trace().item(), 5))
print("device count is an int:", True)
