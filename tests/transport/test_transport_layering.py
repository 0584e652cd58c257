"""The transport layer sits under the agent: it never imports the agent or the protocol."""

import subprocess
import sys


def test_transport_imports_neither_agent_nor_protocol():
    code = "import sys, pd_transfer.transport, pd_transfer.memory.segments\nprint('\\n'.join(sorted(sys.modules)))"
    loaded = set(
        subprocess.run(
            [sys.executable, "-c", code], check=True, capture_output=True, text=True
        ).stdout.split()
    )
    assert not [
        m for m in loaded if m.startswith(("pd_transfer.agent", "pd_transfer.protocol", "pd_transfer.client"))
    ]


def test_shm_module_needs_no_sockets():
    # (torch itself imports asyncio, so only zmq and the upper layers are checked)
    code = "import sys, pd_transfer.memory.segments\nprint('\\n'.join(sorted(sys.modules)))"
    loaded = set(
        subprocess.run(
            [sys.executable, "-c", code], check=True, capture_output=True, text=True
        ).stdout.split()
    )
    assert "zmq" not in loaded and not [m for m in loaded if m.startswith("pd_transfer.transport")]
