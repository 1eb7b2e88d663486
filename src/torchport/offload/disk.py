"""The disk tier: one safetensors file per block, a manifest with checksums, and zero-copy reads through mmap.

Files are plain safetensors (``safetensors.torch.load_file`` reads them), written with a progress bar. The
manifest ``torchport-offload.json`` records each file's size and BLAKE2b digest; :func:`open_tier` checks both
before mapping a file, so a truncated or corrupted tier is refused instead of computing with wrong weights.
Tensors are views of a private (copy-on-write) memory map of the file: nothing is read until a block is copied
to the device.

A block is read with :meth:`DiskBlock.read`: copy out of the map, then drop this process's mapping of the pages
(``madvise(MADV_DONTNEED)``). The process therefore holds no copy of a disk-tier block between forwards: each
forward reads the file again, from the page cache if the kernel kept the pages there, from the disk otherwise.
:func:`evict` removes the pages from the page cache too and checks with ``mincore`` that they are gone, which is
how benchmarks time reads from the disk itself. Disk-tier weights are read-only: writes into them are not kept.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import errno
import hashlib
import json
import mmap
import os
import shutil
import struct
import sys
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from .budget import format_bytes

__all__ = ["DiskBlock", "MANIFEST", "check_dir", "evict", "open_tier", "write_tier"]

MANIFEST = "torchport-offload.json"
_FORMAT = 1
_CHUNK = 64 * 2**20
# safetensors' dtype names (https://github.com/huggingface/safetensors, format description)
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def check_dir(path: str | os.PathLike[str], needed: int) -> str:
    """Make sure ``path`` is a writable folder with room for ``needed`` bytes, before anything is moved.

    Example:
        >>> check_dir("/mnt/nvme/offload", 40 * 2**30)
        '/mnt/nvme/offload'
    """
    path = os.path.abspath(os.fspath(path))
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"disk_dir={path!r} cannot be created: {exc.strerror or exc}") from None
    if not os.path.isdir(path):
        raise ValueError(f"disk_dir={path!r} is not a folder")
    probe = os.path.join(path, f".torchport-write-test-{os.getpid()}")
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * 4096)
    except OSError as exc:
        raise ValueError(f"disk_dir={path!r} is not writable: {exc.strerror or exc}") from None
    finally:
        if os.path.exists(probe):
            os.remove(probe)
    free = shutil.disk_usage(path).free
    margin = 64 * 2**20  # headers, the manifest, and what other programs write meanwhile
    if free < needed + margin:
        raise ValueError(
            f"disk_dir={path!r} has {format_bytes(free)} free; the disk tier needs {format_bytes(needed)} "
            f"(+ {format_bytes(margin)} margin). Free space there, choose another folder, or raise host_budget"
        )
    return path


def _file_name(block: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in block) + ".safetensors"


def write_tier(
    folder: str,
    blocks: Sequence[tuple[str, dict[str, torch.Tensor]]],
    *,
    progress: bool = True,
) -> list[str]:
    """Write one safetensors file per block and the manifest; return the paths written (manifest last).

    On failure (disk full, permission) the files written so far are removed and the error re-raised.

    Example:
        >>> write_tier("/tmp/tier", [("model.layers.0", {"mlp.up_proj.weight": w})])
        ['/tmp/tier/model.layers.0.safetensors', '/tmp/tier/torchport-offload.json']
    """
    from safetensors.torch import save

    total = sum(t.numel() * t.element_size() for _, tensors in blocks for t in tensors.values())
    written: list[str] = []
    manifest: dict = {"format": _FORMAT, "blocks": {}}
    bar = _progress(progress)
    try:
        with bar:
            task = bar.add_task("writing disk tier", total=total)
            for name, tensors in blocks:
                data = save({key: t.detach().cpu().contiguous() for key, t in tensors.items()},
                            metadata={"torchport_block": name})
                path = os.path.join(folder, _file_name(name))
                written.append(path)
                digest = hashlib.blake2b(digest_size=32)
                view = memoryview(data)
                with open(path, "wb") as f:
                    for start in range(0, len(view), _CHUNK):
                        chunk = view[start:start + _CHUNK]
                        digest.update(chunk)
                        f.write(chunk)
                        bar.advance(task, len(chunk))
                manifest["blocks"][name] = {"file": os.path.basename(path), "size": len(data),
                                            "blake2b": digest.hexdigest()}
                del data, view
            path = os.path.join(folder, MANIFEST)
            written.append(path)
            with open(path, "w", encoding="utf-8") as f:
                json.dump(manifest, f, indent=1)
    except BaseException as exc:
        for path in written:
            if os.path.exists(path):
                os.remove(path)
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            raise ValueError(f"disk_dir={folder!r} filled up while the disk tier was written "
                             f"({format_bytes(total)}); the model was left as it was") from exc
        raise
    return written


def _progress(enabled: bool):  # noqa: ANN202 - a rich Progress, imported lazily
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    console = Console(stderr=True)
    return Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=True),
                    TransferSpeedColumn(), console=console, transient=True,
                    disable=not (enabled and console.is_terminal))


@dataclasses.dataclass
class DiskBlock:
    """One block's file, memory-mapped: ``tensor(key)`` is a zero-copy view of the file's bytes."""

    path: str
    data: torch.Tensor  # uint8 over the whole file
    entries: dict[str, tuple[int, int, torch.dtype, tuple[int, ...]]]  # key -> (start, end, dtype, shape)
    _map: mmap.mmap

    def tensor(self, key: str) -> torch.Tensor:
        start, end, dtype, shape = self.entries[key]
        return self.data[start:end].view(dtype).view(shape)

    def raw(self, key: str) -> torch.Tensor:
        """The tensor's bytes, as uint8."""
        start, end, _, _ = self.entries[key]
        return self.data[start:end]

    def will_need(self) -> None:
        """Ask the kernel to start reading the whole file ahead of the copy (no-op where unsupported)."""
        self._advise("MADV_WILLNEED")

    def release(self) -> None:
        """Drop this process's mapping of the file's pages (``MADV_DONTNEED``; no-op where unsupported). The
        tensors stay valid: the next access reads the file again. The page cache may still hold the pages."""
        self._advise("MADV_DONTNEED")

    def read(self, pieces: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy each ``(key, destination)``'s bytes from the file into the destination (host uint8, the tensor's
        size), then :meth:`release` the mapping, so that the next read goes to the file again."""
        self.will_need()
        try:
            for key, dst in pieces:
                dst.copy_(self.raw(key))
        finally:
            self.release()

    def evict(self) -> bool:
        """Drop the file's pages from this process's mapping and from the OS page cache (Linux:
        ``posix_fadvise(POSIX_FADV_DONTNEED)`` after ``fsync``). Returns whether the OS accepted the advice."""
        self.release()
        advise = getattr(os, "posix_fadvise", None)
        if advise is None:
            return False
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return False
        try:
            os.fsync(fd)  # dirty pages are not dropped
            advise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            return True
        except OSError:
            return False
        finally:
            os.close(fd)

    def cached_bytes(self) -> int | None:
        """Bytes of the file now in the page cache (``mincore``), or None where that cannot be known: not Linux,
        or a file this process may not write (the kernel then reports only pages the process maps itself)."""
        size = self.data.numel()
        if size == 0:
            return 0
        if _mincore is None or not os.access(self.path, os.W_OK):
            return None
        page = mmap.PAGESIZE
        pages = (size + page - 1) // page
        vec = (ctypes.c_ubyte * pages)()
        if _mincore(ctypes.c_void_p(self.data.data_ptr()), ctypes.c_size_t(size), vec) != 0:
            return None
        resident = int((torch.frombuffer(vec, dtype=torch.uint8) & 1).sum())
        return min(resident * page, size)

    def contains(self, pointer: int) -> bool:
        base = self.data.data_ptr()
        return base <= pointer < base + self.data.numel()

    def _advise(self, name: str) -> None:
        advice = getattr(mmap, name, None)
        if advice is not None and len(self._map):
            try:
                self._map.madvise(advice)
            except (OSError, ValueError):
                pass


def _load_mincore():  # noqa: ANN202 - the libc function, or None
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).mincore
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    fn.restype = ctypes.c_int
    return fn


_mincore = _load_mincore()


def _drop_system_cache() -> bool:
    """As root on Linux: write back dirty pages and drop the clean page cache (``/proc/sys/vm/drop_caches``)."""
    if not sys.platform.startswith("linux") or getattr(os, "geteuid", lambda: -1)() != 0:
        return False
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def evict(blocks: Iterable[DiskBlock], *, tolerance: float = 0.01) -> dict[str, Any]:
    """Make the next read of these disk-tier files come from the disk: drop them from this process's mapping and
    from the page cache, then check with ``mincore`` how much is still cached. When some is and this process runs
    as root, also ``sync`` and drop the whole clean page cache (``/proc/sys/vm/drop_caches``), and check again.

    Returns:
        ``{"bytes", "cached_bytes" (None: could not be checked), "verified" (at most ``tolerance`` of the bytes
        still cached), "method"}``.

    Example:
        >>> evict(open_tier("/nvme/tier").values())
        {'bytes': 4127195136, 'cached_bytes': 0, 'verified': True, 'method': 'madvise+fadvise'}
    """
    blocks = list(blocks)
    total = sum(b.data.numel() for b in blocks)
    accepted = all([b.evict() for b in blocks])
    method = "madvise(MADV_DONTNEED)+posix_fadvise(DONTNEED)" if accepted else "madvise(MADV_DONTNEED)"

    def cached() -> int | None:
        counts = [b.cached_bytes() for b in blocks]
        return None if any(c is None for c in counts) else sum(counts)

    left = cached()
    if (left is None or left > tolerance * total) and _drop_system_cache():
        method += "+drop_caches"
        left = cached()
    return {"bytes": total, "cached_bytes": left, "verified": left is not None and left <= tolerance * total,
            "method": method}


def _digest(path: str) -> str:
    digest = hashlib.blake2b(digest_size=32)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _map(path: str) -> DiskBlock:
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        header_len = struct.unpack("<Q", f.read(8))[0] if size >= 8 else size
        if not 8 + header_len <= size:
            raise ValueError(f"{path!r} is not a safetensors file (header length {header_len}, file {size} bytes)")
        header = json.loads(f.read(header_len))
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # private: writes never reach the file
    base = 8 + header_len
    entries = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        start, end = info["data_offsets"]
        entries[key] = (base + start, base + end, _DTYPES[info["dtype"]], tuple(info["shape"]))
    return DiskBlock(path, torch.frombuffer(mapped, dtype=torch.uint8), entries, mapped)


def open_tier(folder: str, *, verify: bool = True) -> dict[str, DiskBlock]:
    """Open a disk tier written by :func:`write_tier`: check every file's size and checksum, then map it.

    Raises:
        ValueError: the manifest is missing or unreadable, a file is missing, truncated or corrupted.

    Example:
        >>> tier = open_tier("/tmp/tier")
        >>> tier["model.layers.0"].tensor("mlp.up_proj.weight").shape
        torch.Size([11008, 4096])
    """
    manifest_path = os.path.join(folder, MANIFEST)
    try:
        with open(manifest_path, encoding="utf-8") as f:
            manifest = json.load(f)
        blocks = manifest["blocks"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{manifest_path!r} is not a torchport disk-tier manifest ({exc}); offload again") from None
    paths = {name: os.path.join(folder, entry["file"]) for name, entry in blocks.items()}
    for name, path in paths.items():
        if not os.path.exists(path):
            raise ValueError(f"disk tier file {path!r} (block {name!r}) is missing; offload again")
        size = os.path.getsize(path)
        if size != blocks[name]["size"]:
            raise ValueError(f"disk tier file {path!r} (block {name!r}) has {size} bytes, the manifest says "
                             f"{blocks[name]['size']}: it is truncated or was overwritten; offload again")
    if verify:
        # hashlib releases the GIL on large updates: files are checked in parallel
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
            digests = dict(zip(paths, pool.map(_digest, paths.values())))
        for name, digest in digests.items():
            if digest != blocks[name]["blake2b"]:
                raise ValueError(
                    f"disk tier file {paths[name]!r} (block {name!r}) is corrupted: its BLAKE2b checksum is "
                    f"{digest[:16]}..., the manifest recorded {blocks[name]['blake2b'][:16]}...; offload again"
                )
    return {name: _map(path) for name, path in paths.items()}
