import torch

torch.manual_seed(0)
x = torch.randn(4, 4).cuda()
side = torch.cuda.Stream()
with torch.cuda.stream(side):
    y = x @ x.T
torch.cuda.current_stream().wait_stream(side)
torch.cuda.synchronize()
print("trace", round(y.trace().item(), 5))
print("device count is an int:", isinstance(torch.cuda.device_count(), int))
