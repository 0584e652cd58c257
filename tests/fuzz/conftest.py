"""Fuzz tests of a live sidecar: report how many frames were tried, per socket."""

import sys
from pathlib import Path

_TESTS = Path(__file__).resolve().parents[1]
for helper_dir in ("agent", "faults", "protocol"):
    if str(_TESTS / helper_dir) not in sys.path:
        sys.path.insert(0, str(_TESTS / helper_dir))

import pytest  # noqa: E402
from fault_tools import Deployments  # noqa: E402
from fuzz_frames import FRAMES_SENT, FRAMES_SKIPPED  # noqa: E402


@pytest.fixture(scope="module")
def module_deployment():
    deployments = Deployments()
    yield deployments.make
    problems = deployments.close()
    assert not problems, "after shutdown:\n  " + "\n  ".join(problems)


def pytest_terminal_summary(terminalreporter):
    if FRAMES_SENT:
        parts = ", ".join(f"{name} {count}" for name, count in sorted(FRAMES_SENT.items()))
        skipped = "".join(f"; not sent: {count} {why}" for why, count in FRAMES_SKIPPED.items())
        terminalreporter.write_line(
            f"sidecar fuzz: {sum(FRAMES_SENT.values())} frames sent to a live prefill sidecar "
            f"({parts}){skipped}"
        )
