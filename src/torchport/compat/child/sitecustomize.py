"""Start-up hook for processes started by a program under ``torchport run``.

``torchport run`` puts this folder first on PYTHONPATH and the target in TORCHPORT_SHIM, so that DataLoader workers
(spawn), ``torch.multiprocessing`` children and ``subprocess`` Pythons run with the shim too. Nothing is imported
until the process imports torch; the shim is then installed right after torch finishes loading. Any other
``sitecustomize`` further down the path still runs.
"""

import importlib.abc
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


class _PatchAfterTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("torch")
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        original_exec = loader.exec_module

        def exec_module(module):
            loader.exec_module = original_exec
            original_exec(module)
            from torchport import compat

            compat.patch(os.environ.get("TORCHPORT_SHIM"))

        loader.exec_module = exec_module
        return spec


def _chain():
    for entry in sys.path:
        folder = os.path.abspath(entry or os.curdir)
        candidate = os.path.join(folder, "sitecustomize.py")
        if folder != _HERE and os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_torchport_chained_sitecustomize", candidate)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return


if os.environ.get("TORCHPORT_SHIM") and "torch" not in sys.modules:
    sys.meta_path.insert(0, _PatchAfterTorch())
_chain()
