"""A CUDA-written transformer training step, timed with CUDA events; prints one JSON line.

Run by bench_run_overhead.py twice per round: with plain ``python`` and under ``torchport run``.
"""

import json
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F


def main() -> None:
    steps, warmup = int(sys.argv[1]), int(sys.argv[2])
    torch.manual_seed(0)
    dim, heads, layers, seq, batch, vocab = 1024, 16, 8, 512, 8, 32000
    block = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
    model = nn.Sequential(nn.Embedding(vocab, dim), nn.TransformerEncoder(block, layers, enable_nested_tensor=False),
                          nn.Linear(dim, vocab)).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tokens = torch.randint(0, vocab, (batch, seq + 1), device="cuda")
    times = []
    for step in range(warmup + steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        end.record()
        torch.cuda.synchronize()
        if step >= warmup:
            times.append(start.elapsed_time(end))
    times.sort()
    print(json.dumps({"median_ms": times[len(times) // 2], "min_ms": times[0], "tokens": batch * seq,
                      "loss": loss.item(), "device": torch.cuda.get_device_name(0)}))


if __name__ == "__main__":
    main()
