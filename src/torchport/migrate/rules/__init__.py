"""The built-in rules of ``torchport migrate``: one function per CUDA idiom, registered by id.

Every rule returns plain PyTorch that does on CUDA what the original did, and also runs on any other accelerator
(through ``torch.accelerator`` and ``torch.get_device_module``) and on a CPU-only machine. ``DEVICE`` in the rules is
the one definition the transformer puts after the imports of a module that needs it:
``DEVICE = torch.accelerator.current_accelerator(check_available=True) or torch.device("cpu")``. "The CUDA module" is
``torch.`` + ``cuda``; golden before/after pairs for every rule are in ``tests/migrate/test_rules.py``.

One module per family of idioms: :mod:`.devices` (devices named by strings, device checks, ``is_cuda``,
``.cuda()``), :mod:`.cuda_module` (the CUDA module's functions, events and streams), :mod:`.amp` (automatic mixed
precision), :mod:`.distributed` (process groups, DistributedDataParallel), :mod:`.legacy_types` (``FloatTensor``
and the other legacy typed tensors), and :mod:`torchport.migrate.device_index` (devices written as integers).
"""

from __future__ import annotations

# Rules of one node type are tried in the order they were registered: the families are imported in this order.
from . import devices  # noqa: F401
from . import cuda_module  # noqa: F401
from . import amp  # noqa: F401
from . import distributed  # noqa: F401
from . import legacy_types  # noqa: F401
from .. import device_index  # noqa: F401

__all__: list[str] = []
