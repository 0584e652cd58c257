"""The protocol layer is sans-IO: importing it loads no socket, event loop or upper layer."""

import subprocess
import sys

FORBIDDEN = [
    "asyncio",
    "socket",
    "selectors",
    "zmq",
    "uvloop",
    "prometheus_client",
    "torch",
    "pd_transfer.transport",
    "pd_transfer.agent",
    "pd_transfer.client",
]


def test_protocol_imports_no_io_modules():
    code = (
        "import sys, importlib, pkgutil\n"
        "import pd_transfer.protocol as m\n"
        "for info in pkgutil.walk_packages(m.__path__, m.__name__ + '.'):\n"
        "    importlib.import_module(info.name)\n"
        "print('\\n'.join(sorted(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    loaded = set(out.stdout.split())
    assert [name for name in FORBIDDEN if name in loaded] == []
