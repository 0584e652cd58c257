"""pd_transfer.security is sans-IO: importing all of it pulls in no sockets, loop or agent."""

import subprocess
import sys

FORBIDDEN = [
    "asyncio",
    "zmq",
    "uvloop",
    "prometheus_client",
    "torch",
    "pd_transfer.agent",
    "pd_transfer.transport",
    "pd_transfer.client",
]


def test_security_layer_imports_no_io_modules():
    code = (
        "import sys, importlib, pkgutil; import pd_transfer.security as m\n"
        "for info in pkgutil.walk_packages(m.__path__, m.__name__ + '.'):\n"
        "    importlib.import_module(info.name)\n"
        "print('\\n'.join(sorted(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    loaded = set(out.stdout.split())
    assert [name for name in FORBIDDEN if name in loaded] == []
