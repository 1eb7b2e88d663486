"""Launch variants of torchport's Triton cross-entropy kernel (loss and gradient in one kernel) at 8192 rows.

For each vocabulary size and each variant (:class:`torchport.kernels.triton.cross_entropy.Launch`): the kernel's
median time (``triton.testing.do_bench``, L2 cleared before each repetition), as a share of the device-to-device
copy ceiling measured in the same run, counting the fewest bytes (read the logits once, write their gradient once:
2·N·V·s). Every variant's losses and gradient are checked against a float32 PyTorch computation first.

    PYTHONPATH=$PWD/src python3 benchmarks/bench_ce_variants.py                  # H100: ~1 minute
    PYTHONPATH=$PWD/src python3 benchmarks/bench_ce_variants.py --vocab 128256 --json /tmp/v.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os

import torch
import torch.nn.functional as F

from torchport.kernels.triton import cross_entropy as kernel
from torchport.kernels.triton import multiprocessor_count

HERE = os.path.dirname(os.path.abspath(__file__))
Launch = kernel.Launch


def variants(v: int, sms: int) -> dict[str, Launch | None]:
    """The default launch first (None), then the alternatives worth timing at ``v`` columns (the first run's
    persistent grids of 1-4 programs per multiprocessor measured 57-74% at 128256 columns: ``--all`` times them)."""
    out: dict[str, Launch | None] = {"default": None}
    width = 1 << (v - 1).bit_length()
    if width <= 16384:
        for rows in (1, 2, 4, 8, 16):
            for warps in (4, 8, 16) if ALL else (4, 8):
                if 512 <= rows * width <= 16384:
                    out[f"rows m={rows} w={warps}"] = Launch("rows", rows, warps)
    if width > 4096:
        out["chunked 1/row b=8192 w=16"] = Launch("chunked", 8192, 16, 0)
        if width > 32768:
            for per_sm, block, warps in ((1, 16384, 32), (1, 8192, 32), (2, 8192, 16), (1, 32768, 32)):
                out[f"prefetch persistent {per_sm}/SM b={block} w={warps}"] = Launch("chunked", block, warps, per_sm,
                                                                                     prefetch=True)
        out["chunked 1/row (old: forward, no hints)"] = Launch("chunked", 8192, 16, 0, reverse=False, evict=False)
        out["chunked 1/row b=16384 w=32"] = Launch("chunked", 16384, 32, 0)
        out["chunked 1/row b=8192 w=8"] = Launch("chunked", 8192, 8, 0)
        out["chunked 1/row b=4096 w=8"] = Launch("chunked", 4096, 8, 0)
    if ALL and width > 16384:
        for per_sm in (1, 2, 4):
            for block, warps in ((8192, 16), (16384, 32), (4096, 8)):
                out[f"persistent {per_sm}/SM b={block} w={warps}"] = Launch("chunked", block, warps, per_sm)
            out[f"persistent {per_sm}/SM no-reverse"] = Launch("chunked", 8192, 16, per_sm, reverse=False)
            out[f"persistent {per_sm}/SM no-evict"] = Launch("chunked", 8192, 16, per_sm, evict=False)
    return out


ALL = False


def copy_gbps(device: torch.device, do_bench) -> float:
    src = torch.randn(512 * 2**20, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * src.numel() * 2 / (ms * 1e-3) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--vocab", default="256,1024,4096,16384,32000,65536,128256,262144")
    parser.add_argument("--json", default=os.path.join(HERE, "results", "ce_variants.json"))
    parser.add_argument("--all", action="store_true", help="also the persistent grids and more warps")
    args = parser.parse_args()
    global ALL
    ALL = args.all
    from triton.testing import do_bench

    device = torch.device("cuda")
    sms = multiprocessor_count(device)
    ceiling = copy_gbps(device, do_bench)
    print(f"{torch.cuda.get_device_name(device)}, copy ceiling {ceiling:.0f} GB/s, {sms} SMs")
    results = []
    for v in [int(x) for x in args.vocab.split(",")]:
        n = args.rows
        gen = torch.Generator(device=device).manual_seed(v)
        x = (torch.randn(n, v, generator=gen, device=device) * 2).to(torch.bfloat16)
        t = torch.randint(0, v, (n,), generator=gen, device=device)
        t[::7] = -100
        scale = torch.full((1,), 1.0 / int((t != -100).sum()), device=device)
        grad = torch.empty_like(x)
        ref_rows = F.cross_entropy(x[:512].float(), t[:512], ignore_index=-100, reduction="none")
        ref_x = x[:512].float().requires_grad_()
        (F.cross_entropy(ref_x, t[:512], ignore_index=-100, reduction="sum") * scale).backward()
        least = 2 * x.numel() * x.element_size()
        chosen = kernel.launch_for(n, v, x.element_size(), sms)
        print(f"\n{n} x {v} bf16: {least / 1e9:.3f} GB at the least, {least / ceiling / 1e6:.4f} ms at the ceiling; "
              f"default {chosen}")
        for name, launch in variants(v, sms).items():
            try:
                rows = kernel.loss_and_grad(x, t, -100, 0.0, 0.0, scale, grad, launch)
                err_l = float((rows[:512] - ref_rows).norm() / ref_rows.norm())
                err_g = float((grad[:512].float() - ref_x.grad).norm() / ref_x.grad.norm())
                ms = do_bench(functools.partial(kernel.loss_and_grad, x, t, -100, 0.0, 0.0, scale, grad, launch),
                              warmup=25, rep=150, return_mode="median")
            except Exception as exc:  # noqa: BLE001 - a variant that does not compile is a row
                print(f"  {name:<40} error {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
                continue
            pct = 100 * least / (ms * 1e-3) / 1e9 / ceiling
            ok = "ok" if err_l < 1e-3 and err_g < 1e-2 else "FAIL"
            print(f"  {name:<40} {ms:8.4f} ms {pct:6.1f}%  err loss {err_l:.1e} grad {err_g:.1e} {ok}")
            results.append({"rows": n, "vocab": v, "variant": name, "launch": str(launch or chosen), "ms": ms,
                            "pct_ceiling": pct, "err_loss": err_l, "err_grad": err_g, "ok": ok == "ok"})
        del x, grad
        torch.cuda.empty_cache()
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(device), "copy_gbps": ceiling, "results": results}, f,
                  indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
