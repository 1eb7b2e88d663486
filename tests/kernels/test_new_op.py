"""An op is one file: a module that registers an implementation and an :class:`OpSpec` (with a custom-op schema and
nothing else) is listed, selectable with ``TORCHPORT_KERNELS``, compiled with no graph break and differentiated in
the compiled graph, with no edit anywhere else. Run in a subprocess: torch.library registrations last as long as
the process."""

from __future__ import annotations

import subprocess
import sys
import textwrap

OP_MODULE = '''
import torch

from torchport.kernels import registry
from torchport.kernels.spec import OpSpec, randn


@registry.register_kernel("softsign_scale", "reference")
def softsign_scale_reference(x, scale, alpha):
    return (x / (1 + x.abs()) * scale * alpha).to(x.dtype)


def softsign_scale(x, scale, alpha=1.0):
    """``alpha * scale * x / (1 + |x|)``."""
    if x.shape[-1:] != scale.shape:
        raise ValueError(f"softsign_scale: scale must have shape [{x.shape[-1]}], got {list(scale.shape)}")
    if torch.compiler.is_dynamo_compiling():
        return registry.custom_op("softsign_scale")(x, scale, float(alpha))
    return registry.call("softsign_scale", x.device, x, scale, float(alpha))


SPEC = registry.register_op(OpSpec(
    "softsign_scale", "SoftsignScale", "``alpha * scale * x / (1 + |x|)``", ("softsign_scale",), "rows × hidden",
    sizes={size: (5, 13) for size in ("test", "smoke", "small", "medium", "large", "benchmark")},
    make=lambda gen, rows, hidden: (randn(gen, (rows, hidden)), randn(gen, (hidden,))),
    call=softsign_scale, differentiable=2,
    bytes_moved=lambda x, scale: 5 * x.numel() * x.element_size(),
    custom_op="(Tensor x, Tensor scale, float alpha) -> Tensor",
))
'''

SCRIPT = '''
import os, sys
sys.path.insert(0, sys.argv[1])
import torch
import torchport.kernels.library  # the built-in custom ops first: a later op registers its own
import softsign_scale_op as mod
from torchport.kernels import registry
from torchport import _settings

assert "softsign_scale" in registry.list_specs()
assert "reference" in registry.list_kernels()["softsign_scale"]
os.environ["TORCHPORT_KERNELS"] = "softsign_scale=reference"
assert _settings.value("kernels")["softsign_scale"] == "reference"
assert registry.forced("softsign_scale")

x, scale = mod.SPEC.inputs("test", torch.Generator().manual_seed(0))
eager_in = [x.clone().requires_grad_(), scale.clone().requires_grad_()]
compiled_in = [x.clone().requires_grad_(), scale.clone().requires_grad_()]
fn = lambda a, b: mod.softsign_scale(a, b, 0.5).square().sum()
fn(*eager_in).backward()
explained = torch._dynamo.explain(fn)(*compiled_in)
assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
torch.compile(fn, fullgraph=True, backend="aot_eager")(*compiled_in).backward()
for a, b in zip(eager_in, compiled_in):
    torch.testing.assert_close(a.grad, b.grad)
schema = str(torch.ops.torchport.softsign_scale_backward.default._schema)
assert schema.startswith("torchport::softsign_scale_backward(Tensor[] grads, bool[] needs, Tensor? x"), schema
print("ok")
'''


def test_an_op_in_one_file_is_listed_selectable_compiled_and_differentiated(tmp_path):
    (tmp_path / "softsign_scale_op.py").write_text(textwrap.dedent(OP_MODULE))
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
