"""A training script written for CUDA, the way most are: `.cuda()`, `device="cuda"`, torch.cuda.amp, CUDA events.

It is not modified for other devices. Run it anywhere with

    torchport run --report examples/train_cuda.py

and its CUDA calls go to the device present: an Ascend NPU, a GPU, or the CPU (try the simulated NPU with
TORCHPORT_SIMULATE=npu). `python examples/train_cuda.py` needs an NVIDIA GPU. The trained weights go to
`--save-dir` (default: a new temporary directory), and the script prints where.
"""

import argparse
import os
import tempfile

import torch
import torch.nn as nn
import torch.nn.functional as F


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 64, heads: int = 4, layers: int = 2, seq: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(1, seq, dim, device="cuda"))
        block = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)
        mask = torch.triu(torch.full((seq, seq), float("-inf")), diagonal=1)
        self.register_buffer("mask", mask.cuda())

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[:, : tokens.shape[1]]
        return self.head(self.blocks(x, mask=self.mask[: tokens.shape[1], : tokens.shape[1]], is_causal=True))


def batches(steps: int, batch: int, seq: int, generator: torch.Generator):
    # A toy language: each token is the previous one plus a step (1 to 4, fixed per sequence), mod 256; the model
    # must infer the step from the context.
    for _ in range(steps):
        start = torch.randint(0, 256, (batch, 1), device="cuda", generator=generator)
        stride = torch.randint(1, 5, (batch, 1), device="cuda", generator=generator)
        yield (start + stride * torch.arange(seq + 1, device="cuda")) % 256


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--save-dir", help="where to save the trained weights (default: a new temporary directory)")
    args = parser.parse_args()

    assert torch.cuda.is_available(), "this script needs CUDA"
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.benchmark = True
    print(f"training on {torch.cuda.get_device_name(0)} ({torch.cuda.device_count()} device(s))")

    model = TinyTransformer().cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = torch.cuda.amp.GradScaler()
    generator = torch.Generator(device="cuda").manual_seed(1)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    start.record()
    for step, tokens in enumerate(batches(args.steps, args.batch, 32, generator)):
        with torch.cuda.amp.autocast():
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        if step % 20 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  loss {loss.item():.3f}")
    end.record()
    torch.cuda.synchronize()

    tokens = next(batches(1, 4, 32, generator))
    with torch.no_grad():
        accuracy = (model(tokens[:, :-1]).argmax(-1) == tokens[:, 1:]).float().mean().item()
    print(f"{args.steps} steps in {start.elapsed_time(end) / 1e3:.2f} s; next-token accuracy {accuracy:.1%}; "
          f"peak memory {torch.cuda.max_memory_allocated() / 2**20:.1f} MiB")

    save_dir = args.save_dir or tempfile.mkdtemp(prefix="tiny_transformer-")
    os.makedirs(save_dir, exist_ok=True)
    path = os.path.join(save_dir, "tiny_transformer.pt")
    torch.save(model.state_dict(), path)
    print(f"saved the weights to {path}")


if __name__ == "__main__":
    main()
