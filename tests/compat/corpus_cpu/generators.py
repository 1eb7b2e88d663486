"""CPU port of corpus/generators.py."""
import torch

device = torch.device("cpu")
torch.manual_seed(0)

g = torch.Generator()
g.manual_seed(123)
a = torch.randn(3, 4, generator=g, device=device)
g2 = torch.Generator().manual_seed(123)
b = torch.randn(3, 4, generator=g2, device=device)
print("same stream", torch.equal(a, b), g.initial_seed())
print(f"randn {a.sum().item():.6f} {a.abs().sum().item():.6f}")

r = torch.rand(5, generator=g, device=device)
perm = torch.randperm(8, generator=g, device=device)
ints = torch.randint(0, 100, (4,), generator=g, device=device)
normal = torch.empty(6, device=device).normal_(generator=g)
uniform = torch.empty(6, device=device).uniform_(-1, 1, generator=g)
print(f"rand {r.sum().item():.6f} normal {normal.sum().item():.6f} uniform {uniform.sum().item():.6f}")
print("perm", perm.tolist(), "ints", ints.tolist())

state = g.get_state()
first = torch.rand(3, generator=g, device=device)
g.set_state(state)
again = torch.rand(3, generator=g, device=device)
print("state restores", torch.equal(first, again))

g.manual_seed(123)
print("reseed repeats", torch.equal(torch.randn(3, 4, generator=g, device=device), a))

torch.manual_seed(7)
global_draw = torch.randn(4, device=device)
print(f"global {global_draw.sum().item():.6f}")
