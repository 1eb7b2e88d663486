"""Timing and peak memory of one kernel benchmark step on one device, for ``bench_kernels.py``: Triton's
``do_bench`` on CUDA (L2 flushed, ``.grad`` reset), CUDA-graph replays for the GPU time alone, a synchronised host
median elsewhere; and :func:`kernel_mode`, which forces torchport's implementation for the torchport rows."""

from __future__ import annotations

import contextlib
import os
import statistics
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

class Device:
    """Timing and peak memory on one device: Triton's do_bench on CUDA, a synchronised median elsewhere."""

    def __init__(self, device: torch.device, warmup_ms: float, rep_ms: float) -> None:
        self.device, self.warmup_ms, self.rep_ms = device, warmup_ms, rep_ms
        self.do_bench = None
        if device.type == "cuda":
            from triton.testing import do_bench

            self.do_bench = do_bench

    def synchronize(self) -> None:
        if self.device.type != "cpu":
            torch.accelerator.synchronize(self.device)

    def median_ms(self, fn: Callable[[], Any], grad_to_none: Sequence[torch.Tensor],
                  restore: Callable[[], None] | None = None) -> float:
        """Median ms of ``fn``; ``restore`` (untimed) rewrites inputs that ``fn`` overwrites before each call."""
        if self.do_bench is not None and restore is None:
            # clears the L2 cache before every repetition and the listed .grad, as a training step would find them
            return float(self.do_bench(fn, warmup=self.warmup_ms, rep=self.rep_ms, grad_to_none=list(grad_to_none),
                                       return_mode="median"))
        if self.device.type == "cuda":
            return self._cuda_events_ms(fn, grad_to_none, restore)
        import torchport

        def once() -> float:
            if restore is not None:
                restore()
            for t in grad_to_none:
                t.grad = None
            with torchport.Timer(self.device) as timer:
                fn()
            return timer.ms

        estimate = max(once(), 1e-3)
        for _ in range(min(100, max(1, int(self.warmup_ms / estimate)))):
            once()
        return statistics.median(once() for _ in range(min(1000, max(5, int(self.rep_ms / estimate)))))

    def _cuda_events_ms(self, fn: Callable[[], Any], grad_to_none: Sequence[torch.Tensor],
                        restore: Callable[[], None]) -> float:
        """do_bench's loop (L2 flush, .grad reset, CUDA events, median) with ``restore`` before each repetition, for
        contenders that write gradients over their inputs: timing them on their own gradients would, after a few
        hundred repetitions, time them on denormals and zeros."""
        flush = torch.empty(256 * 2**20 // 4, dtype=torch.int32, device=self.device)  # as do_bench: 256 MB

        def once(start: torch.cuda.Event, end: torch.cuda.Event) -> None:
            restore()
            for t in grad_to_none:
                t.grad = None
            flush.zero_()
            start.record()
            fn()
            end.record()

        def run(count: int) -> list[float]:
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                      for _ in range(count)]
            for start, end in events:
                once(start, end)
            torch.cuda.synchronize(self.device)
            return [start.elapsed_time(end) for start, end in events]

        estimate = max(statistics.median(run(5)), 1e-3)
        run(max(1, int(self.warmup_ms / estimate)))
        return statistics.median(run(max(1, int(self.rep_ms / estimate))))

    def graph_ms(self, fn: Callable[[], Any], grad_to_none: Sequence[torch.Tensor]) -> float | None:
        """Median ms of one replay of ``fn`` captured in a CUDA graph: the GPU time alone, without the host's
        launch overhead (which, at these sizes, is longer than the kernels on this machine's CPU). None off CUDA."""
        if self.device.type != "cuda":
            return None
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(3):
                for t in grad_to_none:
                    t.grad = None
                fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        for t in grad_to_none:
            t.grad = None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()  # the .grad tensors made here are rewritten in place by every replay
        ms = float(self.do_bench(graph.replay, warmup=self.warmup_ms, rep=self.rep_ms, return_mode="median"))
        for t in grad_to_none:
            t.grad = None
        del graph
        return ms

    def peak_mib(self, fn: Callable[[], Any], grads_of: Sequence[torch.Tensor]) -> float | None:
        """Most memory allocated during one call beyond what was allocated before it (None on the CPU)."""
        if self.device.type == "cpu":
            return None
        for t in grads_of:
            t.grad = None
        self.synchronize()
        before = torch.accelerator.memory_allocated(self.device)
        torch.accelerator.reset_peak_memory_stats(self.device)
        fn()
        self.synchronize()
        peak = torch.accelerator.max_memory_allocated(self.device) - before
        for t in grads_of:
            t.grad = None
        return peak / 2**20

    def copy_gbps(self, nbytes: int) -> float:
        """Device-to-device copy bandwidth, counting bytes read plus written."""
        src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=self.device).normal_()
        dst = torch.empty_like(src)
        ms = self.median_ms(lambda: dst.copy_(src), ())
        return 2 * nbytes / (ms * 1e-3) / 1e9


@contextlib.contextmanager
def kernel_mode(mode: str) -> Iterator[None]:
    """Force torchport's kernel implementation, in code and in the environment: the CUDA autograd engine runs
    backward on its own thread, which sees the environment but not this thread's settings.override."""
    import torchport

    saved = os.environ.get("TORCHPORT_KERNELS")
    os.environ["TORCHPORT_KERNELS"] = mode
    try:
        with torchport.settings.override(kernels=mode):
            yield
    finally:
        if saved is None:
            del os.environ["TORCHPORT_KERNELS"]
        else:
            os.environ["TORCHPORT_KERNELS"] = saved
