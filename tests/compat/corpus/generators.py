"""CUDA-written: torch.Generator("cuda") / torch.Generator(device="cuda") with manual_seed, random ops with a
generator and device="cuda", torch.cuda.manual_seed / manual_seed_all beside torch.manual_seed."""
import torch

torch.manual_seed(0)
torch.cuda.manual_seed(0)
torch.cuda.manual_seed_all(0)

g = torch.Generator("cuda")
g.manual_seed(123)
a = torch.randn(3, 4, generator=g, device="cuda")
g2 = torch.Generator(device="cuda").manual_seed(123)
b = torch.randn(3, 4, generator=g2, device="cuda")
print("same stream", torch.equal(a, b), g.initial_seed())
print(f"randn {a.sum().item():.6f} {a.abs().sum().item():.6f}")

r = torch.rand(5, generator=g, device="cuda")
perm = torch.randperm(8, generator=g, device="cuda")
ints = torch.randint(0, 100, (4,), generator=g, device="cuda")
normal = torch.empty(6, device="cuda").normal_(generator=g)
uniform = torch.empty(6, device="cuda").uniform_(-1, 1, generator=g)
print(f"rand {r.sum().item():.6f} normal {normal.sum().item():.6f} uniform {uniform.sum().item():.6f}")
print("perm", perm.tolist(), "ints", ints.tolist())

state = g.get_state()
first = torch.rand(3, generator=g, device="cuda")
g.set_state(state)
again = torch.rand(3, generator=g, device="cuda")
print("state restores", torch.equal(first, again))

g.manual_seed(123)
print("reseed repeats", torch.equal(torch.randn(3, 4, generator=g, device="cuda"), a))

torch.manual_seed(7)
torch.cuda.manual_seed_all(7)
global_draw = torch.randn(4, device="cuda")
print(f"global {global_draw.sum().item():.6f}")
