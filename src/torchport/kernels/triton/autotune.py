"""Launch configurations chosen by timing, once per shape bucket, and remembered across processes.

Each kernel declares a :class:`Tunable`: a name, the fields of its shape bucket (say the row length rounded up to a
power of two and a coarse row count), and a function giving the candidate configurations of a bucket — block
sizes, warps, programs per multiprocessor — with the hand-tuned heuristic first. The first launch in a bucket
times every candidate on the device (median device time, L2 cleared before each run, launches queued ahead of the
device so that host time is not counted: ``_do_bench``), keeps the fastest, and writes it to a JSON file in
``torchport.settings.cache_dir()``/``autotune`` (``TORCHPORT_CACHE_DIR``), one file per device model, Triton version,
torchport version and timing method. Later launches in the process find it in a dict keyed by the exact sizes
(``Tunable.lookup``); later processes read it from the file and time nothing, unless the bucket's candidates have
changed since (a new release's): then it is timed once more.

Where nothing can be timed — Triton's interpreter on the CPU (``TRITON_INTERPRET=1``), a device without events,
inside ``torch.compile`` tracing or CUDA-graph capture — the heuristic is used and nothing is written.

Candidates that fail (too much shared memory, a compile error) are skipped, and the failure is stored with the
entry. A cache file that cannot be read or parsed is reported once with a warning and ignored; it never stops a
kernel. Processes sharing a cache directory take a lock on the file while they tune (POSIX ``flock``), so eight
ranks of one job tune a bucket once and launch the same configuration; files are replaced atomically
(temporary file + ``os.replace``) after merging with what is already there.

Example:
    >>> from torchport.kernels.triton import autotune
    >>> autotune.entries()          # what the cache holds, one dict per tuned bucket
    >>> autotune.set_enabled(False) # heuristics only, nothing timed, read or written
    >>> autotune.clear_cache()      # delete the cache files and forget this process's choices
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import statistics
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import triton

from ... import _logging
from ...backends import get_backend
from .autotune_cache import FORMAT, cache_directory, cache_path, file_lock, forget_warnings, load, read, write
from ..checks import capturing

__all__ = ["FORMAT", "Tunable", "cache_path", "clear_cache", "coarse", "distinct", "enabled", "entries",
           "list_tunables", "set_enabled", "timer"]

_WARMUP_MS, _REP_MS = 5, 25  # timing budget per candidate: 6 candidates tune in roughly 0.2-0.5 s
_CLEAR_BYTES = 256 * 2**20  # written before each timed run: more than any L2 (Triton's do_bench writes as much)
_LEAD_LIMIT = 4000  # writes queued ahead of the timed runs at most (about 0.35 s of an H100)
_MARGIN = 0.02  # another candidate replaces the heuristic only when it is at least 2% faster
_MEMO_SIZE = 4096  # distinct sizes remembered per kernel before the exact-size memo starts over

Config = dict[str, int]
Launch = Callable[[Config], Any]

#: The function that times one candidate: ``timer(run, config, device) -> milliseconds``, where ``run()``
#: launches the kernel once with ``config``. None: ``_do_bench`` (device events) where the device can be timed,
#: and no tuning elsewhere. Tests and experiments replace it (a set timer is used even under the interpreter).
timer: Callable[[Callable[[], Any], Config, torch.device], float] | None = None

logger = logging.getLogger("torchport")
_lock = threading.RLock()
_tunables: dict[str, Tunable] = {}
_enabled = True


class Tunable:
    """One kernel's launch configuration, chosen per (device, dtype, shape bucket).

    Args:
        name: unique, e.g. ``"rms_norm.forward"``; part of the cache key.
        fields: names of the bucket's values, e.g. ``("block_n", "rows")``.
        bucket: ``bucket(*sizes)`` -> the bucket (a tuple of ints, one per field) of a launch's sizes.
        candidates: ``candidates(*bucket)`` -> configurations (dicts of ints), the heuristic first, at most six.
            Every candidate must be valid for every shape in the bucket and compute the same result up to float
            rounding.
        per_device: call ``candidates(*bucket, device=device)`` instead, for kernels whose best heuristic differs
            between devices of one type (an NVIDIA or a ROCm GPU, both ``cuda``).

    Example:
        >>> FORWARD = Tunable("rms_norm.forward", ("block_n", "rows"), bucket, candidates)
        >>> config = FORWARD.lookup(x.device, x.dtype, m, n)
        >>> if config is None:
        ...     config = FORWARD.tune(x.device, x.dtype, (m, n), lambda c: launch(c, x, y))
    """

    __slots__ = ("name", "fields", "bucket", "candidates", "per_device", "_memo", "_chosen")

    def __init__(self, name: str, fields: Sequence[str], bucket: Callable[..., tuple[int, ...]],
                 candidates: Callable[..., list[Config]], per_device: bool = False) -> None:
        with _lock:
            if name in _tunables:
                raise ValueError(f"a tunable kernel named {name!r} already exists; registered: {', '.join(_tunables)}")
            _tunables[name] = self
        self.name = name
        self.fields = tuple(fields)
        self.bucket = bucket
        self.candidates = candidates
        self.per_device = per_device
        self._memo: dict[tuple[Any, ...], Config] = {}  # (device, dtype, *sizes) -> config: the hot path
        self._chosen: dict[tuple[Any, ...], Config] = {}  # (device, dtype, bucket) -> config

    def __repr__(self) -> str:
        return f"Tunable({self.name!r}, fields={self.fields})"

    def lookup(self, *key: Any) -> Config | None:
        """``lookup(device, dtype, *sizes)``: the configuration already chosen in this process for these exact
        sizes, or None (then call :meth:`tune`).

        The hot path of every launch: one dict access keyed by the sizes themselves, so no bucket is computed.
        The returned dict is shared; do not modify it.
        """
        return self._memo.get(key)

    def tune(self, device: torch.device, dtype: torch.dtype, sizes: tuple[int, ...], launch: Launch) -> Config:
        """Choose the configuration for ``sizes``' bucket: already chosen, from the cache file, by timing, or the
        heuristic.

        ``launch(config)`` runs the kernel once with ``config`` on the real inputs; it must not write over anything
        the caller still needs (the tuner runs it several times per candidate).
        """
        bucket = tuple(self.bucket(*sizes))
        with _lock:
            chosen = self._chosen.get((device, dtype, bucket))
            keep = True
            if chosen is None:
                chosen, keep = self._choose(device, dtype, bucket, launch)
                if keep:
                    self._chosen[device, dtype, bucket] = chosen
            if keep:
                if len(self._memo) >= _MEMO_SIZE:  # many distinct sizes (e.g. varying sequence lengths)
                    self._memo.clear()
                self._memo[(device, dtype, *sizes)] = chosen
            return chosen

    def key(self, dtype: torch.dtype, bucket: tuple[int, ...]) -> str:
        """The entry's key in the cache file, e.g. ``"rms_norm.forward bfloat16 block_n=4096,rows=16384"``."""
        if len(bucket) != len(self.fields):
            raise ValueError(f"{self.name}: bucket {bucket} does not match its fields {self.fields}")
        return f"{self.name} {_dtype_name(dtype)} " + ",".join(f"{f}={v}" for f, v in zip(self.fields, bucket))

    # -- the slow path: once per bucket and process ---------------------------------------------------------------
    def _choose(self, device: torch.device, dtype: torch.dtype, bucket: tuple[int, ...],
                launch: Launch) -> tuple[Config, bool]:
        """(configuration, whether to remember it in this process)."""
        listed = self.candidates(*bucket, device=device) if self.per_device else self.candidates(*bucket)
        candidates = [dict(c) for c in listed]
        if not candidates:
            raise ValueError(f"{self.name}: no candidate configuration for bucket {bucket}")
        heuristic = candidates[0]
        if not _enabled:
            return heuristic, True
        if capturing(device):
            return heuristic, False  # timing would break the trace or the graph; choose on the next eager launch
        time_one = timer if timer is not None else (_do_bench if _can_time(device) else None)
        if time_one is None:
            return heuristic, True  # Triton's interpreter or a device without events: nothing to time
        key = self.key(dtype, bucket)
        path = cache_path(device)
        with file_lock(path):
            entry = read(path).get(key)
            cached = _valid_config(entry, candidates)
            if cached is not None:
                _logging.log("kernels", "autotune %s: %s from %s", key, cached, path)
                return cached, True
            entry = _measure(key, candidates, launch, time_one, device)
            if entry is None:
                return heuristic, True
            if entry["config"] is None:
                return heuristic, True  # every candidate failed: the launch will raise its own error
            entry["shape_bucket"] = dict(zip(self.fields, bucket))
            write(path, key, entry, device)
        return entry["config"], True


def _measure(key: str, candidates: list[Config], launch: Launch, time_one: Callable[..., float],
             device: torch.device) -> dict[str, Any] | None:
    """Time every candidate; the entry to store, or None when tuning had to stop (out of memory)."""
    start = time.perf_counter()
    timings: list[dict[str, Any]] = []
    failed: list[dict[str, Any]] = []
    for config in candidates:
        try:
            launch(config)  # compiles; a config the device cannot run fails here
            ms = float(time_one(functools.partial(launch, config), config, device))
            if not (math.isfinite(ms) and ms >= 0):
                raise ValueError(f"the timer returned {ms!r} ms")
        except torch.OutOfMemoryError:
            _logging.log("kernels", "autotune %s: out of memory while timing %s; using the heuristic %s",
                         key, config, candidates[0])
            return None
        except Exception as exc:  # noqa: BLE001 - any failure of one candidate only removes that candidate
            failed.append({"config": config, "error": f"{type(exc).__name__}: {exc}"[:500]})
            continue
        timings.append({"config": config, "ms": ms})
    best = min(timings, key=lambda t: t["ms"], default=None)
    elapsed = time.perf_counter() - start
    heuristic_ms = next((t["ms"] for t in timings if t["config"] == candidates[0]), None)
    if best is not None and heuristic_ms is not None and best["ms"] > heuristic_ms * (1 - _MARGIN):
        best = timings[0]  # within timing noise of the heuristic, which was chosen by hand on a sweep: keep it
    if best is None:
        _logging.log("kernels", "autotune %s: every candidate failed (%s); using the heuristic %s",
                     key, "; ".join(f["error"] for f in failed), candidates[0])
    else:
        _logging.log("kernels", "autotune %s: timed %d candidates in %.2f s; chose %s, %.4f ms (heuristic %s, %s)%s",
                     key, len(timings), elapsed, best["config"], best["ms"], candidates[0],
                     "failed" if heuristic_ms is None else f"{heuristic_ms:.4f} ms",
                     "".join(f"; {f['config']} failed: {f['error']}" for f in failed))
    return {"config": None if best is None else best["config"], "ms": None if best is None else best["ms"],
            "timings": timings, "failed": failed, "tuned_at": time.strftime("%Y-%m-%dT%H:%M:%S")}


def _valid_config(entry: Any, candidates: list[Config]) -> Config | None:
    """The entry's configuration if it is one of today's candidates and was chosen among exactly today's candidates
    (the configurations it timed and those that failed); a stale, damaged or differently chosen entry is re-tuned,
    so that a release that adds or changes candidates times them once."""
    if not isinstance(entry, dict):
        return None
    config = entry.get("config")
    chosen = next((c for c in candidates if c == config), None)
    tried = [t.get("config") for part in ("timings", "failed") for t in entry.get(part) or ()
             if isinstance(t, dict)]
    if chosen is not None and tried and (len(tried) != len(candidates) or any(c not in tried for c in candidates)):
        return None
    return chosen


# -- timing ---------------------------------------------------------------------------------------------------------
def _do_bench(run: Callable[[], Any], config: Config, device: torch.device) -> float:
    """Median device time of ``run()`` in ms over about ``_REP_MS``, each run timed between two events right after a
    write of ``_CLEAR_BYTES`` (so that it starts with a cold L2, as in ``triton.testing.do_bench``).

    Unlike ``do_bench``, the host first queues enough of those writes for the device to stay busy until every timed
    run is queued: a run whose launch costs the host more than the device spends on the write and the run (a 10 us
    one-row kernel behind 40-80 us of Python) would otherwise have the host's gap counted as its time. On an H100
    ``do_bench`` timed such candidates at 33-46 us that take 13-16 us (RESULTS.md, issue 24).
    """
    backend = get_backend(device.type)
    index = device.index if device.index is not None else backend.current_index()
    clear = torch.empty(_CLEAR_BYTES // 4, dtype=torch.int32, device=device)
    run()
    backend.synchronize(index)
    estimate, host = _event_times(backend, index, run, 5, clear)  # also the warm-up's first part
    clearing = statistics.median(_event_times(backend, index, clear.zero_, 5)[0])
    per_run = max(statistics.median(estimate), 1e-3)
    count = max(3, min(1000, int(_REP_MS / (per_run + clearing))))
    _event_times(backend, index, run, max(1, min(1000, int(_WARMUP_MS / (per_run + clearing)))), clear)
    # the host's expected shortfall over all timed runs, with a margin, paid in advance as clears
    shortfall = count * max(0.0, 1.5 * host - (per_run + clearing))
    lead = min(_LEAD_LIMIT, math.ceil(shortfall / max(clearing, 1e-3)) + 2)
    times, _ = _event_times(backend, index, run, count, clear, lead)
    return float(statistics.median(times))


def _event_times(backend: Any, index: int, run: Callable[[], Any], count: int, clear: torch.Tensor | None = None,
                 lead: int = 0) -> tuple[list[float], float]:
    """(the device ms of ``count`` runs, each between its own two events and after a write of ``clear`` when given;
    the host ms per queued run). ``lead`` writes of ``clear`` are queued first, to keep the device busy."""
    events = [(backend.event(enable_timing=True), backend.event(enable_timing=True)) for _ in range(count)]
    for _ in range(lead):
        clear.zero_()
    began = time.perf_counter()
    for start, end in events:
        if clear is not None:
            clear.zero_()
        start.record()
        run()
        end.record()
    host = (time.perf_counter() - began) * 1e3 / count
    backend.synchronize(index)
    return [start.elapsed_time(end) for start, end in events], host


def _interpreted() -> bool:
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")  # Triton before knobs (< 3.4)


@functools.lru_cache(maxsize=None)
def _device_has_events(device_type: str) -> bool:
    try:
        return get_backend(device_type).event(enable_timing=True) is not None
    except Exception:  # noqa: BLE001 - a backend that cannot make an event cannot time
        return False


def _can_time(device: torch.device) -> bool:
    return not _interpreted() and _device_has_events(device.type)


# -- the cache files -----------------------------------------------------------------------------------------------
def coarse(count: int, low: int, high: int) -> int:
    """``count`` rounded up to ``low`` times a power of 4, clamped to ``[low, high]``: a shape-bucket value.

    Example:
        >>> coarse(8192, 256, 65536), coarse(3, 256, 65536), coarse(10**6, 256, 65536)
        (16384, 256, 65536)
    """
    if count <= low:
        return low
    steps = ((count - 1) // low).bit_length()
    return min(high, low << (steps + (steps & 1)))


def distinct(configs: Sequence[Config]) -> list[Config]:
    """``configs`` without repeats, in order (neighbours of a heuristic coincide at the edges of their range)."""
    out: list[Config] = []
    for config in configs:
        if config not in out:
            out.append(config)
    return out


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def enabled() -> bool:
    """Whether kernels tune their launch configurations (True unless :func:`set_enabled` turned it off)."""
    return _enabled


def set_enabled(flag: bool) -> bool:
    """Turn tuning on or off for this process; off, every kernel launches with its heuristic configuration and the
    cache is neither read nor written. Forgets the configurations chosen so far. Returns the previous value.

    Example:
        >>> previous = set_enabled(False)   # e.g. to time the heuristics against tuned configurations
    """
    global _enabled
    with _lock:
        previous, _enabled = _enabled, bool(flag)
        _forget()
    return previous


def _forget() -> None:
    for tunable in _tunables.values():
        tunable._memo.clear()
        tunable._chosen.clear()


def clear_cache(*, files: bool = True) -> int:
    """Forget this process's choices and, with ``files``, delete the cache files in ``cache_dir()/autotune``.

    Returns the number of files deleted.

    Example:
        >>> clear_cache()   # the next launch of each bucket tunes again
        2
    """
    removed = 0
    with _lock:
        _forget()
        forget_warnings()
        if files:
            directory = cache_directory()
            with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                for name in os.listdir(directory):
                    if name.endswith(".json"):
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(os.path.join(directory, name))
                            removed += 1
    return removed


def entries() -> list[dict[str, Any]]:
    """Every entry of every cache file in ``cache_dir()/autotune``: key, chosen config, timings, failures, and the
    device, Triton and torchport versions of its file.

    Example:
        >>> for e in entries():
        ...     print(e["key"], e["config"], e["ms"])
        rms_norm.forward bfloat16 block_n=4096,rows=16384 {'BLOCK_M': 1, 'num_warps': 8} 0.0121
    """
    out = []
    directory = cache_directory()
    try:
        names = sorted(n for n in os.listdir(directory) if n.endswith(".json") and not n.startswith("."))
    except (FileNotFoundError, NotADirectoryError):
        return out
    for name in names:
        path = os.path.join(directory, name)
        data = load(path)
        if data is None:
            continue
        header = {k: data.get(k) for k in ("device", "capability", "triton", "torchport")}
        for key, entry in sorted(data["entries"].items()):
            if isinstance(entry, Mapping):
                out.append({"file": path, **header, "key": key, **entry})
    return out


def list_tunables() -> list[str]:
    """Names of the kernels that tune (those whose module has been imported)."""
    return sorted(_tunables)
