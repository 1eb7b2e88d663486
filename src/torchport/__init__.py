"""torchport: write PyTorch once, run it on an Ascend NPU, an NVIDIA or AMD GPU, or a CPU.

Example:
    >>> import torchport
    >>> dev = torchport.device()            # npu > cuda > xpu > mps > cpu, or TORCHPORT_DEVICE
    >>> model = model.to(dev, torchport.dtype(dev))
"""

from __future__ import annotations

__version__ = "0.1.0"

from . import _settings as settings  # noqa: E402
from .device import device, devices, dtype, generator, seed, synchronize  # noqa: E402
from .info import info  # noqa: E402
from .memory import empty_cache, memory  # noqa: E402
from .timer import Timer  # noqa: E402
from .weights import load_safetensors  # noqa: E402

__all__ = [
    "__version__",
    "Timer",
    "device",
    "devices",
    "dtype",
    "empty_cache",
    "generator",
    "info",
    "load_safetensors",
    "memory",
    "seed",
    "settings",
    "synchronize",
]

# Every public subpackage (and the public modules not imported above) is imported on first use:
# ``torchport.kernels.rms_norm(...)`` or ``torchport.distributed.init()`` works after a bare ``import torchport``
# without making that import slower. ``torchport.backends`` is imported above (the device API is built on it), and
# ``torchport.auto`` is left out: importing it redirects CUDA calls, which an attribute lookup must never do.
_LAZY_SUBPACKAGES = frozenset({"attention", "bench", "cli", "compat", "compile", "distributed", "doctor", "export",
                               "kernels", "migrate", "models", "modes", "offload", "quant", "testing", "ui",
                               "verify"})
# Functions served from a lazy subpackage: ``torchport.patch(model)`` imports torchport.models (and transformers
# only when it patches).
_LAZY_FUNCTIONS = {"patch": "models", "patch_transformers": "models", "unpatch": "models", "quantize": "quant",
                   "enable": "modes", "disable": "modes"}


def __getattr__(name: str):
    if name in _LAZY_SUBPACKAGES or name in _LAZY_FUNCTIONS:
        import importlib

        module = importlib.import_module(f"{__name__}.{_LAZY_FUNCTIONS.get(name, name)}")
        return getattr(module, name) if name in _LAZY_FUNCTIONS else module
    raise AttributeError(f"module 'torchport' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _LAZY_SUBPACKAGES | set(_LAZY_FUNCTIONS))

def _start_simulation() -> None:
    try:
        wanted, count = settings.value("simulate"), settings.value("simulate_devices")
    except ValueError:
        return  # the same error is raised, with its message, by the first call that reads the settings
    if wanted is not None and wanted.partition(":")[0] == "npu":  # "npu" or "npu:<soc>"
        from .testing import simulate_npu

        simulate_npu(count, soc=wanted.partition(":")[2] or None)


_start_simulation()
