"""CUDA-written, as older GAN and example code is: torch.cuda's legacy typed constructors (FloatTensor from an
ndarray, from sizes, from a list; LongTensor from an ndarray and from a size), Tensor.type(torch.cuda.X) and its
string form, Module.type, isinstance against the types, the default tensor type; a small classifier trains four steps
with them."""
import numpy as np
import torch
import torch.nn as nn

cuda = torch.cuda.is_available()
Tensor = torch.cuda.FloatTensor if cuda else torch.FloatTensor
LongTensor = torch.cuda.LongTensor if cuda else torch.LongTensor

rng = np.random.default_rng(0)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).type(torch.cuda.FloatTensor)
optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
for step in range(4):
    x = Tensor(rng.normal(size=(16, 6)))  # a float64 array: float32 on the device
    y = LongTensor(rng.integers(0, 3, 16))
    weight = Tensor(16).fill_(1.0)  # sizes: uninitialised, then filled
    weight[: 4 * (step + 1)] = 0.5
    loss = (nn.functional.cross_entropy(model(x), y, reduction="none") * weight).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(f"step {step} loss {loss.item():.6f}")

a = torch.cuda.FloatTensor(2, 3)
b = torch.cuda.LongTensor(4)
c = torch.cuda.FloatTensor([1.0, 2.0])
d = torch.cuda.FloatTensor(torch.Size([3, 1]))
e = torch.cuda.DoubleTensor(np.arange(3))
f = torch.cuda.HalfTensor([0.5]), torch.cuda.BFloat16Tensor(2), torch.cuda.ByteTensor([1, 255])
g = torch.cuda.IntTensor([7]), torch.cuda.ShortTensor(1), torch.cuda.CharTensor([-1]), torch.cuda.BoolTensor([1, 0])
for name, t in (("sizes", a), ("long", b), ("list", c), ("size", d)):
    print(name, tuple(t.shape), t.dtype)
print("list", c.tolist(), "array", e.dtype, e.tolist(), [t.dtype for t in (*f, *g)], g[3].tolist())

host = torch.arange(4)
as_float = host.type(torch.cuda.FloatTensor)
as_half = host.type("torch.cuda.HalfTensor")
as_long = as_float.type(torch.cuda.LongTensor, non_blocking=True)
print("type", as_float.dtype, as_half.dtype, as_long.dtype, as_float.sum().item(), as_half.sum().item())
print("same device", len({t.device for t in (x, a, b, c, e, as_float, as_half, as_long,
                                              next(model.parameters()))}) == 1)
print("isinstance", isinstance(x, torch.cuda.FloatTensor), isinstance(y, torch.cuda.LongTensor),
      isinstance(y, torch.cuda.FloatTensor), isinstance(as_half, torch.cuda.HalfTensor))
print("already", as_float.type(torch.cuda.FloatTensor) is as_float)
torch.set_default_tensor_type(torch.cuda.DoubleTensor)
made = torch.ones(2)
print("default", made.dtype, made.device == x.device)
