"""The layering in DESIGN.md: pure layers never pull in I/O libraries."""

import subprocess
import sys

import pytest

FORBIDDEN = {
    "pd_transfer.layout": [
        "asyncio",
        "zmq",
        "uvloop",
        "prometheus_client",
        "torch",
        "pd_transfer.protocol",
        "pd_transfer.transport",
        "pd_transfer.agent",
    ],
    "pd_transfer.wire": [
        "asyncio",
        "zmq",
        "socket",
        "selectors",
        "uvloop",
        "prometheus_client",
        "torch",
        "numpy",
        "pd_transfer.layout",
        "pd_transfer.protocol",
        "pd_transfer.security",
        "pd_transfer.transport",
        "pd_transfer.client",
        "pd_transfer.agent",
    ],
}


def _imported_after(module: str) -> set[str]:
    code = (
        f"import sys, importlib, pkgutil; import {module} as m\n"
        "for info in pkgutil.walk_packages(m.__path__, m.__name__ + '.'):\n"
        "    importlib.import_module(info.name)\n"
        "print('\\n'.join(sorted(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return set(out.stdout.split())


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_pure_layer_imports_no_io_modules(layer):
    loaded = _imported_after(layer)
    leaked = [name for name in FORBIDDEN[layer] if name in loaded]
    assert leaked == [], f"{layer} imports {leaked}"
