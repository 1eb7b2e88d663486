"""The autotuner's cache files: one JSON file per device model, Triton version, torchport version and timing method in
``torchport.settings.cache_dir()``/``autotune``, read leniently (a file that cannot be read or parsed is reported
once and ignored), written atomically after merging with what is there, and locked (POSIX ``flock``) while a
process tunes, so the ranks of one job tune a bucket once. :mod:`torchport.kernels.triton.autotune` decides what
goes in them.

Example:
    >>> from torchport.kernels.triton.autotune_cache import cache_path
    >>> cache_path(torch.device("cuda"))
    '/home/me/.cache/torchport/autotune/NVIDIA-H100-80GB-HBM3-9.0-triton-3.6.0-torchport-0.3.0.json'
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import re
import tempfile
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import triton

from ... import __version__, _settings
from ...backends import get_backend

__all__ = ["FORMAT", "cache_directory", "cache_path", "file_lock", "forget_warnings", "load", "read", "warn_once",
           "write"]

FORMAT = 1  # version of the file layout
# Version of the timing method, part of the file name: choices timed by an earlier method are not read. 2: launches
# queued ahead of the device (autotune._do_bench); method 1 counted the host's launch cost into short kernels' times.
TIMING = 2
_LOCK_WAIT_S = 120.0  # how long a process waits for another one's tuning before going on unlocked

logger = logging.getLogger("torchport")
_warned: set[tuple[str, str]] = set()


def forget_warnings() -> None:
    """Warn again about a cache file's problems (after the cache was cleared)."""
    _warned.clear()


@functools.lru_cache(maxsize=None)
def _describe(device_type: str, index: int) -> tuple[str, str]:
    """(device model name, capability): the part of the key that says which hardware the timings hold for."""
    backend = get_backend(device_type)
    try:
        name = backend.device_name(index)
    except Exception:  # noqa: BLE001
        name = device_type
    try:
        capability = str(backend.properties(index).get("capability") or "")
    except Exception:  # noqa: BLE001
        capability = ""
    return name, capability


def cache_path(device: torch.device) -> str:
    """The cache file for ``device``: one per device model and capability, Triton version, torchport version and
    timing method.

    Example:
        >>> cache_path(torch.device("cuda"))   # doctest: +SKIP
        '/home/me/.cache/torchport/autotune/NVIDIA-H100-80GB-HBM3-9.0-triton-3.6.0-torchport-0.1.0-timing-2.json'
    """
    name, capability = _describe(device.type, device.index or 0)
    stem = re.sub(r"[^A-Za-z0-9.]+", "-", f"{name} {capability} triton {triton.__version__} torchport {__version__} "
                                          f"timing {TIMING}")
    return os.path.join(cache_directory(), stem.strip("-") + ".json")


def cache_directory() -> str:
    return os.path.join(_settings.cache_dir(), "autotune")


def warn_once(cause: tuple[str, str], message: str) -> None:
    if cause in _warned:
        return
    _warned.add(cause)
    logger.warning(message)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def load(path: str) -> dict[str, Any] | None:
    """The whole file, None when it is absent; a file that cannot be read or parsed is warned about once."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, ValueError) as exc:
        warn_once((path, "read"), f"torchport autotune cache {path} cannot be read ({type(exc).__name__}: {exc}); "
                                   "ignoring it (delete it, or call torchport.kernels.triton.autotune.clear_cache())")
        return None
    if not (isinstance(data, dict) and data.get("format") == FORMAT and isinstance(data.get("entries"), dict)):
        warn_once((path, "format"), f"torchport autotune cache {path} is not a format-{FORMAT} cache file; ignoring "
                                     "it (delete it, or call torchport.kernels.triton.autotune.clear_cache())")
        return None
    return data


def read(path: str) -> dict[str, Any]:
    data = load(path)
    return {} if data is None else data["entries"]


def write(path: str, key: str, entry: dict[str, Any], device: torch.device) -> None:
    """Add one entry to the file: merge with what is there now, write a temporary file, rename it over."""
    name, capability = _describe(device.type, device.index or 0)
    data = {"format": FORMAT, "device": name, "capability": capability, "triton": triton.__version__,
            "torchport": __version__, "entries": {**read(path), key: entry}}
    directory = os.path.dirname(path)
    try:
        os.makedirs(directory, exist_ok=True)
        fd, temporary = tempfile.mkstemp(prefix=".autotune-", suffix=".json", dir=directory)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(temporary, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise
    except OSError as exc:
        warn_once((directory, "write"), f"torchport autotune cache cannot be written in {directory} "
                                        f"({type(exc).__name__}: {exc}); tuning results are kept for this process "
                                        "only")


@contextlib.contextmanager
def file_lock(path: str) -> Iterator[None]:
    """Exclusive across processes while a bucket is looked up, tuned and written (no-op without ``fcntl``)."""
    try:
        import fcntl
    except ImportError:  # Windows: no lock; files are still replaced atomically
        yield
        return
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        handle = open(path + ".lock", "a")  # noqa: SIM115 - closed below
    except OSError as exc:
        warn_once((os.path.dirname(path), "write"), f"torchport autotune cache cannot be written in "
                   f"{os.path.dirname(path)} ({type(exc).__name__}: {exc}); tuning results are kept for this "
                   "process only")
        yield
        return
    with handle:
        deadline = time.monotonic() + _LOCK_WAIT_S
        locked = False
        while not locked:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                locked = True
            except BlockingIOError:
                if time.monotonic() > deadline:
                    warn_once((path, "lock"), f"torchport autotune cache {path} stayed locked by another process "
                                               f"for {_LOCK_WAIT_S:.0f} s; tuning without the lock")
                    break
                time.sleep(0.01)
        try:
            yield
        finally:
            if locked:
                fcntl.flock(handle, fcntl.LOCK_UN)


# -- public helpers ------------------------------------------------------------------------------------------------
