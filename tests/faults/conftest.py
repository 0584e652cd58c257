"""Fault-injection tests: real sidecar processes on 127.0.0.1 and ipc://, checked for leaks.

Every deployment a test builds through ``deployment`` is torn down by the
fixture, which then checks what the test may have leaked: a sidecar that was
not SIGKILLed must exit 0 on SIGTERM, and no shared-memory segment of the
deployment may remain in /dev/shm.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agent"))

import pytest  # noqa: E402
from fault_tools import Deployments  # noqa: E402


@pytest.fixture
def deployment():
    deployments = Deployments()
    yield deployments.make
    problems = deployments.close()
    assert not problems, "after shutdown:\n  " + "\n  ".join(problems)


@pytest.fixture(scope="module")
def module_deployment():
    """One set of deployments for a module whose tests leave the sidecars serving."""
    deployments = Deployments()
    yield deployments.make
    problems = deployments.close()
    assert not problems, "after shutdown:\n  " + "\n  ".join(problems)
