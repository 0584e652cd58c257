"""The oracle is independent ground truth: it never loads the code it checks."""

from __future__ import annotations

import subprocess
import sys

FORBIDDEN = (
    "pd_transfer.layout.planner",
    "pd_transfer.layout.reconcile",
    "pd_transfer.layout.token_map",
    "pd_transfer.layout.page_sizes",
    "pd_transfer.layout.lowering",
    "pd_transfer.layout.sharding",
    "pd_transfer.protocol",
    "pd_transfer.transport",
    "pd_transfer.agent",
    "pd_transfer.client",
    "zmq",
)


def test_testing_kit_imports_no_planner_reconciliation_or_upper_layer():
    code = (
        "import sys, pd_transfer.testing, pd_transfer.testing.world\n"
        f"bad = [m for m in sys.modules if m.startswith({FORBIDDEN!r})]\n"
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
