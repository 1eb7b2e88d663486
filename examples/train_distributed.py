"""Train a Llama-shaped model data-parallel on whatever is present: NPUs (hccl), GPUs (nccl) or CPUs (gloo).

The same file, unchanged, on every device and any number of processes:

    python examples/train_distributed.py                                          # one process, tiny model
    torchport run --nproc-per-node 2 examples/train_distributed.py --strategy fsdp
    torchrun --nproc-per-node 8 examples/train_distributed.py --preset llama-1b   # plain torchrun works too

Each step, rank r trains on its rows of a global batch drawn from a fixed seed, so any world size (and
``--grad-accum`` on fewer processes) sees the same data and follows the same loss curve. torchport's kernels are
patched into the model (``torchport.patch``) before it is wrapped (``torchport.distributed.wrap``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import torchport
import torchport.backends
import torchport.distributed as td

PRESETS = {
    # hidden, intermediate, layers, heads, kv heads, vocab, rows per process, sequence length
    "tiny": dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1000, batch=2, seq=64),
    # the Llama shape of the project's benchmarks (1.2 B parameters)
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, batch=4, seq=2048),
}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--strategy", choices=["ddp", "fsdp", "none"], default="ddp",
                        help="none: no wrapping (one process only)")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps after the warm-up")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (kernel compilation, allocator)")
    parser.add_argument("--grad-accum", type=int, default=1,
                        help="micro-batches per step, each of --batch rows (covers a larger global batch)")
    parser.add_argument("--checkpointing", action="store_true", help="recompute activations in the backward")
    parser.add_argument("--reduce-dtype", choices=["auto", "float32", "param"], default="auto",
                        help="dtype of the gradient reduction: torchport's choice, float32, or the parameters' own")
    parser.add_argument("--no-patch", action="store_true", help="leave out torchport's kernels")
    parser.add_argument("--save", type=Path, help="write a checkpoint there after training")
    parser.add_argument("--json", type=Path, help="write the measurements there (rank 0)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    args = parse(argv)
    shape = dict(PRESETS[args.preset])
    rows, seq = shape.pop("batch"), shape.pop("seq")
    device = td.init()
    dist = torch.distributed
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.strategy == "none" and world > 1:
        raise SystemExit("--strategy none trains one process; use ddp or fsdp with several")

    config = LlamaConfig(**shape, max_position_embeddings=max(4096, seq), tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    dtype = torchport.dtype(device)  # bfloat16 where the device computes it well
    torch.manual_seed(0)  # every rank builds the same model
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    if not args.no_patch:
        torchport.patch(model)
    if args.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    reduce = {"auto": "auto", "float32": torch.float32, "param": None}[args.reduce_dtype]
    wrapped = model if args.strategy == "none" else td.wrap(model, args.strategy, reduce_dtype=reduce)
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-4)

    global_rows = rows * world * args.grad_accum
    losses, times = [], []
    backend = torchport.backends.get_backend(device.type)
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            torchport.synchronize(device)
            backend.reset_peak_memory_stats(device.index or 0)
        start = time.perf_counter()
        batch = torch.randint(0, config.vocab_size, (global_rows, seq),
                              generator=torch.Generator().manual_seed(1000 + step))
        total = torch.zeros((), device=device)
        for micro in range(args.grad_accum):
            first = (rank * args.grad_accum + micro) * rows
            tokens = batch[first:first + rows].to(device, non_blocking=True)
            loss = wrapped(input_ids=tokens, labels=tokens).loss / args.grad_accum
            loss.backward()
            total += loss.detach()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(total)
        losses.append(total.item() / world)  # .item() waits for the step
        times.append(time.perf_counter() - start)

    timed = times[args.warmup:]
    stats = backend.memory_stats(device.index or 0)
    peak = stats.get("peak_allocated") or stats.get("process_peak_rss") or 0
    peaks = torch.tensor([float(peak)], device=device)
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    result = {
        "preset": args.preset, "strategy": args.strategy, "world_size": world, "device": str(device),
        "device_name": backend.device_name(device.index or 0),
        "rows_per_process": rows, "seq": seq, "grad_accum": args.grad_accum, "global_batch": global_rows,
        "checkpointing": args.checkpointing, "patched": not args.no_patch,
        "reduce_dtype": args.reduce_dtype,
        "tokens_per_s": global_rows * seq * len(timed) / sum(timed) if timed else None,
        "step_ms": [round(t * 1e3, 2) for t in timed], "losses": losses,
        "peak_memory_gib_per_process": float(peaks.item()) / 2**30,
    }
    if args.save:
        td.save_checkpoint(args.save, wrapped, optimizer)
    if rank == 0:
        tps = f"{result['tokens_per_s']:.0f}" if timed else "n/a"
        print(f"{args.preset} {args.strategy} on {world} x {device.type}: {tps} tokens/s, peak "
              f"{result['peak_memory_gib_per_process']:.2f} GiB per process, losses "
              + " ".join(f"{loss:.4f}" for loss in losses))
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(result, indent=2))
    # free DDP's reducer while its process group still exists (freed after, it can wait forever on gloo)
    del wrapped, model, optimizer
    dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
