"""Where each block of a model goes: the device, pinned host memory, or disk. Pure arithmetic, nothing moves.

A model is split into *blocks* (its repeated layers) and everything else (embeddings, final norm, lm_head,
buffers, and parameters shared between blocks), which always stays on the device. Offloaded blocks run from a small
pool of reusable device buffers: ``min(prefetch + 1, offloaded blocks)`` buffers, each as large as the largest
offloaded block. So the device holds

    resident bytes + bytes of device-tier blocks + buffers x largest offloaded block  <=  budget

and the planner keeps as many blocks on the device as that allows (the first ones in execution order).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any, Union

import torch
from torch import nn

from .budget import format_bytes

__all__ = ["BlockPlacement", "Blocks", "ModelBlocks", "Placement", "TIERS", "find_blocks", "place"]

TIERS = ("device", "host", "disk")
Blocks = Union[str, nn.ModuleList, Sequence[nn.Module], None]


@dataclasses.dataclass(frozen=True)
class BlockPlacement:
    """One block: its module name, its tier and the bytes of its own parameters."""

    name: str
    tier: str
    bytes: int


@dataclasses.dataclass(frozen=True)
class Placement:
    """The placement of a model's weights: block -> tier, and the bytes each tier holds.

    ``resident_bytes`` counts what is not in a block (always on the device); ``buffer_bytes`` is the pool of
    reusable device buffers that offloaded blocks run from; ``staging_bytes`` the pinned host buffers that disk
    reads go through.
    """

    device: str
    budget: int
    prefetch: int
    blocks: tuple[BlockPlacement, ...]
    resident_bytes: int
    buffers: int
    buffer_bytes: int
    staging_bytes: int
    host_budget: int | None

    def tiers(self) -> dict[str, str]:
        """``{block name: tier}``."""
        return {block.name: block.tier for block in self.blocks}

    def tier_bytes(self, tier: str) -> int:
        """Bytes of the blocks placed on one tier."""
        return sum(block.bytes for block in self.blocks if block.tier == tier)

    @property
    def device_bytes(self) -> int:
        """Everything the device holds for the weights: resident, device-tier blocks, and the buffer pool."""
        return self.resident_bytes + self.tier_bytes("device") + self.buffer_bytes

    @property
    def host_bytes(self) -> int:
        """Pinned host memory: host-tier blocks and the disk staging buffers."""
        return self.tier_bytes("host") + self.staging_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device, "budget": self.budget, "prefetch": self.prefetch,
            "host_budget": self.host_budget, "resident_bytes": self.resident_bytes, "buffers": self.buffers,
            "buffer_bytes": self.buffer_bytes, "staging_bytes": self.staging_bytes,
            "device_bytes": self.device_bytes, "host_bytes": self.host_bytes, "disk_bytes": self.tier_bytes("disk"),
            "blocks": [dataclasses.asdict(block) for block in self.blocks],
        }

    def __str__(self) -> str:
        counts = {tier: sum(1 for b in self.blocks if b.tier == tier) for tier in TIERS}
        lines = [
            f"offload placement on {self.device} (budget {format_bytes(self.budget)}, prefetch {self.prefetch})",
            f"  device: {format_bytes(self.device_bytes)} = {format_bytes(self.resident_bytes)} outside blocks + "
            f"{counts['device']} blocks {format_bytes(self.tier_bytes('device'))} + {self.buffers} buffers "
            f"{format_bytes(self.buffer_bytes)}",
            f"  host:   {counts['host']} blocks {format_bytes(self.tier_bytes('host'))}"
            + (f" + staging {format_bytes(self.staging_bytes)}" if self.staging_bytes else ""),
            f"  disk:   {counts['disk']} blocks {format_bytes(self.tier_bytes('disk'))}",
        ]
        lines += [f"    {b.name:<40} {b.tier:<6} {format_bytes(b.bytes)}" for b in self.blocks]
        return "\n".join(lines)


#: Every parameter of an offloaded block starts on this boundary (bytes) in its host, staging and device buffers,
#: so a block's size is the sum of its parameters' sizes rounded up to it.
ALIGN = 256


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


@dataclasses.dataclass
class ModelBlocks:
    """A model split into blocks: for each block its name, module and own parameters; the rest is resident."""

    names: list[str]
    modules: list[nn.Module]
    params: list[list[nn.Parameter]]  # the block's own parameters, each once, in registration order
    resident_bytes: int

    def block_bytes(self) -> list[int]:
        """Each block's bytes as laid out in offload buffers (parameters aligned to :data:`ALIGN`)."""
        return [sum(aligned(_nbytes(p)) for p in params) for params in self.params]


def _candidate_lists(model: nn.Module) -> Iterable[tuple[str, nn.ModuleList]]:
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) >= 2:
            kinds = {type(child) for child in module}
            if len(kinds) == 1 and any(True for _ in module.parameters()):
                yield name, module


def _resolve_blocks(model: nn.Module, blocks: Blocks) -> tuple[list[str], list[nn.Module]]:
    names = {id(module): name for name, module in model.named_modules()}
    if blocks is None:
        found = sorted(_candidate_lists(model), key=lambda item: sum(_nbytes(p) for p in item[1].parameters()))
        if not found:
            raise ValueError(
                f"found no repeated layers in {type(model).__name__}: no nn.ModuleList of two or more modules of "
                "one class holds parameters. Pass blocks= (a module name such as 'model.layers', an nn.ModuleList, "
                "or a list of modules)"
            )
        blocks = found[-1][1]
    elif isinstance(blocks, str):
        try:
            blocks = model.get_submodule(blocks)
        except AttributeError as exc:
            lists = ", ".join(name for name, _ in _candidate_lists(model)) or "none"
            raise ValueError(f"blocks={blocks!r} is not a submodule of {type(model).__name__} ({exc}); "
                             f"lists of repeated layers in this model: {lists}") from None
    modules = list(blocks.children() if isinstance(blocks, nn.ModuleList) else blocks)
    if not modules:
        raise ValueError("blocks= is empty; give the model's repeated layers")
    for module in modules:
        if not isinstance(module, nn.Module) or id(module) not in names:
            raise ValueError(f"blocks= holds {type(module).__name__}, which is not a submodule of "
                             f"{type(model).__name__}")
        if module is model:
            raise ValueError("blocks= holds the model itself; give its repeated layers")
    if len({id(m) for m in modules}) != len(modules):
        raise ValueError("blocks= names one module more than once")
    inside = {id(sub) for module in modules for sub in list(module.modules())[1:]}
    nested = [names[id(m)] for m in modules if id(m) in inside]
    if nested:
        raise ValueError(f"blocks= holds modules nested in other blocks: {', '.join(nested)}")
    return [names[id(m)] for m in modules], modules


def find_blocks(model: nn.Module, blocks: Blocks = None) -> ModelBlocks:
    """Split a model into blocks (given, or the largest ``nn.ModuleList`` of same-class modules) and the rest.

    A parameter used by two blocks, or by a block and the rest of the model (tied weights), stays resident.

    Example:
        >>> find_blocks(llama).names[:2]
        ['model.layers.0', 'model.layers.1']
    """
    names, modules = _resolve_blocks(model, blocks)
    owners: dict[int, set[int]] = {}
    everything: dict[int, torch.Tensor] = {}
    # by path, not by module: a module reachable both inside a block and elsewhere (tied layers) counts for both
    for path, module in model.named_modules(remove_duplicate=False):
        owner = next((i for i, name in enumerate(names) if path == name or path.startswith(name + ".")), -1)
        for p in module._parameters.values():
            if p is not None:
                owners.setdefault(id(p), set()).add(owner)
                everything[id(p)] = p
        for b in module._buffers.values():
            if b is not None:
                owners.setdefault(id(b), set()).add(-1)  # buffers are small and stay on the device
                everything[id(b)] = b
    params: list[list[nn.Parameter]] = []
    for i, module in enumerate(modules):
        own: dict[int, nn.Parameter] = {}
        for p in module.parameters():
            if owners[id(p)] == {i}:
                own.setdefault(id(p), p)
        params.append(list(own.values()))
    owned = {id(p) for group in params for p in group}
    resident = sum(_nbytes(t) for key, t in everything.items() if key not in owned)
    return ModelBlocks(names, modules, params, resident)


def place(
    names: Sequence[str],
    sizes: Sequence[int],
    resident_bytes: int,
    budget: int,
    *,
    prefetch: int,
    host_budget: int | None,
    disk: bool,
    device: str,
    streams: bool = True,
) -> Placement:
    """Choose each block's tier (see the module docstring for the rule). Raises ValueError when nothing fits.

    Without streams (``streams=False``) blocks are copied when they run: one device buffer, no staging buffers.

    Example:
        >>> place(["a", "b"], [10, 10], 0, 20, prefetch=1, host_budget=None, disk=False, device="cpu").tiers()
        {'a': 'device', 'b': 'device'}
    """
    if prefetch < 0:
        raise ValueError(f"prefetch={prefetch} must be 0 or more (blocks copied ahead of the one computing)")
    n = len(sizes)
    ahead = prefetch if streams else 0
    if resident_bytes > budget:
        raise ValueError(
            f"budget {format_bytes(budget)} is smaller than the weights outside the blocks "
            f"({format_bytes(resident_bytes)}: embeddings, norms, heads, buffers and shared weights), which always "
            "stay on the device; raise the budget"
        )
    chosen: tuple[int, int, int] | None = None  # (resident blocks, buffers, buffer size)
    for k in range(n, -1, -1):
        offloaded = sizes[k:]
        buffers = min(ahead + 1, len(offloaded))
        biggest = max(offloaded, default=0)
        if resident_bytes + sum(sizes[:k]) + buffers * biggest <= budget:
            chosen = (k, buffers, biggest)
            break
    if chosen is None:
        largest = max(range(n), key=lambda i: sizes[i])
        buffers = min(ahead + 1, n)
        need = resident_bytes + buffers * sizes[largest]
        hint = f" or lower prefetch (prefetch=0 needs {format_bytes(resident_bytes + sizes[largest])})" \
            if buffers > 1 else ""
        raise ValueError(
            f"budget {format_bytes(budget)} is too small: the largest block, {names[largest]!r}, holds "
            f"{format_bytes(sizes[largest])}, and running offloaded blocks needs {buffers} device buffer(s) of that "
            f"size (prefetch={prefetch}) plus {format_bytes(resident_bytes)} outside the blocks = "
            f"{format_bytes(need)}; raise the budget to at least that{hint}"
        )
    k, buffers, biggest = chosen
    tiers = ["device"] * k
    host_used = 0
    for size in sizes[k:]:
        if host_budget is None or host_used + size <= host_budget:
            tiers.append("host")
            host_used += size
        else:
            tiers.append("disk")
    on_disk = [size for size, tier in zip(sizes, tiers) if tier == "disk"]
    if on_disk and not disk:
        raise ValueError(
            f"host_budget {format_bytes(host_budget)} holds {tiers.count('host')} of {n - k} offloaded blocks; "
            f"the other {len(on_disk)} ({format_bytes(sum(on_disk))}) need a disk tier: pass disk_dir=, or raise "
            "host_budget"
        )
    staging = min(2, len(on_disk)) * max(on_disk, default=0) if streams else 0
    blocks = tuple(BlockPlacement(name, tier, size) for name, tier, size in zip(names, tiers, sizes))
    return Placement(device, budget, prefetch, blocks, resident_bytes, buffers if k < n else 0,
                     (buffers * biggest) if k < n else 0, staging, host_budget)
