"""Checkpoints of wrapped (DDP, FSDP) or plain models through ``torch.distributed.checkpoint`` (DCP).

Every rank writes its own shards in parallel; a checkpoint written by N ranks loads on any number of ranks,
including a single process without a process group (DCP reshards on load). Before loading, the checkpoint's
metadata is compared with the model on every rank, so a checkpoint of another model fails with the names and
shapes that differ instead of inside a collective (where the other ranks would wait for it).

Example:
    >>> torchport.distributed.save_checkpoint("ckpt/step100", model, optimizer)
    >>> torchport.distributed.load_checkpoint("ckpt/step100", model, optimizer)   # any world size
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any

import torch
from torch import nn

__all__ = ["CheckpointError", "load_checkpoint", "save_checkpoint"]

_INFO = "torchport.json"


class CheckpointError(ValueError):
    """The checkpoint does not fit the model (the message lists the differences) or cannot be read."""


def _dist() -> Any:
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optim_state}


def _strategy(model: nn.Module) -> str:
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        return "ddp"
    if any(type(m).__name__.startswith("FSDP") for m in model.modules()):
        return "fsdp"
    return "none"


def save_checkpoint(path: str | os.PathLike[str], model: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None) -> None:
    """Write ``model`` (and ``optimizer``) to the directory ``path``; every rank of the group must call it.

    Also writes ``torchport.json`` beside the shards: the world size, the strategy and the torch version.

    Example:
        >>> torchport.distributed.save_checkpoint("ckpt/step100", model, optimizer)
    """
    import torch.distributed.checkpoint as dcp

    path = os.fspath(path)
    dist = _dist()
    rank = dist.get_rank() if dist else 0
    world = dist.get_world_size() if dist else 1
    os.makedirs(path, exist_ok=True)
    with warnings.catch_warnings():
        # without a process group DCP warns that it assumes a single process: that is what it is here
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process.*")
        dcp.save(_state(model, optimizer), checkpoint_id=path)
    if rank == 0:
        info = {"world_size": world, "strategy": _strategy(model), "torch": torch.__version__,
                "optimizer": optimizer is not None}
        with open(os.path.join(path, _INFO), "w") as handle:
            json.dump(info, handle, indent=2)
    if dist:
        dist.barrier()


def _metadata(path: str) -> Any:
    from torch.distributed.checkpoint import FileSystemReader

    if not os.path.isdir(path):
        raise CheckpointError(f"no checkpoint directory at {path!r}")
    try:
        return FileSystemReader(path).read_metadata()
    except Exception as exc:  # noqa: BLE001 - DCP raises several types for a missing or damaged .metadata
        raise CheckpointError(
            f"{path!r} is not a readable torch.distributed.checkpoint directory ({type(exc).__name__}: {exc}); "
            "was it written completely by save_checkpoint?"
        ) from exc


def _compare(path: str, metadata: Any, state: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    stored = metadata.state_dict_metadata
    wanted = {f"model.{name}": value for name, value in state["model"].items()}
    problems: list[str] = []
    missing = sorted(set(wanted) - set(stored))
    if missing:
        problems.append(f"not in the checkpoint: {', '.join(k[6:] for k in missing[:8])}"
                        + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
    unexpected = sorted(k for k in stored if k.startswith("model.") and k not in wanted)
    if unexpected:
        problems.append(f"in the checkpoint but not in the model: {', '.join(k[6:] for k in unexpected[:8])}"
                        + (f" and {len(unexpected) - 8} more" if len(unexpected) > 8 else ""))
    for key in sorted(set(wanted) & set(stored)):
        value, entry = wanted[key], stored[key]
        if isinstance(value, torch.Tensor) and isinstance(entry, TensorStorageMetadata):
            if tuple(value.shape) != tuple(entry.size):  # a DTensor's shape is the global one
                problems.append(f"{key[6:]}: model {list(value.shape)}, checkpoint {list(entry.size)}")
    if "optimizer" in state and not any(k.startswith("optimizer.") for k in stored):
        problems.append("the checkpoint holds no optimizer state (saved without an optimizer)")
    if problems:
        info = os.path.join(path, _INFO)
        origin = ""
        if os.path.exists(info):
            with open(info) as handle:
                saved = json.load(handle)
            origin = f" (written by {saved.get('world_size')} rank(s), strategy {saved.get('strategy')})"
        raise CheckpointError(f"checkpoint {path!r}{origin} does not fit this model: " + "; ".join(problems))


def load_checkpoint(path: str | os.PathLike[str], model: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None) -> None:
    """Load ``model`` (and ``optimizer``) from a checkpoint written by :func:`save_checkpoint` with any number of
    ranks; every rank of the current group must call it (or a single process without a group).

    Raises:
        CheckpointError: the directory is missing or incomplete, or its tensors' names or shapes differ from the
            model's (all listed), checked on each rank before any collective starts.

    Example:
        >>> torchport.distributed.load_checkpoint("ckpt/step100", model, optimizer)
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    path = os.fspath(path)
    metadata = _metadata(path)
    state = _state(model, optimizer)
    _compare(path, metadata, state)
    with warnings.catch_warnings():
        # without a process group DCP warns that it assumes a single process: that is what it is here
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
        dcp.load(state, checkpoint_id=path)
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
