"""``import torchport.auto`` redirects CUDA calls to the detected device (or ``TORCHPORT_SHIM``), then carries on.

Example:
    import torchport.auto  # noqa: F401  -- first line of a CUDA-written script
"""

from __future__ import annotations

from . import _settings, compat

compat.patch(_settings.value("shim"))
