"""Launching a Triton kernel with less host work than ``kernel[grid](...)``: the compiled kernel is bound once per
specialisation and its launcher called directly.

Every ``kernel[grid](*args)`` in Triton 3.6 runs ``JITFunction.run``: it binds the arguments to the signature and
specialises each one (dtype, 16-byte alignment, integer width, equal to 1), turns that into a string cache key,
looks the compiled kernel up, checks the kernel's global variables, builds launch metadata for the launch hooks (an
empty chain unless a profiler added one), and only then calls the compiled launcher. :class:`Kernel` does the first
launch of each specialisation through Triton (which compiles, caches and checks as usual), keeps the compiled
kernel, and afterwards computes only a cheap key of the arguments' specialisation and calls the launcher with the
current stream. On an H100 host, the RMSNorm forward kernel on a 4 x 64 input costs 30.9 us per launch through
``kernel[grid]``, 22.2 us through :meth:`Kernel.launch` and 11.8 us for the compiled launcher alone
(``benchmarks/kernel_host_overhead.py --pieces``; benchmarks/RESULTS.md).

The normal ``kernel[grid](...)`` path is kept where the direct one cannot be used: under Triton's interpreter
(``TRITON_INTERPRET=1``), while a launch hook is installed (profilers such as Proton watch launches through it) or
the kernel has a pre-run hook (``JITFunction.add_pre_run_hook``), for kernels whose constexpr parameters do not all
follow the others, and for unhashable arguments.

The compiled launcher is called as Triton's own ``JITFunction.run`` calls it: grid, stream, function, packed
metadata, launch metadata, the two hook chains, then every parameter. Triton 3.4 to 3.9 call it so
(``triton/runtime/jit.py``, ``JITFunction.run``, read in the wheels of 3.4.0, 3.5.1, 3.6.0, 3.7.1, 3.8.0 and 3.9.0).

Example:
    >>> FORWARD = Kernel(_fwd_kernel)
    >>> FORWARD.launch((programs,), x, y, n, BLOCK=1024, num_warps=4)   # same as _fwd_kernel[(programs,)](...)
"""

from __future__ import annotations

from typing import Any

import torch
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

try:
    from triton import knobs
except ImportError:  # Triton before 3.4: its compiled kernels take other arguments; Kernel uses Triton's path
    knobs = None

__all__ = ["Kernel", "Prepared", "specialisation"]

_MEMO_SIZE = 1024  # bound kernels kept per Kernel before the memo starts over
_Tensor = torch.Tensor


def specialisation(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """A key of ``args`` under which Triton's specialisation is fixed (equal keys get the same compiled kernel):
    a tensor's dtype and its address modulo 16, and every other argument's value and type.

    Triton specialises a tensor on its dtype and whether its address is a multiple of 16, an integer on its width,
    whether it is 1 and whether it is a multiple of 16, a float or a bool on nothing: values decide all of it. Keying
    integers by value rather than by those classes costs one Triton launch per new value (a new row count) and saves
    computing the classes on every call.
    """
    return (*[(a.dtype, a.data_ptr() & 15) if isinstance(a, _Tensor) else a for a in args], *map(type, args))


class Kernel:
    """A ``@triton.jit`` function whose launches skip Triton's per-call binding once a specialisation is compiled.

    ``launch(grid, *args, **meta)`` does what ``fn[grid](*args, **meta)`` does: ``args`` are the kernel's runtime
    parameters, in order; ``meta`` its constexpr parameters (by name) and launch options (``num_warps``). A
    specialisation's first launch goes through Triton and binds its compiled kernel; later ones call it directly.
    """

    __slots__ = ("_bound", "_constexprs", "_direct", "_pre_run", "fn", "name")

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.name = getattr(fn, "__name__", repr(fn))
        self._bound: dict[tuple[Any, ...], tuple[Any, ...]] = {}
        params = getattr(fn, "params", None)
        # The launcher takes every parameter in order, constexprs included (it ignores their values): runtime
        # arguments then constexpr values. Kernels whose constexprs sit between runtime parameters keep Triton's path.
        self._direct = knobs is not None and isinstance(fn, JITFunction) and params is not None \
            and _constexprs_last(params)
        self._constexprs = tuple(p.name for p in params if p.is_constexpr) if self._direct else ()
        # the kernel's own pre-run hooks, a list that add_pre_run_hook appends to: while it holds any, Triton's path
        self._pre_run = getattr(fn, "pre_run_hooks", None) if self._direct else None

    def __repr__(self) -> str:
        return f"Kernel({self.name}, {len(self._bound)} bound)"

    def launch(self, grid: tuple[int, ...], *args: Any, **meta: Any) -> None:
        """``fn[grid](*args, **meta)``, directly once this specialisation has been launched before."""
        runtime = knobs.runtime if self._direct else None
        # Triton 3.6's hooks are chains, empty unless a profiler added to them; any other hook object counts too
        if runtime is None or self._pre_run or _hooked(runtime.launch_enter_hook) \
                or _hooked(runtime.launch_exit_hook):
            self.fn[grid](*args, **meta)
            return
        active = driver.active
        device = active.get_current_device()
        key = (device, *meta.items(), *specialisation(args))
        try:
            bound = self._bound.get(key)
        except TypeError:  # an argument the key cannot hold: Triton's own path
            bound = key = None
        if bound is None:
            self._bind(key, grid, args, meta)
            return
        run, function, packed, constexprs = bound
        grid_y = grid[1] if len(grid) > 1 else 1
        grid_z = grid[2] if len(grid) > 2 else 1
        run(grid[0], grid_y, grid_z, active.get_current_stream(device), function, packed, None, None, None,
            *args, *constexprs)

    def prepare(self, grid: tuple[int, ...], *args: Any, **meta: Any) -> Prepared | None:
        """The launch ``launch(grid, *args, **meta)`` would make, bound with its grid, its compiled kernel and its
        constexprs, for a caller that will launch the same specialisation again with new arguments and wants to skip
        even the key of :meth:`launch`. None where :meth:`launch` would take Triton's path, or before this
        specialisation has been launched once (launch first, then prepare).

        Example:
            >>> DEQUANTIZE.launch(grid, *args, **meta)
            >>> prepared = DEQUANTIZE.prepare(grid, *args, **meta)
            >>> prepared.launch(new_args)   # False: launch it through DEQUANTIZE.launch instead
        """
        if not self._direct:
            return None
        device = driver.active.get_current_device()
        try:
            bound = self._bound.get((device, *meta.items(), *specialisation(args)))
        except TypeError:
            return None
        return None if bound is None else Prepared(self, grid, device, bound)

    def _bind(self, key: tuple[Any, ...] | None, grid: tuple[int, ...], args: tuple[Any, ...],
              meta: dict[str, Any]) -> None:
        compiled = self.fn[grid](*args, **meta)  # compiles or finds the kernel, checks it, launches it
        runner = getattr(compiled, "run", None)
        if key is None or runner is None or getattr(compiled, "function", None) is None \
                or len(args) + len(self._constexprs) != len(self.fn.params) \
                or any(name not in meta for name in self._constexprs):
            return  # this launch stays on Triton's path: a default constexpr, or an object that is not a kernel
        if len(self._bound) >= _MEMO_SIZE:
            self._bound.clear()
        self._bound[key] = (runner, compiled.function, compiled.packed_metadata,
                            tuple(meta[name] for name in self._constexprs))


class Prepared:
    """One specialisation of a :class:`Kernel` with its grid fixed (:meth:`Kernel.prepare`): :meth:`launch` calls
    the compiled launcher with new runtime arguments and computes nothing about them. The caller guarantees that
    they specialise as the prepared ones did: same dtypes, same integer and flag values, tensors on the same
    16-byte alignment (a fresh allocation of the caching allocator always is).
    """

    __slots__ = ("_bound", "_device", "_grid", "kernel")

    def __init__(self, kernel: Kernel, grid: tuple[int, ...], device: int, bound: tuple[Any, ...]) -> None:
        self.kernel = kernel
        self._grid = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
        self._device = device
        self._bound = bound

    def launch(self, args: tuple[Any, ...]) -> bool:
        """Launch with ``args`` (the kernel's runtime arguments, in order) on the current stream; False, launching
        nothing, where the prepared launcher may not be used now: another current device, or a launch or pre-run
        hook installed since (then launch through :meth:`Kernel.launch`)."""
        runtime = knobs.runtime
        if self.kernel._pre_run or _hooked(runtime.launch_enter_hook) or _hooked(runtime.launch_exit_hook):
            return False
        active = driver.active
        if active.get_current_device() != self._device:
            return False
        run, function, packed, constexprs = self._bound
        x, y, z = self._grid
        run(x, y, z, active.get_current_stream(self._device), function, packed, None, None, None, *args, *constexprs)
        return True


def _hooked(hook: Any) -> bool:
    return hook is not None and bool(getattr(hook, "calls", True))


def _constexprs_last(params: list[Any]) -> bool:
    flags = [p.is_constexpr for p in params]
    return flags == sorted(flags)  # False (runtime) before True (constexpr)
