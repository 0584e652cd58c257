"""Stand-in for torchvision in pd-transfer's SGLang test environment.

The index's torchvision is built against a CUDA torch; SGLang and transformers
import it at module level for image and video processing, which the transfer
tests never use. Every submodule imports, and every name in it is a
placeholder that raises when called."""

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+stub"


class Unavailable:
    def __init__(self, name):
        self._name = name

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Unavailable(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"torchvision is a stub in this environment: {self._name} is unavailable")

    def __mro_entries__(self, bases):
        return (object,)


def _module_getattr(module_name):
    def __getattr__(name):
        if name.startswith("__"):
            raise AttributeError(name)
        return Unavailable(f"{module_name}.{name}")

    return __getattr__


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _module_getattr(spec.name)
        return module

    def exec_module(self, module):
        pass


sys.meta_path.append(_StubFinder())
__getattr__ = _module_getattr(__name__)
