"""Optional extras: which engine packages are installed, and how to install the missing ones.

Looked up without importing them (importing NIXL starts UCX, importing
Mooncake loads libibverbs), so configuration checks stay cheap. Standard
library only.
"""

from __future__ import annotations

import importlib.util
import os

ENGINES = ("mooncake", "nixl")
EXTRAS = {
    "mooncake": "pip install 'pd-transfer[mooncake]' (and apt-get install libibverbs1)",
    "nixl": "pip install 'pd-transfer[nixl]' (and apt-get install libibverbs1)",
}
_MODULES = {"mooncake": ("mooncake.engine",), "nixl": ("nixl_cu12", "nixl_cu13", "nixl._api")}


def engine_missing(kind: str) -> str:
    """Why engine ``kind`` cannot be used here; "" when its package is installed."""
    for module in _MODULES[kind]:
        parent, _, child = module.partition(".")
        try:
            spec = importlib.util.find_spec(parent)
        except (ImportError, ValueError):
            continue
        if spec is None:
            continue
        if not child:
            return ""
        # look for the submodule's file without importing the parent package
        # (an unrelated PyPI package is also called "mooncake")
        for folder in spec.submodule_search_locations or ():
            try:
                names = os.listdir(folder)
            except OSError:
                continue
            if any(name.partition(".")[0] == child for name in names):
                return ""
    return f"the {kind} engine is not installed: {EXTRAS[kind]}"
