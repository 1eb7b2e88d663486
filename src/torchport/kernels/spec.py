"""What torchport knows about an op besides its implementations: one :class:`OpSpec`, declared next to the op in
``kernels/<op>.py`` and registered with :func:`torchport.kernels.registry.register_op`.

Everything that lists ops reads the specs: ``torchport.kernels`` (its ``__all__`` and the table of its docstring),
:mod:`torchport.kernels.library` (the custom ops for compiled graphs), the dashboard's Kernels tab, the benchmarks
and the tests. Adding an op is adding ``kernels/<op>.py`` (and its Triton file).

Example:
    >>> from torchport.kernels.registry import list_specs
    >>> spec = list_specs()["rms_norm"]
    >>> x, weight = spec.inputs("small")
    >>> spec.bytes_moved(x, weight) / 2**20
    20.0
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["SIZES", "TOLERANCE", "CustomOp", "OpSpec", "randn", "rope_tables", "targets"]

#: The sizes every spec names: ``test`` (small and irregular, for the tests), ``smoke`` (``bench_kernels.py
#: --small``, seconds on a CPU), ``small``/``medium``/``large`` (the dashboard) and ``benchmark`` (the shapes of
#: the published benchmarks).
SIZES = ("test", "smoke", "small", "medium", "large", "benchmark")
#: Largest relative error ``||out - ref|| / ||ref||`` against a float64 reference, per dtype of the inputs. bf16
#: keeps 8 bits (one rounding of the output costs up to 2^-9 = 2e-3 per element), fp16 11 bits (2^-12 = 2.4e-4).
TOLERANCE: Mapping[torch.dtype, float] = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


@dataclasses.dataclass(frozen=True)
class CustomOp:
    """``torch.ops.torchport.<name>`` and its backward ``torch.ops.torchport.<name>_backward``, which
    :mod:`torchport.kernels.library` registers from this description: an op that follows the defaults declares its
    schema alone.

    Attributes:
        schema: the forward's schema, ``"(Tensor x, Tensor weight, float eps, float offset) -> Tensor"``. Its
            ``Tensor`` arguments are the ones a backward can differentiate.
        like: for each output, the argument whose shape, dtype and layout it has (``torch.empty_like`` of it): the
            fake implementation, and the layout the real outputs are given. None when :attr:`fake` says.
        fake: ``(*args) -> outputs`` of the right shapes and dtypes (``new_empty``), for outputs no argument has
            the shape of; only with ``like=None``.
        forward: ``(*args) -> outputs`` on detached tensors, when the spec's ``call`` is not what the op computes
            (the losses reduce in float32); default ``call``.
        backward: ``(grads, needs, *args) -> gradients``: one entry per ``Tensor`` argument (None where ``needs``
            is False or the argument is None), from one upstream gradient per output. Default: *recompute*, the
            forward run again on the saved inputs with autograd, through the kernel's own backward.
        saved: ``(needs) -> keep``: for each ``Tensor`` argument, whether the backward needs it, given which
            arguments need a gradient; the others reach the backward as None (and its schema declares every tensor
            argument optional). Default: all are kept.
        precomputed: the forward computes the gradients in its own passes (the fused loss): its schema returns a
            scalar result, then one tensor per ``Tensor`` argument, the gradient of the result for an upstream
            gradient of 1 (empty where none was computed). They are saved, never differentiated, and the public
            function returns the result alone. The backward multiplies them by the upstream gradient (plain
            PyTorch, which a compiler fuses); where all are empty (``reduction="none"``) :attr:`backward` runs.
    """

    schema: str
    like: tuple[int, ...] | None = (0,)
    fake: Callable[..., Any] | None = None
    forward: Callable[..., Any] | None = None
    backward: Callable[..., tuple[torch.Tensor | None, ...]] | None = None
    saved: Callable[[tuple[bool, ...]], tuple[bool, ...]] | None = None
    precomputed: bool = False

    def __post_init__(self) -> None:
        if (self.like is None) == (self.fake is None):
            raise ValueError(f"custom op {self.schema!r}: give exactly one of like= (the arguments the outputs "
                             "look like) and fake= (a function making them)")


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """One op: how to call it, make inputs for it, count what it moves, check it, and list it.

    Attributes:
        name: the op's registry name (``"rms_norm"``), also its ``TORCHPORT_KERNELS`` key.
        title: a short display name (``"RMSNorm"``).
        summary: what it computes, one line (``torchport.kernels``' table).
        exports: the names its module adds to ``torchport.kernels`` (functions and modules).
        dims: what the numbers of a size mean (``"rows × hidden"``).
        sizes: one entry per name of :data:`SIZES`.
        make: ``(generator or None, *dims) -> arguments`` of :attr:`call`: float32 tensors (integer ones for
            targets and codes) on the generator's device, the host without one; under ``torch.device("meta")`` it
            makes shapes only.
        call: the public function on the made arguments (in their dtype and device): ``call(*args) -> output``.
        differentiable: how many leading arguments get a gradient in a forward + backward.
        bytes_moved: ``(*args) -> int``, the fewest bytes one forward + backward must move (weight and bias vectors
            left out): the roofline numerator of the benchmarks.
        flops: ``(*args) -> int`` for ops bounded by arithmetic (matmuls), else None.
        tolerance: the largest relative error against a float64 reference, per dtype (default :data:`TOLERANCE`).
        custom_op: ``torch.ops.torchport.<name>`` for compiled graphs (:mod:`torchport.kernels.library`), None
            when the op has none: its :class:`CustomOp`, or its forward's schema alone when the defaults fit (the
            outputs look like the first argument, the backward recomputes).
        in_place: the op takes ``in_place=True`` (gradients written over its inputs), called as
            ``call(*args, in_place=True)``.
    """

    name: str
    title: str
    summary: str
    exports: tuple[str, ...]
    dims: str
    sizes: Mapping[str, tuple[int, ...]]
    make: Callable[..., tuple[Any, ...]]
    call: Callable[..., Any]
    differentiable: int
    bytes_moved: Callable[..., int]
    flops: Callable[..., int] | None = None
    tolerance: Mapping[torch.dtype, float] = dataclasses.field(default_factory=lambda: dict(TOLERANCE))
    custom_op: CustomOp | str | None = None
    in_place: bool = False

    def __post_init__(self) -> None:
        missing = [size for size in SIZES if size not in self.sizes]
        if missing:
            raise ValueError(f"op spec {self.name!r} has no size {', '.join(missing)}; every spec names {SIZES}")
        if isinstance(self.custom_op, str):
            object.__setattr__(self, "custom_op", CustomOp(self.custom_op))

    def inputs(self, size: str, generator: torch.Generator | None = None) -> tuple[Any, ...]:
        """Host arguments of ``size`` (one of :data:`SIZES`), float32 where floating.

        Example:
            >>> [tuple(t.shape) for t in list_specs()["swiglu"].inputs("test")]
            [(3, 37), (3, 37)]
        """
        if size not in self.sizes:
            raise ValueError(f"{self.name}: size {size!r} is not one of {', '.join(SIZES)}")
        return self.make(generator, *self.sizes[size])

    def describe(self, size: str) -> str:
        """The shape a size stands for: ``"rows × hidden 1024×1024"``."""
        return f"{self.dims} {'×'.join(map(str, self.sizes[size]))}"


# -- input builders shared by the specs ------------------------------------------------------------------------------
def _device(gen: torch.Generator | None) -> torch.device | None:
    # a generator draws on its own device: a benchmark makes its large inputs there, not on the host
    return None if gen is None else gen.device


def randn(gen: torch.Generator | None, shape: tuple[int, ...], scale: float = 1.0) -> torch.Tensor:
    """``scale`` times a float32 standard-normal tensor, on the generator's device (the host without one)."""
    return scale * torch.randn(tuple(shape), generator=gen, device=_device(gen))


def targets(gen: torch.Generator | None, rows: int, vocab: int) -> torch.Tensor:
    """Class indices for ``rows`` rows, every 16th one ``-100`` (padding, as a batch of uneven sequences has)."""
    target = torch.randint(0, vocab, (rows,), generator=gen, device=_device(gen))
    target[::16] = -100
    return target


def rope_tables(seq: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``sin`` ``[seq, head_dim]`` as LlamaRotaryEmbedding makes them: one angle per position and
    frequency, then ``cat(freqs, freqs)``."""
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    freqs = torch.arange(seq, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()
