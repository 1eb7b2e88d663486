"""CUDA-written: factory functions and *_like with device= as "cuda", f"cuda:{rank}", torch.device("cuda", 0)."""
import torch

rank = 0
device = torch.device(f"cuda:{rank}")
host = torch.arange(6, dtype=torch.float32).reshape(2, 3)

torch.manual_seed(0)  # from here on, random numbers are drawn on the device only
made = {
    "zeros": torch.zeros(2, 3, device="cuda"),
    "ones": torch.ones(2, 3, device=device),
    "randn": torch.randn(2, 3, device="cuda:0"),
    "rand": torch.rand(4, device=torch.device("cuda", 0)),
    "arange": torch.arange(0, 10, 2, device="cuda"),
    "full": torch.full((2, 2), 3.5, device=f"cuda:{rank}"),
    "empty": torch.empty(3, 4, device="cuda"),
    "tensor": torch.tensor([[1.0, 2.0], [3.0, 4.0]], device="cuda"),
    "eye": torch.eye(3, device="cuda"),
    "randint": torch.randint(0, 10, (5,), device="cuda"),
    "linspace": torch.linspace(0, 1, 5, device="cuda"),
    "zeros_like": torch.zeros_like(host, device="cuda"),
    "ones_like": torch.ones_like(host, device="cuda:0"),
    "full_like": torch.full_like(host, 2.5, device=device),
    "empty_like": torch.empty_like(host, device="cuda"),
    "randn_like": torch.randn_like(host, device="cuda"),
}
on_device = made["randn"]
made["rand_like"] = torch.rand_like(on_device)
made["zeros_like_dev"] = torch.zeros_like(on_device)

for name, t in made.items():
    shape = tuple(t.shape)
    if name.startswith("empty"):
        print(name, shape, t.dtype)
    elif t.is_floating_point():
        print(name, shape, t.dtype, f"{t.sum().item():.6f}")
    else:
        print(name, shape, t.dtype, t.sum().item(), t.tolist())
print("one device", len({t.device for t in made.values()}) == 1, made["eye"].is_cuda)
print(f"mixed {(made['ones'] * made['full_like'] + made['randn']).sum().item():.6f}")
