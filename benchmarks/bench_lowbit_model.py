"""The 8B-shaped Llama of ``bench_lowbit.py`` (random weights, static KV cache) and its elementwise ops: torchport's
fused RMSNorm/RoPE/SwiGLU (``FusedOps``, the default) or plain PyTorch (``PlainOps``); ``OPS`` says which."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

SHAPES = {
    "8b": dict(hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, vocab=128256),
    "small": dict(hidden=256, intermediate=512, layers=2, heads=4, kv_heads=2, vocab=1000),
}
MAX_SEQ = 512


class Block(nn.Module):
    def __init__(self, c: dict[str, int]) -> None:
        super().__init__()
        h, d = c["hidden"], c["hidden"] // c["heads"]
        self.heads, self.kv_heads, self.head_dim = c["heads"], c["kv_heads"], d
        self.attn_norm = nn.Parameter(torch.ones(h))
        self.q_proj = nn.Linear(h, c["heads"] * d, bias=False)
        self.k_proj = nn.Linear(h, c["kv_heads"] * d, bias=False)
        self.v_proj = nn.Linear(h, c["kv_heads"] * d, bias=False)
        self.o_proj = nn.Linear(c["heads"] * d, h, bias=False)
        self.mlp_norm = nn.Parameter(torch.ones(h))
        self.gate_proj = nn.Linear(h, c["intermediate"], bias=False)
        self.up_proj = nn.Linear(h, c["intermediate"], bias=False)
        self.down_proj = nn.Linear(c["intermediate"], h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor],
                positions: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        b, t, _ = x.shape
        a = OPS.rms_norm(x, self.attn_norm, 1e-5)
        q = self.q_proj(a).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(a).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(a).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = OPS.rope(q, k, cos, sin)
        cache_k, cache_v = cache
        cache_k.index_copy_(2, positions, k)
        cache_v.index_copy_(2, positions, v)
        if mask is not None:  # decode: attend to the cache up to this position
            o = F.scaled_dot_product_attention(q, cache_k, cache_v, attn_mask=mask, enable_gqa=True)
        else:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o_proj(o.transpose(1, 2).reshape(b, t, -1))
        m = OPS.rms_norm(x, self.mlp_norm, 1e-5)
        return x + self.down_proj(OPS.swiglu(self.gate_proj(m), self.up_proj(m)))


class PlainOps:
    """RMSNorm, RoPE and SwiGLU in plain PyTorch (``--plain-ops``)."""

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)

    @staticmethod
    def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        def rotate(x: torch.Tensor) -> torch.Tensor:
            half = x.shape[-1] // 2
            return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
        return rotate(q), rotate(k)

    @staticmethod
    def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) * up


class FusedOps:
    """torchport's fused kernels (the default: what ``torchport.patch`` gives a Hugging Face Llama), the same for
    every contender, so that the step is not dominated by the launches of small element-wise kernels."""

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        from torchport import kernels

        return kernels.rms_norm(x, weight, eps)

    @staticmethod
    def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        from torchport import kernels

        return kernels.rope(q, k, cos, sin)

    @staticmethod
    def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        from torchport import kernels

        return kernels.swiglu(gate, up)


OPS: type = FusedOps


class Llama(nn.Module):
    def __init__(self, c: dict[str, int]) -> None:
        super().__init__()
        self.config = c
        self.embed = nn.Embedding(c["vocab"], c["hidden"])
        self.layers = nn.ModuleList(Block(c) for _ in range(c["layers"]))
        self.norm = nn.Parameter(torch.ones(c["hidden"]))
        self.lm_head = nn.Linear(c["hidden"], c["vocab"], bias=False)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, caches: list, decode: bool) -> torch.Tensor:
        d = self.config["hidden"] // self.config["heads"]
        inv = 1.0 / (500000.0 ** (torch.arange(0, d, 2, device=tokens.device, dtype=torch.float32) / d))
        angles = positions.float()[:, None] * inv[None, :]
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos().to(self.embed.weight.dtype), angles.sin().to(self.embed.weight.dtype)
        x = self.embed(tokens)
        mask = None
        if decode:
            mask = (torch.arange(caches[0][0].shape[2], device=x.device) <= positions[-1]).view(1, 1, 1, -1)
        for layer, cache in zip(self.layers, caches):
            x = layer(x, cos, sin, cache, positions, mask)
        return self.lm_head(OPS.rms_norm(x, self.norm, 1e-5))


def build(c: dict[str, int], device: torch.device) -> Llama:
    with torch.device("meta"):
        model = Llama(c)
    model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return model.to(torch.bfloat16).eval()


def new_caches(model: Llama, device: torch.device, batch: int = 1) -> list:
    c = model.config
    shape = (batch, c["kv_heads"], MAX_SEQ, c["hidden"] // c["heads"])
    return [(torch.zeros(shape, dtype=torch.bfloat16, device=device), torch.zeros(shape, dtype=torch.bfloat16,
             device=device)) for _ in range(c["layers"])]
