"""CPU port of corpus/factories.py."""
import torch

device = torch.device("cpu")
host = torch.arange(6, dtype=torch.float32).reshape(2, 3)

torch.manual_seed(0)
made = {
    "zeros": torch.zeros(2, 3, device=device),
    "ones": torch.ones(2, 3, device=device),
    "randn": torch.randn(2, 3, device=device),
    "rand": torch.rand(4, device=device),
    "arange": torch.arange(0, 10, 2, device=device),
    "full": torch.full((2, 2), 3.5, device=device),
    "empty": torch.empty(3, 4, device=device),
    "tensor": torch.tensor([[1.0, 2.0], [3.0, 4.0]], device=device),
    "eye": torch.eye(3, device=device),
    "randint": torch.randint(0, 10, (5,), device=device),
    "linspace": torch.linspace(0, 1, 5, device=device),
    "zeros_like": torch.zeros_like(host, device=device),
    "ones_like": torch.ones_like(host, device=device),
    "full_like": torch.full_like(host, 2.5, device=device),
    "empty_like": torch.empty_like(host, device=device),
    "randn_like": torch.randn_like(host, device=device),
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
print("one device", len({t.device for t in made.values()}) == 1, made["eye"].device == device)
print(f"mixed {(made['ones'] * made['full_like'] + made['randn']).sum().item():.6f}")
